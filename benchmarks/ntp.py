"""Nonuniform TP benchmark: the whole job's throughput when GPUs fail, for uniform TP, NTP with equal
and with balanced batch shares, and dropping the degraded replica, on the same GPUs; each rank's model
memory; and the cost model (:mod:`megatron_ext.nonuniform_tp.cost_model`) checked against this run and
carried to large jobs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ntp.py                 # CPU/gloo, 4 ranks, tiny model
    python benchmarks/ntp.py --preset 2b --backend nccl                  # 4 GPUs: 2.0B model, TP=2 x DP=2
    python benchmarks/ntp.py --preset 2b --tp-base 4 --spares 2 --backend nccl     # 8 GPUs: TP=4, one replica at TP=2

Jobs (``world = replicas * tp_base`` processes; every step is one global batch of ``--global-batch``
samples in micro-batches of ``--micro-batch``, through Megatron's ``get_forward_backward_func`` with
each replica's own ``num_microbatches``, then the gradient sync and the optimizer step; Adam, plain
optimizer, gradients reduced in fp32, overlap off):

- ``uniform``: TP=tp_base x DP=replicas, Megatron's DDP, equal shares.
- ``ntp unbalanced``: simulate launch mode, replica 0 loses its last ``--spares`` TP slots and runs at
  TP=tp_base-spares as the satellite of replica 1 (its partner); the other healthy replicas are
  bystanders (none with the default 2 replicas); equal shares.
- ``ntp balanced``: the same job (same processes and model, after the unbalanced steps) with the
  shares of ``--ntp-balance tp`` (``NonuniformTPConfig.batch_shares``: micro-batches in proportion to
  the TP degree) set through ``ddp.set_batch_shares``.
- ``drop``: the degraded replica's ranks are gone: ``world - tp_base`` processes run uniform TP=tp_base
  over the other replicas with the same global batch.

Per rank and step (each step starts after a barrier; every phase is timed after CUDA synchronises):
``param_transfer`` (``ddp.refresh_compute_params()``: the partner's updated parameters to its satellite,
resharded to the reduced degree; partner and degraded ranks, nothing elsewhere), ``zero``
(``zero_grad_buffer`` and the optimizer's ``zero_grad``), ``compute`` (the forward-backward function),
``wait`` (a barrier over the job: the wait for the slowest replica), ``grad_transfer`` (the degraded
replica's gradients into its partner's buckets, both sides starting together: ``ddp.transfer_gradients()``
on the pair's ranks, which ``finish_grad_sync`` then finds done),
``collective`` (``finalize_model_grads``: the DP collective over the healthy replicas), ``optimizer``
and ``step``. Per job: the step of the slowest rank (median over steps of the per-step maximum), tokens/s
of the whole job (``global_batch * seq / step``), the fraction of uniform tokens/s and of the ideal
(surviving GPUs / all GPUs x uniform). Per job and replica kind (``all`` in uniform jobs; ``bystander``,
``partner``, ``degraded`` under NTP): every phase, and the partner's extra time (its transfers, without
waiting) as % of the job's step; the bystanders' overhead is their time outside compute and waiting
minus a uniform rank's, as % of the uniform step.

Memory table: each rank's bytes for the model, exact from the tensors (``ddp.memory_report(optimizer)``,
also on CPU): parameters, gradients, transfer staging, the optimizer (main params and Adam's state),
total and the ratio to a uniform rank, for uniform, bystander, partner and degraded ranks (the largest
rank of each kind), and on GPUs the run's peak ``torch.cuda.max_memory_allocated`` (activations
included).

Cost model (``costs_from_run``): per-micro-batch compute, the DP collective, the optimizer and the rest
of the step from the uniform job; the partner's parameter and gradient transfers and the degraded
replica's per-GPU efficiency from the unbalanced NTP phase. The model first predicts this run (the
balanced phase with its own shares, the unbalanced one, drop) and prints it against the measured
fractions. Then, for every ``--model-jobs`` entry (default DP=64 x TP=8 and the scale-up domains
16 x 32 and 8 x 64, GB200 NVL72-class), k = 1..``--model-failed`` failed GPUs spread one per replica
or packed into as few replicas as possible: retained throughput vs uniform of the policy (the best of
dropping, keeping satellites, every replica at TP r), balanced and unbalanced NTP, drop, every replica
at TP r (r = TP minus the GPUs lost, lowered until it divides every ``--model-divides`` size), with
integer shares (``--model-microbatches`` per replica of ``--model-micro-batch`` samples; default this
run's samples per replica, one per micro-batch) and fluid ones, the granularity term
(fluid minus integer) of the policy and of drop, and the shrinking-batch option (every replica keeps
its per-step work, the global batch shrinks by the satellites' shortfall, at most
``--model-max-shrink``). ``--pp P`` gives every large job's replica P pipeline stages of TP GPUs
(``DP x P x TP`` GPUs; the failures placed over all of them, a replica's degree set by its worst
stage; the measured costs are the whole model's, carried to a 1F1B pipeline per replica: the
module docstring of the cost model gives the formula). Last, this run's values and the model's
against the issue's targets.

JSON (``--out``): every table, the costs the model used, ``provenance`` (date, command, machine,
versions) and ``per_rank``: every rank's per-step timings of every phase and its memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import int_at_least, provenance, sync  # noqa: E402
from megatron_ext.nonuniform_tp import cost_model  # noqa: E402
from megatron_ext.testing import tiny_gpt  # noqa: E402
from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402

# Model shapes. ``2b``: GPT (learned positions, GeLU MLP, untied embeddings) with 2.03e9 parameters.
# Bytes per rank at TP=2 x DP=2 with one spare (bf16 params, fp32 grads, fp32 main params + Adam,
# plain optimizer): a uniform rank and the partner 18 B/param / 2 = 18 GB (the partner adds its
# transfer staging, about --ntp-transfer-chunk-mb); the degraded rank (TP=1) 2 + 4 B/param = 12 GB and
# no optimizer state; plus activations (micro-batch 2 x 2048 tokens, unfused attention: about 20 GB at
# TP=1): within an H200's 141 GB (and an 80 GB H100's).
PRESETS = {
    # tiny: the transfer unit is the same fraction of the model as the 64 MiB default is of 2b's (2.1e6 / 2.03e9
    # parameters x 64 MiB = 0.066 MiB), so the staging row reads as it would at scale.
    "tiny": dict(
        hidden=256,
        layers=2,
        heads=8,
        vocab=1024,
        seq=64,
        micro_batch=2,
        global_batch=12,
        steps=10,
        warmup=3,
        transfer_chunk_mb=0.0625,
    ),
    "2b": dict(
        hidden=4096,
        layers=8,
        heads=32,
        vocab=50304,
        seq=2048,
        micro_batch=2,
        global_batch=48,
        steps=10,
        warmup=3,
        transfer_chunk_mb=64.0,
    ),
}
STEP_KEYS = ("param_transfer", "zero", "compute", "wait", "grad_transfer", "collective", "optimizer", "step")
DERIVED_KEYS = ("transfers", "sync", "outside")
JOBS = ("uniform", "ntp unbalanced", "ntp balanced", "drop")
KINDS = ("bystander", "partner", "degraded")
MODEL_JOBS = "64x8,16x32,8x64"
JOB_TIMEOUT_S = 600


# ---------------------------------------------------------------------------------------- one rank
def _clock(device) -> float:
    sync(device)
    return time.perf_counter()


def _barrier(device) -> None:
    """All ranks of the job (the default group: in simulate mode, the active ranks) reach this point."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device=device))
    sync(device)


