"""Demo of NCCL symmetric-memory staging (``megatron_ext.fsdp_symm``).

    .venv/bin/python examples/demo_fsdp_symm.py [--world-size 2] [--steps 5]

Shows the size-aware policy for a range of bucket sizes, then trains a tiny
megatron-core GPT with plain Megatron DDP and with
``SymmMemDistributedDataParallel`` side by side. On CPU (gloo) the capability
probe falls back to plain buffers with one warning and the losses are equal; on
one GPU per rank (NCCL >= 2.27) the small buckets run NCCL's ``ncclSymk`` kernels.
``examples/demo.py`` calls :func:`run_symm_demo` as one of its phases.
"""

from __future__ import annotations

import argparse

import torch

from megatron_ext.fsdp_symm import SymmMemConfig, decide, format_report
from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks

MIB = 1 << 20


def _train_rank(variant: str, steps: int, config: SymmMemConfig):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.fsdp_symm import SymmMemDistributedDataParallel

    spec = tiny_gpt.TinyGPTSpec()
    ps.initialize_model_parallel()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    dev = tiny_gpt.rank_device()
    tconf = tiny_gpt.transformer_config(spec)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=8192)
    module = tiny_gpt.build_model(spec, tconf, device=dev)
    if variant == "plain DDP":
        ddp = DistributedDataParallel(config=tconf, ddp_config=ddp_config, module=module)
    else:
        ddp = SymmMemDistributedDataParallel(config=tconf, ddp_config=ddp_config, module=module, symm_mem_config=config)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3), [ddp])
    losses = []
    for step in range(steps):
        tokens, labels = tiny_gpt.global_batch(spec, step, 4 * dp)
        mine = slice(4 * dp_rank, 4 * dp_rank + 4)
        loss = tiny_gpt.train_step(ddp, opt, tokens[mine].to(dev), labels[mine].to(dev))
        mean = loss.clone()
        dist.all_reduce(mean)
        losses.append((mean / dp).item())
    symmetric = sum(d.symmetric for _, d in getattr(ddp, "symm_mem_decisions", []))
    return losses, symmetric


def run_symm_demo(
    world_size: int = 2, steps: int = 5, backend: str | None = None, config: SymmMemConfig | None = None
) -> dict:
    """Print the policy for sample sizes and a plain-vs-staged DDP loss table.

    Returns ``{"plain DDP": losses, "symm-mem DDP": losses, "symmetric_buckets": n}``.
    """
    config = config or SymmMemConfig()
    rows = [
        (f"sample {n / MIB:g} MiB", decide(c, n, config))
        for c in ("all_gather", "reduce_scatter", "all_reduce")
        for n in (MIB // 4, 8 * MIB, 128 * MIB)
    ]
    print("policy (" + config.mode + "):\n" + format_report(rows))
    out = {}
    for variant in ("plain DDP", "symm-mem DDP"):
        res = run_on_ranks(_train_rank, world_size, args=(variant, steps, config), backend=backend, timeout=300)
        out[variant], out["symmetric_buckets"] = res[0]
    print(f"{'step':>4} | {'plain DDP':>12} | {'symm-mem DDP':>12}")
    for i, (a, b) in enumerate(zip(out["plain DDP"], out["symm-mem DDP"])):
        print(f"{i + 1:>4} | {a:>12.5f} | {b:>12.5f}")
    print(f"buckets on symmetric memory: {out['symmetric_buckets']}")
    return out


def main():
    from megatron_ext.fsdp_symm import add_fsdp_symm_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    add_fsdp_symm_args(parser)
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.device_count() >= args.world_size else "gloo"
    run_symm_demo(args.world_size, args.steps, backend, SymmMemConfig.from_args(args))


if __name__ == "__main__":
    main()
