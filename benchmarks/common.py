"""What the refit benchmarks share: model presets, the trainer's Megatron config, timing across ranks,
and the record of where and how a result was measured."""

from __future__ import annotations

import statistics

import torch

from megatron_ext.testing import tiny_llama

PRESETS = {
    # Llama-3.2-1B / 3B and Llama-3-8B shapes, untied embeddings, GQA.
    "1b": dict(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=128256,
        hf_vocab_size=128256,
    ),
    "3b": dict(
        num_layers=28,
        hidden_size=3072,
        num_attention_heads=24,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=128256,
        hf_vocab_size=128256,
    ),
    "8b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        hf_vocab_size=128256,
    ),
    "tiny": dict(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=512,
        vocab_size=4096,
        hf_vocab_size=4096,
    ),
}
# Qwen3-MoE-shaped (SequentialMLP experts, top-2 softmax router, qk-layernorm), every layer MoE; only
# benchmarks that place experts (refit_vs_swap.py) offer them.
MOE_PRESETS = {
    # 16 layers, 8 experts of 3072 per layer, Qwen3's vocabulary: 3.21B parameters, 6.41 GB bf16
    # (experts 2.42B): large enough that a refit is bound by the links, small enough for both models on a GPU.
    "moe-3b": dict(
        arch="qwen3_moe",
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=3072,
        vocab_size=151936,
        hf_vocab_size=151936,
        num_moe_experts=8,
        moe_ffn_hidden_size=3072,
        moe_router_topk=2,
    ),
    "moe-tiny": dict(
        arch="qwen3_moe",
        num_layers=2,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=512,
        vocab_size=4096,
        hf_vocab_size=4096,
        num_moe_experts=8,
        moe_ffn_hidden_size=128,
        moe_router_topk=2,
    ),
}
GiB = 1 << 30


def spec_for(preset: str) -> tiny_llama.TinyLlamaSpec:
    """The model of a :data:`PRESETS` or :data:`MOE_PRESETS` entry."""
    fields = PRESETS[preset] if preset in PRESETS else MOE_PRESETS[preset]
    return tiny_llama.TinyLlamaSpec(**{"arch": "llama", "seq_length": 32, **fields})


def megatron_config(spec, gpu: bool):
    """The trainer's bf16 Megatron config (CPU initialisation only without a GPU)."""
    return tiny_llama.transformer_config(
        spec, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=not gpu
    )


def sync(device) -> None:
    """Wait for ``device``'s work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, device) -> float:
    """The largest of every rank's ``seconds`` (collective over the default group)."""
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def provenance(script: str, argv=None) -> dict:
    """``date`` (UTC), ``command`` (``argv``: the arguments a caller passed to ``main``; default
    ``sys.argv``), ``machine`` (host, platform, CPUs, the visible GPUs) and ``versions`` (Python, torch,
    CUDA and NCCL when a GPU is visible, megatron-core, megatron_ext) of one benchmark run."""
    import datetime
    import importlib.metadata
    import os
    import platform
    import shlex
    import sys

    import megatron_ext

    args = sys.argv[1:] if argv is None else list(argv)
    gpu = torch.cuda.is_available()
    versions = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        megatron_core=importlib.metadata.version("megatron-core"),  # the installed wheel's, not a source tree's
        megatron_ext=getattr(megatron_ext, "__version__", None),
    )
    if gpu:
        versions.update(cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=shlex.join(["python", script, *args]),
        machine=dict(
            host=platform.node(),
            platform=platform.platform(),
            cpus=os.cpu_count(),
            gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if gpu else [],
        ),
        versions=versions,
    )


def int_at_least(minimum: int):
    """An ``argparse`` type: an int >= ``minimum`` (the error names the bound and the value given)."""

    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
        return value

    return parse


def event_ms(fn, iters: int) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` after a warm-up, each timed by CUDA events."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