def _grad_transfer(ddp) -> None:
    """This step's gradient transfer of a degraded replica and its partner, on its own (both sides call
    it at once; the partner's ``start_grad_sync`` then finds it done); nothing elsewhere."""
    fn = getattr(ddp, "transfer_gradients", None)
    if fn is not None:
        fn()


def _bench_rank(job, ntp_kwargs, tp, spec, dtype, phases, steps, warmup):
    """One rank of ``job`` ("uniform", "ntp" or "drop"): ``phases`` is ``[(name, BatchShares)]``, each
    timed over ``warmup + steps`` steps on the same model. Returns this rank's per-step timings per
    phase and its memory, or None on a rank that left (simulate mode)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.nonuniform_tp import NonuniformTPDistributedDataParallel, ddp_memory_report
    from megatron_ext.testing.ntp_job import init_job

    rank_job = init_job(ntp_kwargs, tp)
    if rank_job is None:
        return None
    dev = tiny_gpt.rank_device()
    gpu = dev.type == "cuda"
    bf16 = dtype == "bf16"
    tp_size = ps.get_tensor_model_parallel_world_size()
    overrides = dict(use_cpu_initialization=not gpu)  # GPU initialisation: a 2B model in seconds
    if bf16:
        overrides.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    cfg = tiny_gpt.transformer_config(spec, tp=tp_size, **overrides)
    model = tiny_gpt.build_model(spec, cfg, device=dev)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    if rank_job.ntp_config is None:
        ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=model)
        role = "uniform"
    else:
        ddp = NonuniformTPDistributedDataParallel(
            cfg, ddp_config, model, ntp_config=rank_job.ntp_config, batch_shares=phases[0][1]
        )
        role = ddp.ntp_role
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0, bf16=bf16, params_dtype=cfg.params_dtype), [ddp]
    )
    cfg.no_sync_func = ddp.no_sync
    cfg.grad_scale_func = opt.scale_loss
    cfg.finalize_model_grads_func = None  # run below, after the forward-backward function, to time it apart
    forward_backward = get_forward_backward_func()
    refresh = getattr(ddp, "refresh_compute_params", None)

    seq, mb = spec.seq_length, phases[0][1].micro_batch_size
    position_ids = torch.arange(seq, device=dev).unsqueeze(0).expand(mb, seq)
    attention_mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=dev), diagonal=1)
    num_tokens = torch.tensor(mb * seq, dtype=torch.int, device=dev)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        per_token = model(tokens, position_ids, attention_mask, labels=labels)
        return per_token, lambda output: (output.float().sum(), num_tokens, {})

    if gpu:
        torch.cuda.reset_peak_memory_stats(dev)
    out_phases, step_index = {}, 0
    for name, shares in phases:
        if rank_job.ntp_config is not None:
            ddp.set_batch_shares(shares)
        offsets = shares.micro_batch_offsets(rank_job.replica)
        times = {k: [] for k in STEP_KEYS + DERIVED_KEYS}
        skipped = 0
        for step in range(warmup + steps):
            tokens, labels = tiny_gpt.global_batch(spec, step=step_index, num_samples=shares.global_batch_size)
            step_index += 1
            micro = [(tokens[o : o + mb].to(dev), labels[o : o + mb].to(dev)) for o in offsets]
            _barrier(dev)
            t = [_clock(dev)]
            if refresh is not None:
                refresh()  # the parameter transfer (a no-op on bystanders and before the first step)
            t.append(_clock(dev))
            ddp.zero_grad_buffer()
            opt.zero_grad()
            t.append(_clock(dev))
            forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[ddp],
                num_microbatches=len(micro),
                seq_length=seq,
                micro_batch_size=mb,
            )
            t.append(_clock(dev))
            _barrier(dev)
            t.append(_clock(dev))
            _grad_transfer(ddp)
            t.append(_clock(dev))
            finalize_model_grads([ddp])
            t.append(_clock(dev))
            ok, _, _ = opt.step()
            t.append(_clock(dev))
            skipped += int(not ok)
            if step < warmup:
                continue
            parts = dict(zip(STEP_KEYS[:-1], (b - a for a, b in zip(t, t[1:]))))
            parts["step"] = t[-1] - t[0]
            parts["transfers"] = parts["param_transfer"] + parts["grad_transfer"]
            parts["sync"] = parts["wait"] + parts["grad_transfer"] + parts["collective"]
            # outside compute and waiting: what a rank adds to a step by itself
            parts["outside"] = parts["transfers"] + parts["zero"] + parts["collective"] + parts["optimizer"]
            for k, v in parts.items():
                times[k].append(v)
        out_phases[name] = dict(microbatches=len(offsets), times=times, skipped_steps=skipped)
    memory = ddp_memory_report(ddp, opt)  # after the steps: Adam's state exists
    return dict(
        job=job,
        replica=rank_job.replica,
        tp_size=tp_size,
        degraded=rank_job.degraded,
        role=role,
        phases=out_phases,
        memory=memory.as_dict(),
        peak_cuda_bytes=torch.cuda.max_memory_allocated(dev) if gpu else None,
    )


# ---------------------------------------------------------------------------------------- tables
def _per_step_max(ranks, phase, key) -> list[float]:
    series = [r["phases"][phase]["times"][key] for r in ranks]
    return [max(values) for values in zip(*series)]


def _stat(ranks, phase, key) -> float:
    """Median over the timed steps of the slowest rank's ``key``."""
    return statistics.median(_per_step_max(ranks, phase, key)) if ranks else float("nan")


