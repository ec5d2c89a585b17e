"""Nonuniform TP benchmark: gradient-sync time of an NTP job against plain
Megatron DDP on the same ranks, and a degraded replica's step time against a
healthy one's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ntp.py                 # CPU/gloo, 4 ranks
    python benchmarks/ntp.py --tp-base 2 --replicas 2 --backend nccl     # 4 GPUs
    python benchmarks/ntp.py --tp-base 4 --replicas 2 --spares 1 --backend nccl   # 8 GPUs

Both jobs use the same processes (``world = replicas * tp_base``): the uniform
job runs TP=tp_base x DP=replicas with Megatron's DDP; the NTP job runs in
``simulate`` launch mode, where ``--spares`` slots of replica 0 leave and that
replica continues at TP=tp_base-spares. Per rank, medians over the timed steps
of: ``zero_grad_buffer`` (where healthy NTP ranks unfold the updated
parameters), forward+backward, grad sync (``finish_grad_sync()`` with overlap off: the
fold all-to-all plus the DP collective on healthy ranks, and the wait for the
slowest replica), and the whole step (after a barrier); the table shows the
slowest rank of each group; "sync vs uniform" compares unfold + grad sync.

A second table gives the memory each rank holds for the model, counted exactly
from the tensors (``ddp_memory_report``: works on CPU too): parameters (the
ones forward runs), their gradients (``main_grad`` buffers), NTP's training
shadow (healthy core ranks: the ``tp_reduced`` shadow parameters and their grad
buffer; spares hold none), and the optimizer (fp32 main-param copies and
Adam's state), for uniform ranks, NTP healthy core ranks, healthy spare ranks
and degraded ranks (the largest rank of each group), and on GPUs the peak
``torch.cuda.max_memory_allocated`` of the run (activations and workspaces
included). Prints both tables and writes JSON (``memory``: per group; ``per_rank``:
every rank's timings and memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.testing import tiny_gpt  # noqa: E402
from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402


def _sync(backend):
    if backend == "nccl":
        torch.cuda.synchronize()


def _bench_rank(ntp_kwargs, tp, spec, steps, warmup, global_batch, backend):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.nonuniform_tp import NonuniformTPDistributedDataParallel, ddp_memory_report
    from megatron_ext.testing.ntp_job import init_job

    job = init_job(ntp_kwargs, tp)
    if job is None:
        return None
    ntp_cfg, replica, replicas, degraded = job.ntp_config, job.replica, job.replicas, job.degraded
    tp_size = ps.get_tensor_model_parallel_world_size()
    cfg = tiny_gpt.transformer_config(spec, tp=tp_size)
    dev = tiny_gpt.rank_device()
    model = tiny_gpt.build_model(spec, cfg, device=dev)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    if ntp_cfg is None:
        ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=model)
    else:
        ddp = NonuniformTPDistributedDataParallel(cfg, ddp_config, model, ntp_config=ntp_cfg)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [ddp])
    n_local = global_batch // replicas
    unfold_s, compute_s, sync_s, step_s = [], [], [], []
    for step in range(warmup + steps):
        tokens, labels = tiny_gpt.global_batch(spec, step=step, num_samples=global_batch)
        mine = slice(replica * n_local, (replica + 1) * n_local)
        dist.barrier()
        _sync(backend)
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()  # healthy NTP ranks unfold the updated shadow here
        opt.zero_grad()
        _sync(backend)
        ta = time.perf_counter()
        loss = tiny_gpt.forward_loss(ddp, tokens[mine].to(dev), labels[mine].to(dev))
        loss.backward()
        _sync(backend)
        t1 = time.perf_counter()
        ddp.finish_grad_sync()
        _sync(backend)
        t2 = time.perf_counter()
        opt.step()
        _sync(backend)
        t3 = time.perf_counter()
        if step >= warmup:
            unfold_s.append(ta - t0)
            compute_s.append(t1 - ta)
            sync_s.append(t2 - t1)
            step_s.append(t3 - t0)
    memory = ddp_memory_report(ddp, opt)  # after the steps: Adam's state exists
    return dict(
        replica=replica,
        tp_size=tp_size,
        degraded=degraded,
        role=memory.role,
        unfold_s=statistics.median(unfold_s),
        compute_s=statistics.median(compute_s),
        sync_s=statistics.median(sync_s),
        step_s=statistics.median(step_s),
        memory=memory.as_dict(),
        peak_cuda_bytes=torch.cuda.max_memory_allocated() if backend == "nccl" else None,
    )


MEMORY_GROUPS = (
    ("uniform DDP, all ranks", "uniform", "uniform"),
    ("NTP healthy core", "ntp", "healthy core"),
    ("NTP healthy spare", "ntp", "healthy spare"),
    ("NTP degraded replica", "ntp", "degraded"),
)
MEMORY_FIELDS = ("params", "grads", "shadow", "optimizer", "total")


def memory_table(uniform, ntp_out) -> dict:
    """Print the per-rank memory table; return ``{group: the group's largest rank}`` (bytes)."""
    runs = dict(uniform=uniform, ntp=ntp_out)
    groups = {}
    for name, run, role in MEMORY_GROUPS:
        rows = [r for r in runs[run] if r["role"] == role]
        if rows:
            top = max(rows, key=lambda r: r["memory"]["total"])
            peaks = [r["peak_cuda_bytes"] for r in rows if r["peak_cuda_bytes"] is not None]
            groups[name] = dict(top["memory"], ranks=len(rows), peak_cuda_bytes=max(peaks) if peaks else None)
    base = groups["uniform DDP, all ranks"]["total"]
    mib = 2.0**20
    print(
        f"\nmemory per rank (MiB, exact tensor bytes; the largest rank of each group)\n"
        f"{'ranks':24} | {'n':>2} | {'params':>8} | {'grads':>8} | {'shadow':>8} | {'optimizer':>9} | "
        f"{'total':>8} | {'vs uniform':>10} | {'peak CUDA':>9}"
    )
    print("-" * 112)
    for name, g in groups.items():
        peak = "-" if g["peak_cuda_bytes"] is None else f"{g['peak_cuda_bytes'] / mib:9.2f}"
        print(
            f"{name:24} | {g['ranks']:2d} | "
            + " | ".join(f"{g[k] / mib:{9 if k == 'optimizer' else 8}.2f}" for k in MEMORY_FIELDS)
            + f" | {g['total'] / base:9.2f}x | {peak:>9}"
        )
    print(
        "shadow: the tp_reduced training shadow's parameters and grad buffer (healthy core ranks; spares hold "
        "none); optimizer: fp32 main params + Adam state over the shadow on healthy core ranks (spares: none)."
    )
    return groups


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp-base", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--out", default="benchmarks/results/ntp.json")
    args = parser.parse_args(argv)
    world = args.replicas * args.tp_base
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    spec = tiny_gpt.TinyGPTSpec(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        vocab_size=args.vocab,
        seq_length=args.seq,
    )
    failed = {0: tuple(range(args.tp_base - args.spares, args.tp_base))}
    ntp = dict(tp_base=args.tp_base, tp_spares=args.spares, non_active_ranks_per_dp=failed, launch_mode="simulate")
    common = (spec, args.steps, args.warmup, args.global_batch, backend)
    print(
        f"NTP benchmark: {world} ranks ({backend}), tp_base={args.tp_base}, replicas={args.replicas}, "
        f"replica 0 loses slots {failed[0]}; hidden {args.hidden}, {args.layers} layers",
        flush=True,
    )
    t = time.perf_counter()
    uniform = run_on_ranks(_bench_rank, world, args=(None, args.tp_base) + common, backend=backend, timeout=900)
    print(f"[uniform] done in {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    ntp_out = [
        o
        for o in run_on_ranks(_bench_rank, world, args=(ntp, args.tp_base) + common, backend=backend, timeout=900)
        if o
    ]
    print(f"[ntp] done in {time.perf_counter() - t:.1f}s\n", flush=True)

    def agg(rows, key):
        return max(r[key] for r in rows) if rows else float("nan")

    u = {k: agg(uniform, k) for k in ("unfold_s", "compute_s", "sync_s", "step_s")}
    healthy = [r for r in ntp_out if not r["degraded"]]
    degraded = [r for r in ntp_out if r["degraded"]]
    h = {k: agg(healthy, k) for k in u}
    d = {k: agg(degraded, k) for k in u}
    print(
        f"{'job':24} | {'zero+unfold ms':>14} | {'fwd+bwd ms':>10} | {'grad sync ms':>12} | "
        f"{'sync vs uniform':>15} | {'step ms':>8} | {'vs uniform':>10}"
    )
    print("-" * 115)
    for name, row in (("uniform DDP, all ranks", u), ("NTP healthy replicas", h), ("NTP degraded replica", d)):
        ntp_sync = row["unfold_s"] + row["sync_s"]
        print(
            f"{name:24} | {row['unfold_s'] * 1e3:14.2f} | {row['compute_s'] * 1e3:10.1f} | "
            f"{row['sync_s'] * 1e3:12.2f} | {ntp_sync / (u['unfold_s'] + u['sync_s']):14.2f}x | "
            f"{row['step_s'] * 1e3:8.1f} | {row['step_s'] / u['step_s']:9.2f}x"
        )
    ratio = d["compute_s"] / h["compute_s"]
    print(
        f"\ndegraded / healthy fwd+bwd time: {ratio:.2f}x (ideal: tp_base/tp_reduced = "
        f"{args.tp_base / (args.tp_base - args.spares):.2f}x). The DP collective waits for the "
        "slowest replica: grad sync includes that wait."
    )
    memory = memory_table(uniform, ntp_out)
    result = dict(
        world=world,
        backend=backend,
        tp_base=args.tp_base,
        spares=args.spares,
        replicas=args.replicas,
        hidden=args.hidden,
        layers=args.layers,
        steps=args.steps,
        device=torch.cuda.get_device_name() if backend == "nccl" else "cpu",
        uniform=u,
        ntp_healthy=h,
        ntp_degraded=d,
        degraded_over_healthy_compute=ratio,
        memory=memory,
        per_rank=dict(uniform=uniform, ntp=ntp_out),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
