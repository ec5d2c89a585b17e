"""Weight export demo: train a Llama-shaped Megatron GPT, then stream its weights
to a Hugging Face model in another process and check it.

``examples/demo.py`` calls :func:`run_weight_export_demo` after its training
phases. The receiver is a ``transformers`` LlamaForCausalLM served by
``megatron_ext.weight_export.serve`` in its own process; the trainer's export
rank streams buckets to it over the broadcast transport (gloo on CPU, NCCL on
GPUs), and the verifier compares the two models' logits on the same tokens.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.testing import tiny_gpt, tiny_llama  # noqa: E402
from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402
from megatron_ext.testing.receiver_proc import start_hf_receiver  # noqa: E402

SPEC = tiny_llama.TinyLlamaSpec(arch="llama", hf_vocab_size=128)


def _train_and_export(target: str, transport: str, tp: int, steps: int, global_batch: int, lr: float):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext import weight_export as wx

    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    config = tiny_llama.transformer_config(SPEC, tp=tp)
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=tiny_llama.build_model(SPEC, config, device=device),
    )
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=1.0), [model])
    exporter = wx.WeightExporter(
        model,
        wx.RefitConfig(target=target, transport=transport, bucket_size_mb=0.25, vocab_size=SPEC.hf_vocab_size),
    )
    per_rank = global_batch // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    losses = []
    for step in range(steps):
        tokens, labels = tiny_gpt.global_batch(SPEC, step, global_batch)
        loss = tiny_gpt.train_step(model, opt, tokens[mine].to(device), labels[mine].to(device))
        mean = loss.clone()
        dist.all_reduce(mean, group=ps.get_data_parallel_group())
        losses.append((mean / dp).item())
    result = exporter.export(version=steps)  # cold: plan sent, buffers allocated
    warm = exporter.export(version=steps)  # warm: only bytes
    tokens, _ = tiny_gpt.global_batch(SPEC, 10_000, 4)
    verify = exporter.verify(tokens.to(device))
    exporter.close()
    return dict(losses=losses, cold=result, warm=warm, verify=verify, buckets=len(exporter.plan.buckets))


def run_weight_export_demo(
    world_size: int = 4,
    tp: int = 2,
    steps: int = 10,
    global_batch: int = 8,
    lr: float = 3e-3,
    backend: str = "gloo",
    timeout: float = 600,
) -> dict:
    """Train for ``steps`` on ``world_size`` ranks (TP ``tp``), stream the weights
    to a HF LlamaForCausalLM in another process, print and return the refit time,
    bytes, GB/s and the verifier's KL."""
    # NCCL needs the receiver on a GPU of its own; without a spare GPU it shares
    # the export rank's GPU 0 through CUDA IPC instead.
    transport, receiver_device = "broadcast", "cpu"
    if backend == "nccl":
        spare = torch.cuda.device_count() > world_size
        transport, receiver_device = ("broadcast", f"cuda:{world_size}") if spare else ("ipc", "cuda:0")
    start = time.perf_counter()
    with start_hf_receiver(tiny_llama.build_hf, (SPEC,), device=receiver_device, keep_state=False) as receiver:
        out = run_on_ranks(
            _train_and_export,
            world_size,
            args=(receiver.address, transport, tp, steps, global_batch, lr),
            backend=backend,
            timeout=timeout,
            watch=receiver.failure,
        )[0]
        got = receiver.result()
    if not got["ok"]:
        raise RuntimeError(f"the HF receiver failed:\n{got['error']}")
    cold, warm, verify = out["cold"], out["warm"], out["verify"]
    summary = dict(
        loss_first=out["losses"][0],
        loss_last=out["losses"][-1],
        bytes=warm.nbytes,
        buckets=out["buckets"],
        refit_s=warm.seconds,
        gbps=warm.gbps,
        cold_refit_s=cold.seconds,
        kl=verify.kl,
        max_abs_logit_diff=verify.max_abs_diff,
        applied_versions=got["applied"],
        transport=transport,
        wall_s=time.perf_counter() - start,
    )
    print(
        f"[weight export] trained {steps} steps (loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}), "
        f"streamed to a HF LlamaForCausalLM in another process ({transport}, {backend}):"
    )
    print(
        f"[weight export] refit {summary['refit_s'] * 1e3:.1f} ms (first, with plan: "
        f"{summary['cold_refit_s'] * 1e3:.1f} ms), {summary['bytes'] / 1e6:.2f} MB in {summary['buckets']} buckets, "
        f"{summary['gbps']:.2f} GB/s; receiver applied versions {summary['applied_versions']}"
    )
    print(
        f"[weight export] verifier: KL {summary['kl']:.2e} (per-token mean), max |logit diff| "
        f"{summary['max_abs_logit_diff']:.2e}"
    )
    return summary