def summarize(runs: dict, args) -> dict:
    """Per job: the step, tokens/s, fractions, micro-batches per replica and each replica kind's parts."""
    tokens = args.global_batch * args.seq
    world = args.replicas * args.tp_base
    out = {}
    for job in JOBS:
        phase = job
        ranks = runs["ntp" if job.startswith("ntp") else job]
        if job.startswith("ntp"):
            kinds = {kind: [r for r in ranks if r["role"] == kind] for kind in KINDS}
        else:
            kinds = {"all": ranks}
        step = _stat(ranks, phase, "step")
        per_replica = {}
        for r in ranks:
            per_replica[r["replica"]] = r["phases"][phase]["microbatches"]
        gpus = dict(uniform=world, drop=world - args.tp_base).get(job, world - args.spares)
        out[job] = dict(
            gpus=gpus,
            step=step,
            tokens_per_s=tokens / step,
            microbatches=[per_replica[d] for d in sorted(per_replica)],
            kinds={
                name: dict(
                    ranks=len(rows),
                    microbatches=max(r["phases"][phase]["microbatches"] for r in rows),
                    **{k: _stat(rows, phase, k) for k in STEP_KEYS + DERIVED_KEYS},
                )
                for name, rows in kinds.items()
                if rows
            },
            skipped_steps=max(r["phases"][phase]["skipped_steps"] for r in ranks),
        )
    base = out["uniform"]["tokens_per_s"]
    uniform = out["uniform"]["kinds"]["all"]
    ideal = (world - args.spares) / world * base
    for job in JOBS:
        j = out[job]
        j["vs_uniform"] = j["tokens_per_s"] / base
        j["vs_ideal"] = j["tokens_per_s"] / (base if job == "uniform" else ideal)
        partner, bystander = j["kinds"].get("partner"), j["kinds"].get("bystander")
        j["partner_overhead_pct"] = 100 * partner["transfers"] / j["step"] if partner else None
        j["bystander_overhead_pct"] = (
            100 * (bystander["outside"] - uniform["outside"]) / out["uniform"]["step"] if bystander else None
        )
    return out


def _pct(value) -> str:
    return "-" if value is None else f"{value:.2f}%"


def print_tables(summary: dict, args) -> None:
    ms = 1e3
    print(
        f"\n{'job':16} | {'GPUs':>4} | {'micro-batches/replica':>21} | {'step ms':>9} | {'tokens/s':>10} | "
        f"{'vs uniform':>10} | {'vs ideal':>8}"
    )
    print("-" * 98)
    for job in JOBS:
        j = summary[job]
        shares = "/".join(map(str, j["microbatches"]))
        print(
            f"{job:16} | {j['gpus']:4d} | {shares:>21} | {j['step'] * ms:9.1f} | {j['tokens_per_s']:10.0f} | "
            f"{j['vs_uniform']:10.3f} | {j['vs_ideal']:8.3f}"
        )
    world = args.replicas * args.tp_base
    print(
        f"ideal = surviving GPUs / all GPUs x uniform = {world - args.spares}/{world}; tokens/s = "
        f"{args.global_batch} x {args.seq} tokens / step; step = the slowest rank's (median over steps)"
    )
    print(
        f"\n{'job / replica kind':26} | {'n':>2} | {'mb':>3} | {'param xfer':>10} | {'zero':>6} | {'fwd+bwd':>9} | "
        f"{'wait':>8} | {'grad xfer':>9} | {'DP coll':>8} | {'optim':>7} | {'transfers':>9}"
    )
    print(
        f"{'':26} | {'':>2} | {'':>3} | {'ms':>10} | {'ms':>6} | {'ms':>9} | {'ms':>8} | {'ms':>9} | {'ms':>8} | "
        f"{'ms':>7} | {'% of step':>9}"
    )
    print("-" * 128)
    for job in JOBS:
        for kind, k in summary[job]["kinds"].items():
            pct = f"{100 * k['transfers'] / summary[job]['step']:8.2f}%" if kind in ("partner", "degraded") else "-"
            print(
                f"{job + ' / ' + kind:26} | {k['ranks']:2d} | {k['microbatches']:3d} | "
                f"{k['param_transfer'] * ms:10.2f} | {k['zero'] * ms:6.2f} | {k['compute'] * ms:9.1f} | "
                f"{k['wait'] * ms:8.2f} | {k['grad_transfer'] * ms:9.2f} | {k['collective'] * ms:8.2f} | "
                f"{k['optimizer'] * ms:7.2f} | {pct:>9}"
            )
    print(
        "param xfer: refresh_compute_params (partner -> satellite, after the optimizer step); grad xfer: the "
        "satellite's gradients into the partner's buckets; wait: barrier (the slowest replica); DP coll: "
        "finalize_model_grads over the healthy replicas"
    )
    for job in ("ntp unbalanced", "ntp balanced"):
        j = summary[job]
        print(
            f"{job}: partner's extra time (its transfers, no waiting) {_pct(j['partner_overhead_pct'])} of the step; "
            f"bystanders' overhead vs a uniform rank {_pct(j['bystander_overhead_pct'])} of the uniform step"
            + ("" if j["bystander_overhead_pct"] is not None else " (no bystander in this layout)")
        )


