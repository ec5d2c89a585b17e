"""Reshard refit between real Megatron TP2 ranks and engine ranks in one job:
the engine's local tensors (fused QKV / gate_up per engine TP rank) equal the
HF weights that the export hook gathers from the same model, exactly, and each
receiver gets only the bytes it keeps."""

import pytest
import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2")  # QKV bias: a fused 1-D tensor too
# name: (trainer ranks, engine layout kwargs)
CASES = {
    "tp2_to_tp1dp2": (dict(tp=2, ranks=[0, 1]), dict(tp=1, dp=2, ranks=[2, 3])),
    "tp2_to_tp2": (dict(tp=2, ranks=[0, 1]), dict(tp=2, ranks=[2, 3])),
    "tp2dp2_to_tp2dp2_colocated": (dict(tp=2, dp=2), dict(tp=2, dp=2)),
}


def _specs(cfg):
    from megatron_ext.weight_export.layout import specs_from_config

    return specs_from_config(cfg, vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size,
                             tie_embeddings=SPEC.tie_embeddings)


def _layouts(cfg, case):
    from megatron_ext.weight_export.layout import inference_layout, megatron_layout

    mk, ek = CASES[case]
    specs = _specs(cfg)
    return megatron_layout(specs, **mk), inference_layout(specs, **ek)


def _body(backend):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.weight_export.reshard import ReshardExecutor, megatron_tensors
    from megatron_ext.weight_export.reshard_plan import build_reshard_plan

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    cfg = tiny_llama.transformer_config(SPEC, tp=2)
    model = tiny_llama.build_model(SPEC, cfg, device=device)
    # the reference: the export hook's full HF tensors (gathered to rank 0)
    got = {}
    receiver = wx.WeightReceiver(wx.LoadWeightsConsumer(lambda ws: got.update({n: t.cpu().clone() for n, t in ws})))
    wx.WeightExporter(model, wx.WeightExportConfig(vocab_size=SPEC.hf_vocab_size), receiver=receiver).export()
    out = {"reference": got if rank == 0 else None}
    params = megatron_tensors(model)
    for case in CASES:
        src, dst = _layouts(cfg, case)
        plan = build_reshard_plan(src, dst)
        tensors = dict(params) if rank in src.ranks else {}
        engine = {n: torch.full(lt.shape, float("nan"), device=device)
                  for n, lt in dst.tensors.get(rank, {}).items()}
        tensors.update(engine)
        ex = ReshardExecutor(plan, rank, tensors, bucket_bytes=4096)  # small buckets: many rounds
        stats = [ex.refit(v) for v in (1, 2)]  # plan and buffers reused
        out[case] = dict(engine={n: t.cpu() for n, t in engine.items()}, stats=stats, rounds=ex.rounds)
    return out


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(4))])
def test_reshard_refit_exact(backend):
    results = run_on_ranks(_body, 4, args=(backend,), backend=backend, timeout=240)
    ref = results[0]["reference"]
    cfg = tiny_llama.transformer_config(SPEC, tp=2)
    for case in CASES:
        src, dst = _layouts(cfg, case)
        from megatron_ext.weight_export.reshard_plan import build_reshard_plan
        plan = build_reshard_plan(src, dst)
        for r in dst.ranks:
            res = results[r][case]
            assert res["rounds"] > 1 or case.endswith("colocated")
            for n, lt in dst.tensors[r].items():
                want = torch.cat([ref[s.name][tuple(slice(a, b) for a, b in s.box.ranges)] for s in lt.segments])
                torch.testing.assert_close(res["engine"][n], want, rtol=0, atol=0, msg=f"{case} rank {r} {n}")
            held = dst.bytes_held(r)
            s1, s2 = res["stats"]
            # a receiver gets exactly the bytes it keeps (plus bucket alignment), the same at every refit
            assert s1.received_bytes + s1.local_bytes >= held
            assert 0 <= s1.received_bytes - plan.received_bytes().get(r, 0) <= 16 * s1.rounds * len(src.ranks)
            assert (s2.received_bytes, s2.local_bytes) == (s1.received_bytes, s1.local_bytes)
        if case.endswith("colocated"):
            assert all(results[r][case]["stats"][0].received_bytes == 0 for r in dst.ranks)  # all local copies
