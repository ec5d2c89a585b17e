"""Reshard refit demo: Megatron TP2 trainer ranks send each engine rank only its
own shards (fused QKV / gate_up per engine TP rank), straight from the trainer
ranks that own them; each engine replica passes a KL gate against Megatron's
logits before it serves the next fan-out wave.

``examples/demo.py`` can call :func:`run_reshard_demo`. Four ranks in one job
(gloo on CPU, NCCL with 4 GPUs): ranks 0, 1 are the trainer (Megatron TP2),
ranks 2, 3 two engine replicas (TP1 each); replica 2 is updated from the trainer
and then serves replica 3 (fan-out).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.testing import tiny_llama  # noqa: E402
from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402

SPEC = tiny_llama.TinyLlamaSpec(arch="llama")


def _rank(versions: int):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    rank = dist.get_rank()
    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = tiny_llama.transformer_config(SPEC, tp=2)
    model = tiny_llama.build_model(SPEC, cfg, device=device)
    specs = wx.specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size)
    src = wx.megatron_layout(specs, tp=2, ranks=[0, 1])  # data-parallel replica 0 of the trainer
    dst = wx.inference_layout(specs, tp=1, dp=2, ranks=[2, 3])  # two engine replicas
    engine = {n: torch.zeros(lt.shape, device=device) for n, lt in dst.tensors.get(rank, {}).items()}
    tensors = {**(wx.megatron_tensors(model) if rank in src.ranks else {}), **engine}
    refit = wx.FanoutRefit(src, dst, [[2], [3]], rank, tensors)  # plans built once, reused every version
    toks = tiny_llama.tokens(SPEC)
    # the KL gate: each engine replica (TP1) as an HF model, checked after its wave, before it serves the next
    gate = (
        wx.RefitGate(wx.HFModelConsumer(tiny_llama.hf_model(SPEC, cfg).to(device)), toks, None, max_kl=1e-3)
        if rank in dst.ranks
        else None
    )
    rows = []
    for version in range(1, versions + 1):
        with torch.no_grad():  # stand-in for an optimizer step
            for p in model.parameters():
                p.mul_(0.99)
        ref = wx.megatron_logits(model, toks)  # this version's reference (every Megatron rank: TP collectives)
        if gate is not None:
            gate.reference = ref
        dist.barrier()  # time the refit, not the previous version's verification
        stats = refit.refit(version, verify=gate)
        row = dict(
            version=version,
            received=sum(s.received_bytes for s in stats),
            sent=sum(s.sent_bytes for s in stats),
            seconds=sum(s.seconds for s in stats),
        )
        if rank in dst.ranks:
            row["kl"] = next(s.kl for s in stats if s.kl is not None)
        rows.append(row)
    return dict(rows=rows, transfers=len(refit.plans[0].transfers) + len(refit.plans[-1].transfers))


def run_reshard_demo(versions: int = 2, backend: str | None = None) -> list[dict]:
    """Run the demo; print and return each rank's per-version rows (bytes, seconds, KL on engine ranks)."""
    if backend is None:
        backend = "nccl" if torch.cuda.device_count() >= 4 else "gloo"
    results = run_on_ranks(_rank, 4, args=(versions,), backend=backend, timeout=300)
    print(f"\nreshard refit (Megatron TP2 on ranks 0,1 -> engine TP1 replicas on ranks 2,3; fan-out), {backend}")
    print(f"{'rank':>4} {'role':>8} {'version':>7} {'sent KB':>8} {'recv KB':>8} {'ms':>7} {'KL':>9}")
    for r, res in enumerate(results):
        role = "trainer" if r < 2 else "engine"
        for row in res["rows"]:
            kl = f"{row['kl']:.1e}" if "kl" in row else "-"
            print(
                f"{r:>4} {role:>8} {row['version']:>7} {row['sent'] / 1024:8.1f} {row['received'] / 1024:8.1f} "
                f"{row['seconds'] * 1e3:7.2f} {kl:>9}"
            )
    return results


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_reshard_demo()