MEMORY_KINDS = (
    ("uniform job, all ranks", "uniform", "uniform"),
    ("NTP bystander", "ntp", "bystander"),
    ("NTP partner", "ntp", "partner"),
    ("NTP degraded", "ntp", "degraded"),
)
MEMORY_FIELDS = ("params", "grads", "staging", "optimizer", "total")


def memory_table(uniform, ntp_out) -> dict:
    """Print the per-rank memory table; return ``{kind: the kind's largest rank}`` (bytes; kinds this
    layout has none of are left out)."""
    runs = dict(uniform=uniform, ntp=ntp_out)
    groups = {}
    for name, run, role in MEMORY_KINDS:
        rows = [r for r in runs[run] if r["role"] == role]
        if rows:
            top = max(rows, key=lambda r: r["memory"]["total"])
            peaks = [r["peak_cuda_bytes"] for r in rows if r["peak_cuda_bytes"] is not None]
            groups[name] = dict(top["memory"], ranks=len(rows), peak_cuda_bytes=max(peaks) if peaks else None)
    base = groups["uniform job, all ranks"]["total"]
    mib = 2.0**20
    print(
        f"\nmemory per rank (MiB, exact tensor bytes; the largest rank of each kind)\n"
        f"{'ranks':22} | {'n':>2} | {'params':>8} | {'grads':>8} | {'staging':>8} | {'optimizer':>9} | "
        f"{'total':>8} | {'vs uniform':>10} | {'peak CUDA':>9}"
    )
    print("-" * 110)
    for name, _, _ in MEMORY_KINDS:
        g = groups.get(name)
        if g is None:
            print(f"{name:22} |  0 | (none in this layout)")
            continue
        peak = "-" if g["peak_cuda_bytes"] is None else f"{g['peak_cuda_bytes'] / mib:9.2f}"
        print(
            f"{name:22} | {g['ranks']:2d} | "
            + " | ".join(f"{g[k] / mib:{9 if k == 'optimizer' else 8}.2f}" for k in MEMORY_FIELDS)
            + f" | {g['total'] / base:9.2f}x | {peak:>9}"
        )
    print(
        "staging: the transfer buffers between a degraded replica and its partner; optimizer: main params + "
        "Adam state (the degraded replica holds none: its partner steps the weights)"
    )
    return groups


# ------------------------------------------------------------------------------ cost model
def costs_from_run(summary: dict, args) -> tuple[cost_model.StepCosts, dict]:
    """The model's costs from this run: per-micro-batch compute, DP collective, optimizer and the rest of
    the uniform step from the uniform job; the pair's transfers (the partner's, per healthy rank's shard:
    times ``tp_reduced / tp_base``) and the degraded replica's per-GPU efficiency from the unbalanced NTP
    phase (equal shares: the same micro-batches on every replica)."""
    uniform = summary["uniform"]["kinds"]["all"]
    per_replica = args.global_batch // args.micro_batch // args.replicas
    c = uniform["compute"] / per_replica
    sync_s, optimizer_s = uniform["collective"], uniform["optimizer"]
    other = max(0.0, summary["uniform"]["step"] - per_replica * c - sync_s - optimizer_s)
    unbalanced = summary["ntp unbalanced"]["kinds"]
    reduced = args.tp_base - args.spares
    shard = reduced / args.tp_base
    degraded_c = unbalanced["degraded"]["compute"] / per_replica
    costs = cost_model.StepCosts(
        microbatch_s=c,
        sync_s=sync_s,
        sync_replicas=args.replicas,
        optimizer_s=optimizer_s,
        other_s=other,
        grad_transfer_s=unbalanced["partner"]["grad_transfer"] * shard,
        param_transfer_s=unbalanced["partner"]["param_transfer"] * shard,
        degraded_efficiency=(args.tp_base / reduced) * c / degraded_c,
    )
    return costs, dict(dataclasses.asdict(costs), microbatches_per_replica=per_replica)


def _fmt(value, width: int = 7) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.2%}"


