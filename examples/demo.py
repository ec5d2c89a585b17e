"""megatron_ext demo: train a tiny megatron-core GPT with TP x DP ranks.

    make demo                       # 4 CPU ranks (gloo): TP=2 x DP=2
    .venv/bin/python examples/demo.py --world-size 2 --tp 2 --steps 20

Ranks are launched on this machine: gloo on CPU, NCCL when there is one GPU per
rank. Each phase prints its per-step losses; the summary puts the phases side
by side:

- uniform: the baseline job, TP x DP on all GPUs;
- ntp: a GPU of replica 0 "fails" (``--failed-slots``), the job relaunches on
  the surviving GPUs only (packed layout) and replica 0 trains at reduced TP
  with ``NonuniformTPDistributedDataParallel``, the satellite of a healthy
  partner replica (no optimizer state of its own); same global batch, same
  curve; each rank's role and bytes at the end;
- weight export: a Llama-shaped model trains on the same ranks, then its
  weights stream to a Hugging Face LlamaForCausalLM in another process
  (``megatron_ext.weight_export``); prints refit time, bytes, GB/s and the
  verifier's KL between the two models;
- symmetric memory: plain Megatron DDP vs ``SymmMemDistributedDataParallel``
  on 2 ranks, same losses; on CPU the staging falls back to plain buffers with
  one warning (``examples/demo_fsdp_symm.py``);
- reshard refit: Megatron TP2 trainer ranks send two engine replicas (TP1)
  only their own shards, the second replica served by the first (fan-out),
  each passing a KL gate (``examples/demo_weight_export_reshard.py``, 4 ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from demo_nonuniform_tp import ntp_config_kwargs, run_ntp_phase
from demo_fsdp_symm import run_symm_demo
from demo_weight_export import run_weight_export_demo
from demo_weight_export_reshard import run_reshard_demo
from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    world_size: int = 4
    tp: int = 2
    steps: int = 20
    global_batch: int = 8
    lr: float = 3e-3
    backend: str = "gloo"


def _train_rank(cfg: DemoConfig, spec: tiny_gpt.TinyGPTSpec, phase: str):
    """One rank of a training job: Megatron DDP + Megatron optimizer."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    device = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" else "cpu"
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tconf = tiny_gpt.transformer_config(spec, tp=cfg.tp)
    model = DistributedDataParallel(
        config=tconf,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        module=tiny_gpt.build_model(spec, tconf, device=device),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=0.01, clip_grad=1.0), [model]
    )
    per_rank = cfg.global_batch // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    rows = []
    for step in range(cfg.steps):
        start = time.perf_counter()
        tokens, labels = tiny_gpt.global_batch(spec, step, cfg.global_batch)
        loss = tiny_gpt.train_step(model, opt, tokens[mine].to(device), labels[mine].to(device))
        mean = loss.clone()
        dist.all_reduce(mean, group=ps.get_data_parallel_group())
        rows.append((step, (mean / dp).item(), time.perf_counter() - start))
        if dist.get_rank() == 0:
            print(f"[{phase}] step {step + 1:3d}/{cfg.steps}  loss {rows[-1][1]:.4f}", flush=True)
    return rows