def large_tables(costs: cost_model.StepCosts, args) -> tuple[list[dict], int]:
    """Print the large-job tables from ``costs`` (per micro-batch of ``args.micro_batch`` samples); return
    them and the micro-batches per replica they use."""
    # the measured split of a healthy step, per sample unit of --model-micro-batch samples,
    # a degraded replica at exactly r/tp of a healthy one's speed (TP=r and TP=tp both communicate: the
    # TP=1 vs TP=2 efficiency measured here does not carry over).
    large = dataclasses.replace(
        costs, microbatch_s=costs.microbatch_s * args.model_micro_batch / args.micro_batch, degraded_efficiency=1.0
    )
    units = args.model_microbatches
    tables = []
    pp = args.pp
    for dp, job_tp in args.model_jobs:
        rows = cost_model.large_job_table(
            large,
            dp,
            job_tp,
            args.model_failed,
            units * dp,
            max_shrink=args.model_max_shrink,
            sizes=args.model_divides,
            pp=pp,
        )
        print(
            f"\nlarge job: DP={dp} x {f'PP={pp} x ' if pp > 1 else ''}TP={job_tp} ({dp * pp * job_tp} GPUs), "
            f"{units} micro-batches of "
            f"{args.model_micro_batch} sample(s) per replica ({units * dp} per global batch)"
            + (f"; r divides {', '.join(map(str, args.model_divides))}" if args.model_divides else "")
            + "; retained tokens/s vs uniform, integer shares unless 'fluid'"
        )
        print(
            f"{'k':>2} | {'placement':9} | {'D':>2} | {'r':>3} | {'ideal':>7} | {'policy':>7} | {'NTP bal':>7} | "
            f"{'unbal':>7} | {'drop':>7} | {'all at r':>8} | {'fl pol':>7} | {'fl drop':>7} | {'gran NTP':>8} | "
            f"{'gran drop':>9} | {'shrink':>7} | {'batch':>7} | policy's choice"
        )
        print("-" * 175)
        for row in rows:
            r = "-" if row["tp_reduced"] is None else str(row["tp_reduced"])
            print(
                f"{row['k']:2d} | {row['placement']:9} | {row['degraded_replicas']:2d} | {r:>3} | "
                f"{_fmt(row['ideal'])} | {_fmt(row['ntp policy'])} | {_fmt(row['ntp balanced'])} | "
                f"{_fmt(row['ntp unbalanced'])} | {_fmt(row['drop'])} | {_fmt(row['all at r'], 8)} | "
                f"{_fmt(row['ntp policy fluid'])} | {_fmt(row['drop fluid'])} | {_fmt(row['granularity_ntp'], 8)} | "
                f"{_fmt(row['granularity_drop'], 9)} | {_fmt(row['ntp shrink'])} | {_fmt(row['shrink_batch'])} | "
                f"{row['choice']}"
            )
        lines = cost_model.verdict(rows)
        print("\n".join(lines))
        tables.append(dict(dp=dp, tp=job_tp, pp=pp, rows=rows, verdict=lines))
    slots = units + pp - 1  # a pipeline's slots per stage: the micro-batches and the bubble
    print(
        f"granularity = fluid minus integer shares: with {units} micro-batches per replica one more on the slowest "
        f"replica costs up to 1/{slots} = {1 / slots:.2%}, for NTP and drop alike. shrink: every replica keeps "
        "its per-step work, a satellite does what fits in the step, the global batch shrinks by the shortfall "
        f"(at most --model-max-shrink {args.model_max_shrink:.0%}; 'batch' = the fraction kept): no granularity "
        "loss, but another global batch size for the optimiser."
    )
    print(
        "model: the measured split of a healthy step carried to each job; a replica at TP=r computes at r/tp of "
        "a healthy one's speed; a partner and its satellite pay the transfers (tp/r times the measured per-shard "
        "time, not hidden), bystanders nothing; the DP collective is a ring over the healthy replicas at TP=tp "
        "(all at r: over every replica, tp/r longer, optimizer too); the links are this run's; the model must "
        "split at TP=r (heads, query groups, ffn, vocab divisible by r: --model-divides lowers r until they are)."
        + (
            f" PP={pp}: each replica a 1F1B pipeline, (m + {pp - 1}) x 1/{pp} of a micro-batch's time for m "
            f"micro-batches (the bubble); every stage of a degraded replica at TP=r (r set by its worst stage); "
            f"the transfers, the DP collective and the optimizer per rank 1/{pp} of PP=1's (each stage its own "
            "layers, all stages at once); dropping a replica removes its PP x TP GPUs."
            if pp > 1
            else ""
        )
    )
    return tables, units


def model_section(summary: dict, args) -> dict:
    """Print the model's check against this run and the large-job tables; return them."""
    costs, record = costs_from_run(summary, args)
    tp, total = args.tp_base, args.global_batch // args.micro_batch
    failed = (args.spares,) + (0,) * (args.replicas - 1)
    ms = 1e3
    print(
        f"\ncost model: costs from this run (per step of a healthy replica): {costs.microbatch_s * ms:.2f} ms fwd+bwd "
        f"per micro-batch x {record['microbatches_per_replica']}, DP collective {costs.sync_s * ms:.2f} ms at "
        f"DP={costs.sync_replicas}, optimizer {costs.optimizer_s * ms:.2f} ms, rest {costs.other_s * ms:.2f} ms; "
        f"transfers per healthy shard: grad {costs.grad_transfer_s * ms:.2f} ms, param "
        f"{costs.param_transfer_s * ms:.2f} ms; degraded per-GPU efficiency {costs.degraded_efficiency:.3f} "
        f"(TP={tp - args.spares} vs TP={tp})"
    )
    check = []
    print(f"\n{'check: this run':16} | {'predicted':>9} | {'measured':>8} | {'error':>7}   (tokens/s vs uniform)")
    print("-" * 52)
    for job, mode, shares in (
        ("ntp balanced", "ntp balanced", args.balanced_shares.microbatches),
        ("ntp unbalanced", "ntp unbalanced", None),
        ("drop", "drop", None),
    ):
        predicted = cost_model.predict_retained(costs, tp, failed, total, mode, shares=shares)
        measured = summary[job]["vs_uniform"]
        check.append(dict(job=job, predicted=predicted, measured=measured))
        print(f"{job:16} | {predicted:9.3f} | {measured:8.3f} | {predicted - measured:+7.3f}")
    print(
        "inputs: the uniform job and the unbalanced phase's degraded compute and partner transfers; the balanced "
        "row (with this run's shares) and the drop row are predictions"
    )

    tables, units = large_tables(costs, args)
    return dict(
        costs=record,
        check=check,
        large_jobs=[
            dict(
                t,
                microbatches_per_replica=units,
                micro_batch=args.model_micro_batch,
                max_shrink=args.model_max_shrink,
                divides=list(args.model_divides),
                degraded_efficiency=1.0,
            )
            for t in tables
        ],
    )


def targets(summary: dict, model: dict, memory: dict, args) -> list[str]:
    """The issue's targets, each with the value this run and the model reached."""
    bal = summary["ntp balanced"]
    overhead = [summary[j]["partner_overhead_pct"] for j in ("ntp unbalanced", "ntp balanced")]
    world = args.replicas * args.tp_base
    lines = [
        f"this run: NTP balanced job throughput {bal['vs_ideal']:.1%} of the ideal ({world - args.spares}/{world} of "
        "uniform); target >= 95%",
        f"this run: partner's extra time (transfers, no waiting) {max(overhead):.2f}% of the step at most; "
        "target <= 3%",
        *memory_targets(memory, args),
        *model_targets(model),
    ]
    return lines


def _row_label(r: dict) -> str:
    return f"{r['dp']}x{r['tp']}" + (f" PP={r['pp']}" if r["pp"] > 1 else "") + f" k={r['k']} {r['placement']}"


def model_targets(model: dict) -> list[str]:
    """The issue's targets for the large-job model."""
    rows = [r for t in model["large_jobs"] for r in t["rows"]]
    below = [_row_label(r) for r in rows if r["ntp policy"] < r["drop"]]
    far = [
        f"{_row_label(r)} ({r['ntp policy fluid']:.2%} vs {r['ideal']:.2%})"
        for r in rows
        if r["ntp policy fluid"] < r["ideal"] - 0.01
    ]
    lines = [
        "model: NTP (policy) >= drop in every row with the same global batch ("
        + ("all " + str(len(rows)) + " rows" if not below else "not in " + ", ".join(below))
        + ")",
        "model: fluid NTP within 1% of the ideal in every row ("
        + ("all " + str(len(rows)) + " rows" if not far else "not in " + ", ".join(far))
        + ")",
    ]
    k1 = [r for r in rows if r["tp"] == 8 and r["k"] == 1 and r["placement"] == "spread"]
    if k1:
        r = k1[0]
        job = f"DP={r['dp']}" + (f", PP={r['pp']}" if r["pp"] > 1 else "")
        lines.append(
            f"model: k=1 at TP 8->7 ({job}): fluid {r['ntp policy fluid']:.2%}, integer {r['ntp policy']:.2%}, "
            f"shrink {_fmt(r['ntp shrink']).strip()}; target >= 98.5%"
        )
    else:
        lines.append("model: no TP=8 job in --model-jobs: the k=1 TP 8->7 target is not evaluated")
    return lines


def memory_targets(memory: dict, args) -> list[str]:
    """Each NTP rank kind's bytes against a uniform rank's (exact tensor bytes): healthy ranks, the partner with
    its staging, <= 1.02x; the degraded rank too where tp_base / r = 2 with fp32 weights (its TP-r parameters
    and gradients are then a uniform rank's parameters, gradients and Adam state over again)."""
    base = memory["uniform job, all ranks"]["total"]
    ratio = {k: memory[k]["total"] / base for k in ("NTP bystander", "NTP partner", "NTP degraded") if k in memory}
    healthy = ", ".join(f"{k[4:]} {v:.3f}x" for k, v in ratio.items() if k != "NTP degraded")
    lines = [f"memory: healthy ranks vs a uniform rank: {healthy}; target <= 1.02x"]
    reduced = args.tp_base - args.spares
    if "NTP degraded" in ratio:
        if args.tp_base == 2 * reduced and args.dtype == "fp32":
            lines.append(
                f"memory: degraded rank (TP {args.tp_base}->{reduced}, fp32) {ratio['NTP degraded']:.3f}x; "
                "target <= 1.02x"
            )
        else:
            lines.append(
                f"memory: degraded rank (TP {args.tp_base}->{reduced}, {args.dtype}) {ratio['NTP degraded']:.3f}x; "
                "the 1.02x target applies to tp_base/r = 2 with fp32 weights"
            )
    return lines


# ---------------------------------------------------------------------------------------- CLI
def _param_count(args) -> int:
    """Parameters of the GPT model (local spec: biases, layer norms, learned positions, untied output)."""
    h, f, v, s = args.hidden, args.ffn, args.vocab, args.seq
    layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    return args.layers * layer + 2 * v * h + s * h + 2 * h


def _model_jobs(text: str) -> list[tuple[int, int]]:
    """``--model-jobs``: ``DPxTP[,DPxTP...]``, each an int >= 1."""
    jobs = []
    for entry in text.split(","):
        dp, sep, tp = entry.strip().lower().partition("x")
        if not (sep and dp.isdigit() and tp.isdigit() and int(dp) >= 1 and int(tp) >= 1):
            raise argparse.ArgumentTypeError(
                f"expected DPxTP entries separated by ',' (ints >= 1, e.g. {MODEL_JOBS}), got {entry.strip()!r}"
            )
        jobs.append((int(dp), int(tp)))
    return jobs