def print_table(phases: dict[str, list[tuple[int, float, float]]]) -> None:
    names = list(phases)
    header = (
        "step | "
        + " | ".join(f"{n + ' loss':>16}" for n in names)
        + " | "
        + " | ".join(f"{n + ' s/step':>16}" for n in names)
    )
    print(header)
    print("-" * len(header))
    steps = len(next(iter(phases.values())))
    for i in range(steps):
        losses = " | ".join(f"{phases[n][i][1]:16.4f}" for n in names)
        times = " | ".join(f"{phases[n][i][2]:16.3f}" for n in names)
        print(f"{i + 1:4d} | {losses} | {times}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=DemoConfig.world_size)
    parser.add_argument("--tp", type=int, default=DemoConfig.tp)
    parser.add_argument("--steps", type=int, default=DemoConfig.steps)
    parser.add_argument("--global-batch", type=int, default=DemoConfig.global_batch)
    parser.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="auto: NCCL when there is one GPU per rank, else gloo on CPU",
    )
    parser.add_argument(
        "--failed-slots",
        default="0:1",
        help='GPUs that fail for the NTP phase, "REPLICA:SLOT[,SLOT];..." ("" skips the phase)',
    )
    parser.add_argument("--no-export", action="store_true", help="skip the weight-export phase")
    parser.add_argument("--no-symm", action="store_true", help="skip the symmetric-memory phase (2 ranks)")
    parser.add_argument("--no-reshard", action="store_true", help="skip the reshard-refit phase (4 ranks)")
    args = parser.parse_args(argv)

    if args.world_size % args.tp:
        parser.error(f"--world-size {args.world_size} is not a multiple of --tp {args.tp}")
    dp = args.world_size // args.tp
    if args.global_batch % dp:
        parser.error(f"--global-batch {args.global_batch} is not a multiple of DP={dp}")
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.device_count() >= args.world_size else "gloo"
    cfg = DemoConfig(
        world_size=args.world_size, tp=args.tp, steps=args.steps, global_batch=args.global_batch, backend=backend
    )
    spec = tiny_gpt.TinyGPTSpec()
    if args.failed_slots:
        try:  # before any phase runs: a bad --failed-slots would fail only in the NTP phase's ranks
            ntp_config_kwargs(cfg.tp, cfg.world_size, args.failed_slots, spec)
        except ValueError as exc:
            parser.error(f"--failed-slots {args.failed_slots!r}: {exc}")

    print(
        f"megatron_ext demo: tiny GPT ({spec.num_layers} layers, hidden {spec.hidden_size}), "
        f"{cfg.world_size} ranks = TP {cfg.tp} x DP {dp}, backend {backend}, {cfg.steps} steps",
        flush=True,
    )
    phases = {}
    start = time.perf_counter()
    phases["uniform"] = run_on_ranks(
        _train_rank, cfg.world_size, args=(cfg, spec, "uniform"), backend=backend, timeout=600
    )[0]
    print(f"[uniform] done in {time.perf_counter() - start:.1f}s\n", flush=True)
    if args.failed_slots:
        start = time.perf_counter()
        phases["ntp"] = run_ntp_phase(
            tp_base=cfg.tp,
            world_size=cfg.world_size,
            failed_slots=args.failed_slots,
            steps=cfg.steps,
            global_batch=cfg.global_batch,
            lr=cfg.lr,
            backend=backend,
            spec=spec,
        )
        print(f"[ntp] done in {time.perf_counter() - start:.1f}s\n", flush=True)

    export = None
    if not args.no_export:
        export = run_weight_export_demo(
            world_size=cfg.world_size, tp=cfg.tp, steps=10, global_batch=cfg.global_batch, backend=backend
        )
        print()
    symm = None
    if not args.no_symm:
        start = time.perf_counter()
        symm = run_symm_demo(world_size=2, steps=5, backend="nccl" if torch.cuda.device_count() >= 2 else "gloo")
        print(f"[symm] done in {time.perf_counter() - start:.1f}s\n", flush=True)
    reshard = None
    if not args.no_reshard:
        start = time.perf_counter()
        reshard = run_reshard_demo(versions=2, backend=None if backend == "nccl" else "gloo")
        print(f"[reshard] done in {time.perf_counter() - start:.1f}s\n", flush=True)

    print_table(phases)
    ok = True
    first, last = phases["uniform"][0][1], phases["uniform"][-1][1]
    ok &= last < first
    print(f"\nloss {first:.4f} -> {last:.4f} ({'decreased' if last < first else 'DID NOT DECREASE'})")
    if "ntp" in phases:
        worst = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(phases["ntp"], phases["uniform"]))
        ok &= worst < 1e-4
        print(f"NTP (failed {args.failed_slots}) vs uniform loss: max relative difference {worst:.2e}")
    if export is not None:
        ok &= export["kl"] < 1e-3
        print(
            f"weight export: refit {export['refit_s'] * 1e3:.1f} ms, {export['bytes'] / 1e6:.2f} MB, "
            f"{export['gbps']:.2f} GB/s ({export['transport']}), verifier KL {export['kl']:.2e}"
        )
    if symm is not None:
        worst = max(abs(a - b) / abs(a) for a, b in zip(symm["plain DDP"], symm["symm-mem DDP"]))
        ok &= worst < 1e-3
        print(
            f"symmetric memory: {symm['symmetric_buckets']} bucket(s) staged symmetric; vs plain DDP loss: max "
            f"relative difference {worst:.2e}"
        )
    if reshard is not None:
        kls = [row["kl"] for res in reshard[2:] for row in res["rows"]]
        ok &= max(kls) < 1e-3
        print(
            f"reshard refit: {len(kls)} gated engine refits (2 replicas x 2 versions, fan-out), "
            f"max KL {max(kls):.2e}, received {sum(r['received'] for res in reshard for r in res['rows']) / 1e6:.2f}"
            " MB in all"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