def _fraction(text: str) -> float:
    """``--model-max-shrink``: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) (a fraction of the global batch), got {value}")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    """``--model-divides``: ints >= 1 separated by ','."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected ints >= 1 separated by ',' (e.g. 64,8,28672), got {text!r}")
    return tuple(int(p) for p in parts)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="model and batch defaults: tiny (CPU) or 2b (2.0e9 parameters, for 4 GPUs at TP=2); the flags "
        "below override single values",
    )
    parser.add_argument("--tp-base", type=int_at_least(1), default=2)
    parser.add_argument("--replicas", type=int_at_least(1), default=2)
    parser.add_argument("--spares", type=int_at_least(1), default=1, help="GPUs replica 0 loses (1..tp-base-1)")
    for flag in ("hidden", "layers", "heads", "vocab", "seq", "micro-batch", "global-batch", "steps"):
        parser.add_argument(f"--{flag}", type=int_at_least(1), default=None)
    parser.add_argument("--ffn", type=int_at_least(1), default=None, help="MLP width (default: 4 x --hidden)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before each job's timed steps")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on nccl, else fp32")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument(
        "--transfer-chunk-mb",
        type=float,
        default=None,
        help="the NTP job's --ntp-transfer-chunk-mb (default: the preset's, 64 for 2b; tiny scales it with the model)",
    )
    parser.add_argument(
        "--model-jobs",
        type=_model_jobs,
        default=_model_jobs(MODEL_JOBS),
        help=f"cost model: the large jobs, DPxTP entries separated by ',' (default {MODEL_JOBS}: DP=64 x TP=8 "
        "and scale-up domains of 32 and 64 GPUs per replica)",
    )
    parser.add_argument("--model-failed", type=int_at_least(1), default=8, help="cost model: k = 1..this")
    parser.add_argument(
        "--pp",
        type=int_at_least(1),
        default=1,
        help="cost model: pipeline stages per replica of the large jobs (DP x PP x TP GPUs; default 1)",
    )
    parser.add_argument(
        "--model-micro-batch",
        type=int_at_least(1),
        default=1,
        help="cost model: samples per micro-batch of the large jobs (default 1: sample granularity)",
    )
    parser.add_argument(
        "--model-microbatches",
        type=int_at_least(1),
        default=None,
        help="cost model: micro-batches per replica of the uniform large job (default: this run's samples per "
        "replica / --model-micro-batch)",
    )
    parser.add_argument(
        "--model-max-shrink",
        type=_fraction,
        default=cost_model.DEFAULT_MAX_SHRINK,
        help="cost model: the largest fraction of the global batch the shrinking-batch option may leave out",
    )
    parser.add_argument(
        "--model-divides",
        type=_sizes,
        default=(),
        help="cost model: sizes the reduced TP degree must divide, ints separated by ',' (e.g. the attention "
        "heads, query groups, ffn width of the large job's model; default none: r = TP - GPUs lost)",
    )
    parser.add_argument(
        "--costs-from",
        default=None,
        metavar="JSON",
        help="run no job: the cost model's large-job tables and targets from the costs a recorded run of this "
        "benchmark measured (its JSON, e.g. a 4-GPU run's); a run of the previous design (no partner transfers "
        "recorded) lends its healthy replica's unfold + fold time as the pair's transfers",
    )
    parser.add_argument("--out", default="benchmarks/results/ntp.json")
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.ffn is None:
        args.ffn = 4 * args.hidden
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.costs_from is not None:  # no job runs: the recorded run's sizes replace the preset's
        return args
    _check(parser, args)
    return args


def _check(parser, args) -> None:
    from megatron_ext.nonuniform_tp import NonuniformTPConfig

    world = args.replicas * args.tp_base
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    if args.backend == "nccl" and torch.cuda.device_count() < world:
        parser.error(
            f"--backend nccl needs {world} GPUs (--replicas {args.replicas} x --tp-base {args.tp_base}); "
            f"{torch.cuda.device_count()} visible: use fewer replicas or --backend gloo"
        )
    if args.dtype is None:
        args.dtype = "bf16" if args.backend == "nccl" else "fp32"
    if args.replicas < 2:
        parser.error(f"--replicas must be >= 2 (the drop job keeps the other replicas), got {args.replicas}")
    if not args.spares < args.tp_base:
        parser.error(f"--spares must be in 1..{args.tp_base - 1} (--tp-base - 1), got {args.spares}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    reduced = args.tp_base - args.spares
    for flag, value in (("--heads", args.heads), ("--ffn", args.ffn), ("--vocab", args.vocab)):
        if value % args.tp_base or value % reduced:
            parser.error(
                f"{flag} {value} must be divisible by --tp-base {args.tp_base} and by tp_reduced {reduced} "
                "(--tp-base - --spares)"
            )
    mb, gb = args.micro_batch, args.global_batch
    for replicas, job in ((args.replicas, "uniform and unbalanced NTP"), (args.replicas - 1, "drop")):
        if gb % (mb * replicas):
            unit = mb * replicas
            parser.error(
                f"--global-batch {gb} must be a multiple of --micro-batch x {replicas} replicas = {unit} (the "
                f"{job} job's equal shares) and of --micro-batch x {args.replicas} and x {args.replicas - 1}: "
                f"use a multiple of {math.lcm(mb * args.replicas, mb * (args.replicas - 1))}"
            )
    for dp, tp in args.model_jobs:
        if args.model_failed > dp * args.pp * tp:
            parser.error(
                f"--model-failed {args.model_failed} is more than the {dp * args.pp * tp} GPUs of the --model-jobs "
                f"entry {dp}x{tp}" + (f" at --pp {args.pp}" if args.pp > 1 else "")
            )
    if args.model_microbatches is None:
        samples = gb // args.replicas
        if samples % args.model_micro_batch:
            parser.error(
                f"--model-micro-batch {args.model_micro_batch} must divide this run's samples per replica "
                f"(--global-batch / --replicas = {samples}), or give --model-microbatches"
            )
        args.model_microbatches = samples // args.model_micro_batch
    failed = {0: tuple(range(reduced, args.tp_base))}
    try:
        args.ntp_kwargs = dict(
            tp_base=args.tp_base,
            tp_spares=args.spares,
            non_active_ranks_per_dp=failed,
            launch_mode="simulate",
            balance="tp",
            transfer_chunk_mb=args.transfer_chunk_mb,
        )
        args.balanced_shares = NonuniformTPConfig(**args.ntp_kwargs).batch_shares(gb, mb, args.replicas)
    except ValueError as exc:
        parser.error(f"--global-batch {gb} / --micro-batch {mb}: {exc}")


def costs_from_record(record: dict) -> tuple[cost_model.StepCosts, str]:
    """The model's costs from a recorded run's JSON, and where its transfers come from."""
    c = record["model"]["costs"]
    source = "the run's partner transfers"
    grad, param = c.get("grad_transfer_s"), c.get("param_transfer_s")
    if grad is None or param is None:  # the previous design: unfold + fold on a healthy replica per step
        shard = (record["tp_base"] - record["spares"]) / record["tp_base"]
        grad = param = c["ntp_overhead_s"] * shard / 2
        source = "the previous design's unfold + fold (no partner transfers recorded)"
    costs = cost_model.StepCosts(
        microbatch_s=c["microbatch_s"],
        sync_s=c.get("sync_s", 0.0),
        sync_replicas=c.get("sync_replicas", 2),
        optimizer_s=c.get("optimizer_s", 0.0),
        other_s=c.get("other_s", 0.0),
        grad_transfer_s=grad,
        param_transfer_s=param,
        degraded_efficiency=c.get("degraded_efficiency", 1.0),
    )
    return costs, source


def model_only(args, argv) -> int:
    """``--costs-from``: the large-job tables and the model's targets from a recorded run's costs."""
    with open(args.costs_from) as f:
        record = json.load(f)
    costs, source = costs_from_record(record)
    args.micro_batch = record["micro_batch"]
    if args.model_microbatches is None:
        args.model_microbatches = record["global_batch"] // record["replicas"] // args.model_micro_batch
    ms = 1e3
    print(
        f"cost model from {args.costs_from} ({record.get('device')}, {record['provenance'].get('date')}): "
        f"{costs.microbatch_s * ms:.2f} ms per micro-batch of {args.micro_batch}, DP collective "
        f"{costs.sync_s * ms:.2f} ms at DP={costs.sync_replicas}, optimizer {costs.optimizer_s * ms:.2f} ms, rest "
        f"{costs.other_s * ms:.2f} ms; the pair's transfers per healthy shard {costs.grad_transfer_s * ms:.2f} + "
        f"{costs.param_transfer_s * ms:.2f} ms from {source}"
    )
    tables, units = large_tables(costs, args)
    model = dict(costs=dataclasses.asdict(costs), transfers_from=source, large_jobs=tables)
    goals = model_targets(model)
    print("\ntargets (the issue's, model only):\n" + "\n".join(f"  {line}" for line in goals))
    result = dict(
        provenance=provenance("benchmarks/ntp.py", argv), costs_from=args.costs_from, model=model, targets=goals
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    from megatron_ext.nonuniform_tp import equal_batch_shares

    args = parse_args(argv)
    if args.costs_from is not None:
        return model_only(args, argv)
    world = args.replicas * args.tp_base
    spec = tiny_gpt.TinyGPTSpec(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        seq_length=args.seq,
        micro_batch_size=args.micro_batch,
    )
    mb, gb = args.micro_batch, args.global_batch
    equal = equal_batch_shares(args.replicas, gb, mb)
    drop_shares = equal_batch_shares(args.replicas - 1, gb, mb)
    params = _param_count(args)
    print(
        f"NTP benchmark: {world} ranks ({args.backend}, {args.dtype}), TP={args.tp_base} x DP={args.replicas}; "
        f"replica 0 loses slots {args.ntp_kwargs['non_active_ranks_per_dp'][0]} (TP={args.tp_base - args.spares}, the "
        f"satellite of replica 1; {args.replicas - 2} bystander(s)); "
        f"model {params / 1e9:.3f}e9 parameters (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"ffn {args.ffn}, vocab {args.vocab}, seq {args.seq}); global batch {gb} in micro-batches of {mb}; "
        f"{args.warmup} + {args.steps} steps per job",
        flush=True,
    )
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if args.backend == "nccl" else None
    common = (spec, args.dtype)
    timing = (args.steps, args.warmup)
    plans = (
        ("uniform", world, (None, args.tp_base), [("uniform", equal)]),
        (
            "ntp",
            world,
            (args.ntp_kwargs, args.tp_base),
            [("ntp unbalanced", equal), ("ntp balanced", args.balanced_shares)],
        ),
        ("drop", world - args.tp_base, (None, args.tp_base), [("drop", drop_shares)]),
    )
    runs = {}
    for job, ranks, (ntp_kwargs, tp), phases in plans:
        t = time.perf_counter()
        out = run_on_ranks(
            _bench_rank,
            ranks,
            args=(job, ntp_kwargs, tp) + common + (phases,) + timing,
            backend=args.backend,
            timeout=JOB_TIMEOUT_S,
            env=env,
        )
        runs[job] = [o for o in out if o is not None]
        print(f"[{job}] {ranks} ranks done in {time.perf_counter() - t:.1f}s", flush=True)

    summary = summarize(runs, args)
    print_tables(summary, args)
    memory = memory_table(runs["uniform"], runs["ntp"])
    model = model_section(summary, args)
    goals = targets(summary, model, memory, args)
    print("\ntargets (the issue's):\n" + "\n".join(f"  {line}" for line in goals))

    result = dict(
        provenance=provenance("benchmarks/ntp.py", argv),
        world=world,
        backend=args.backend,
        dtype=args.dtype,
        preset=args.preset,
        tp_base=args.tp_base,
        spares=args.spares,
        replicas=args.replicas,
        model_shape=dict(
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            ffn=args.ffn,
            vocab=args.vocab,
            seq=args.seq,
            parameters=params,
        ),
        global_batch=gb,
        micro_batch=mb,
        steps=args.steps,
        warmup=args.warmup,
        device=torch.cuda.get_device_name() if args.backend == "nccl" else "cpu",
        jobs=summary,
        memory=memory,
        model=model,
        targets=goals,
        per_rank=runs,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
