"""Nonuniform TP benchmark: the whole job's throughput when GPUs fail, for uniform TP, NTP with equal
and with balanced batch shares, and dropping the degraded replica, on the same GPUs; and a model that
predicts the retained throughput of large jobs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ntp.py                 # CPU/gloo, 4 ranks, tiny model
    python benchmarks/ntp.py --preset 2b --backend nccl                  # 4 GPUs: 2.0B model, TP=2 x DP=2
    python benchmarks/ntp.py --preset 2b --tp-base 4 --spares 2 --backend nccl     # 8 GPUs: TP=4, one replica at TP=2

Jobs (``world = replicas * tp_base`` processes; every step is one global batch of ``--global-batch``
samples in micro-batches of ``--micro-batch``, through Megatron's ``get_forward_backward_func`` with
each replica's own ``num_microbatches``, then the gradient sync and the optimizer step):

- ``uniform``: TP=tp_base x DP=replicas, Megatron's DDP, equal shares.
- ``ntp unbalanced``: simulate launch mode, replica 0 loses its last ``--spares`` TP slots and runs at
  TP=tp_base-spares; equal shares.
- ``ntp balanced``: the same job (same processes and model, after the unbalanced steps) with the
  shares of ``--ntp-balance tp`` (``NonuniformTPConfig.batch_shares``: micro-batches in proportion to
  the TP degree) set through ``ddp.set_batch_shares``.
- ``drop``: the degraded replica's ranks are gone: ``world - tp_base`` processes run uniform TP=tp_base
  over the other replicas with the same global batch.

Per rank and step (each step starts after a barrier; every phase is timed after CUDA synchronises):
``unfold`` (a healthy NTP rank's ``refresh_compute_params``: the updated shadow into the compute
weights), ``zero`` (``zero_grad_buffer`` and the optimizer's ``zero_grad``), ``compute`` (the
forward-backward function), ``fold`` (a healthy NTP rank's gradient fold into the shadow: the fold
schedule that ``finish_grad_sync`` runs first, run here on its own), ``wait`` (a barrier over the job:
the wait for the slowest replica), ``collective`` (``finalize_model_grads``: the data-parallel
collective, no waiting left), ``optimizer`` and ``step``. Overlap of the gradient reduce is off, so the
parts do not overlap. Per job: the step time of the slowest rank (median over steps of the per-step
maximum), tokens/s of the whole job (``global_batch * seq / step``), the fraction of uniform tokens/s,
and the fraction of the ideal (surviving GPUs / all GPUs x uniform). Per job and replica kind
(healthy / degraded): zero+unfold, fwd+bwd, grad sync (fold + wait + collective), optimizer, and the
healthy-replica overhead, unfold + fold without waiting, as % of the job's step.

Memory table: each rank's bytes for the model, exact from the tensors (``ddp_memory_report``, also on
CPU): parameters, gradients, NTP's training shadow, the optimizer (fp32 main params and Adam's state),
for uniform ranks, NTP healthy core, healthy spare and degraded ranks (the largest rank of each group),
and on GPUs the run's peak ``torch.cuda.max_memory_allocated`` (activations included).

Large-job model (:func:`predict_retained`, pure Python): a step is
``max over replicas(micro-batches * per-micro-batch compute [+ unfold + fold on healthy NTP replicas])
+ DP collective + rest``, with the costs measured here (:func:`costs_from_run`). A replica at TP=r
computes a micro-batch in ``tp/r`` times the healthy time (divided by the degraded replicas' per-GPU
efficiency); under NTP the DP collective and the optimizer run over the TP=r layout (each rank holds
``1/r`` of the model, not ``1/tp``), so they take ``tp/r`` times as long; the collective scales with
the DP size as a ring all-reduce (``2(n-1)/n``). Shares are integers: the balanced ones are those
``balanced_batch_shares`` gives by TP degree, equal ones the most even split. The model first predicts
this run (DP=replicas, TP=tp_base, spares GPUs of one replica) and prints it against the measured
fractions, then prints retained throughput for ``--model-dp`` replicas at ``--model-tp`` with
k = 1..``--model-failed`` failed GPUs spread one per replica and packed into as few replicas as
possible, for balanced NTP, unbalanced NTP and dropping the affected replicas (and, as "fluid",
balanced NTP and drop with real-valued shares: no micro-batch granularity), and says where balanced
NTP does not beat dropping and why (whole replicas lost, the slowest replica's integer share, NTP's
unfold + fold and reduced-TP layout). ``--model-microbatches`` sets that job's micro-batches per
replica (default: this run's). Last, this run's values against the issue's three targets.

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
from megatron_ext.testing import tiny_gpt  # noqa: E402
from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402

# Model shapes. ``2b``: GPT (learned positions, GeLU MLP, untied embeddings) with 2.03e9 parameters.
# Bytes per rank at TP=2 x DP=2 with one spare (bf16 params, fp32 grads, fp32 main params + Adam,
# plain optimizer): uniform rank 18 B/param / 2 = 18 GB; degraded (TP=1) 18 B/param = 37 GB; healthy
# core rank (TP=2 compute, TP=1 shadow) 3 + 18 B/param = 43 GB; plus activations (micro-batch 2 x 2048
# tokens, unfused attention: about 20 GB at TP=1) and the fold's scratch (<= 8 GB): within an H200's
# 141 GB (and an 80 GB H100's).
PRESETS = {
    "tiny": dict(hidden=256, layers=2, heads=8, vocab=1024, seq=64, micro_batch=2, global_batch=12, steps=10, warmup=3),
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
    ),
}
STEP_KEYS = ("unfold", "zero", "compute", "fold", "wait", "collective", "optimizer", "step")
DERIVED_KEYS = ("zero_unfold", "sync", "ntp_overhead")
JOBS = ("uniform", "ntp unbalanced", "ntp balanced", "drop")
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
    else:
        ddp = NonuniformTPDistributedDataParallel(
            cfg, ddp_config, model, ntp_config=rank_job.ntp_config, batch_shares=phases[0][1]
        )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0, bf16=bf16, params_dtype=cfg.params_dtype), [ddp]
    )
    cfg.no_sync_func = ddp.no_sync
    cfg.grad_scale_func = opt.scale_loss
    cfg.finalize_model_grads_func = None  # run below, after the forward-backward function, to time it apart
    forward_backward = get_forward_backward_func()
    # Healthy NTP ranks only: the fold schedule finish_grad_sync runs first (idempotent within a step),
    # run on its own here so that the fold is timed apart from the DP collective and its wait.
    fold = getattr(ddp, "fold_gradients", None)
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
                refresh()
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
            if fold is not None:
                fold()
            t.append(_clock(dev))
            _barrier(dev)
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
            parts["zero_unfold"] = parts["unfold"] + parts["zero"]
            parts["sync"] = parts["fold"] + parts["wait"] + parts["collective"]
            parts["ntp_overhead"] = parts["unfold"] + parts["fold"]
            for k, v in parts.items():
                times[k].append(v)
        out_phases[name] = dict(microbatches=len(offsets), times=times, skipped_steps=skipped)
    memory = ddp_memory_report(ddp, opt)  # after the steps: Adam's state exists
    return dict(
        job=job,
        replica=rank_job.replica,
        tp_size=tp_size,
        degraded=rank_job.degraded,
        healthy_ntp=bool(getattr(ddp, "is_ntp_healthy_rank", False)),
        role=memory.role,
        phases=out_phases,
        memory=memory.as_dict(),
        peak_cuda_bytes=torch.cuda.max_memory_allocated(dev) if gpu else None,
    )


# ------------------------------------------------------------------------------ large-job model
def _ring(n: int) -> float:
    """Bytes a ring all-reduce puts on each rank's link per byte of the buffer: ``2(n-1)/n``."""
    return 2.0 * (n - 1) / n


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """One healthy replica's step, in seconds, split into the parts the model scales.

    - ``microbatch_s``: forward + backward of one micro-batch at TP=tp.
    - ``sync_s``: the data-parallel gradient collective of a uniform step (no waiting), measured with
      ``sync_replicas`` replicas.
    - ``other_s``: the rest of a uniform step (zero_grad, the optimizer step, the loop).
    - ``ntp_overhead_s``: a healthy NTP replica's unfold + fold per step (no waiting).
    - ``degraded_efficiency``: a degraded replica's compute per GPU relative to a healthy one's
      (1.0: a replica at TP=r needs ``tp/r`` times the healthy time per micro-batch).
    """

    microbatch_s: float
    sync_s: float = 0.0
    sync_replicas: int = 2
    other_s: float = 0.0
    ntp_overhead_s: float = 0.0
    degraded_efficiency: float = 1.0

    def __post_init__(self):
        if not self.microbatch_s > 0 or math.isinf(self.microbatch_s):
            raise ValueError(f"StepCosts.microbatch_s must be a finite number > 0, got {self.microbatch_s!r}")
        for name in ("sync_s", "other_s", "ntp_overhead_s"):
            value = getattr(self, name)
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"StepCosts.{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.sync_replicas, int) or self.sync_replicas < 2:
            raise ValueError(
                f"StepCosts.sync_replicas must be an int >= 2 (the DP size sync_s was measured at), "
                f"got {self.sync_replicas!r}"
            )
        if not self.degraded_efficiency > 0 or math.isinf(self.degraded_efficiency):
            raise ValueError(
                f"StepCosts.degraded_efficiency must be a finite number > 0, got {self.degraded_efficiency!r}"
            )


MODES = ("ntp balanced", "ntp unbalanced", "drop")
PLACEMENTS = ("spread", "packed")


def place_failures(dp: int, tp: int, k: int, placement: str) -> tuple[int, ...]:
    """Failed GPUs per replica for ``k`` failures among ``dp`` replicas of ``tp`` GPUs: ``spread``
    deals them one per replica in turn (replica 0 first); ``packed`` fills replica 0, then replica 1, ..."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if not 0 <= k <= dp * tp:
        raise ValueError(f"k={k} failed GPUs: must be in 0..dp*tp = {dp * tp}")
    if placement == "spread":
        return tuple(k // dp + (d < k % dp) for d in range(dp))
    return tuple(min(tp, max(0, k - d * tp)) for d in range(dp))


def _even(total: int, n: int) -> list[int]:
    return [total // n + (i < total % n) for i in range(n)]


def _plan(costs: StepCosts, tp: int, failed, microbatches: int, mode: str, fluid: bool = False) -> dict:
    """Step seconds of a job whose replica ``d`` lost ``failed[d]`` of its ``tp`` GPUs (all zero:
    the uniform job), and the shares and TP degrees it runs with. ``fluid``: shares are real numbers
    (the limit of many small micro-batches), not integers."""
    from megatron_ext.nonuniform_tp import balanced_batch_shares

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if any(not 0 <= f <= tp for f in failed):
        raise ValueError(f"failed GPUs per replica must be in 0..tp={tp}, got {list(failed)}")
    if mode == "drop":
        degrees = [tp for f in failed if f == 0]
    else:
        # NTP: a replica that lost every GPU is gone; the others that lost some run at the same
        # reduced degree (spare parity: the largest loss sets it).
        worst = max((f for f in failed if f < tp), default=0)
        degrees = [tp - worst if f else tp for f in failed if f < tp]
    n = len(degrees)
    if n == 0:
        return dict(step_s=math.inf, degrees=[], counts=[], ntp=False)
    if microbatches < n and not fluid:
        raise ValueError(
            f"{microbatches} micro-batches for {n} replicas: each replica needs at least one; use more "
            "micro-batches per global batch"
        )
    ntp = mode != "drop" and min(degrees) < tp
    balanced = ntp and mode == "ntp balanced"
    if fluid:
        counts = [microbatches * t / sum(degrees) if balanced else microbatches / n for t in degrees]
    elif balanced:
        counts = list(balanced_batch_shares(degrees, microbatches, 1, require_gain=False).microbatches)
    else:
        counts = _even(microbatches, n)
    busy = [
        m * costs.microbatch_s * tp / t / (costs.degraded_efficiency if t < tp else 1.0)
        + (costs.ntp_overhead_s if ntp and t == tp else 0.0)
        for m, t in zip(counts, degrees)
    ]
    sync = costs.sync_s * _ring(n) / _ring(costs.sync_replicas)
    layout = tp / min(degrees) if ntp else 1.0  # NTP: collective and optimizer over the TP=r layout
    return dict(step_s=max(busy) + (sync + costs.other_s) * layout, degrees=degrees, counts=counts, ntp=ntp)


def predict_retained(
    costs: StepCosts, dp: int, tp: int, failed, microbatches: int, mode: str, fluid: bool = False
) -> float:
    """Tokens/s of the job with ``failed[d]`` GPUs lost in replica ``d`` (``mode``: "ntp balanced",
    "ntp unbalanced" or "drop"), as a fraction of the uniform job's on all ``dp * tp`` GPUs; both
    process global batches of ``microbatches`` micro-batches (``fluid``: split in real-valued shares)."""
    failed = tuple(failed)
    if len(failed) != dp:
        raise ValueError(f"failed lists {len(failed)} replicas, dp={dp}")
    uniform = _plan(costs, tp, (0,) * dp, microbatches, "drop", fluid)["step_s"]
    return uniform / _plan(costs, tp, failed, microbatches, mode, fluid)["step_s"]


def large_job_table(costs: StepCosts, dp: int, tp: int, max_failed: int, microbatches: int) -> list[dict]:
    """One row per k = 1..max_failed and placement: the ideal ``(N-k)/N``, every mode's prediction,
    and balanced NTP's and drop's with fluid shares (no micro-batch granularity)."""
    rows = []
    for k in range(1, max_failed + 1):
        for placement in PLACEMENTS:
            failed = place_failures(dp, tp, k, placement)
            ntp = _plan(costs, tp, failed, microbatches, "ntp balanced")
            row = dict(
                k=k,
                placement=placement,
                degraded_replicas=sum(0 < f < tp for f in failed),
                dead_replicas=sum(f == tp for f in failed),
                tp_reduced=min(ntp["degrees"]) if ntp["ntp"] else None,
                ideal=(dp * tp - k) / (dp * tp),
            )
            for mode in MODES:
                row[mode] = predict_retained(costs, dp, tp, failed, microbatches, mode)
            for mode in ("ntp balanced", "drop"):
                row[mode + " fluid"] = predict_retained(costs, dp, tp, failed, microbatches, mode, fluid=True)
            rows.append(row)
    return rows


def verdict(costs: StepCosts, dp: int, tp: int, microbatches: int, rows: list[dict]) -> list[str]:
    """Lines saying for which rows balanced NTP beats dropping the affected replicas, and why not elsewhere:
    whole replicas lost, micro-batch granularity (the slowest replica's integer share), NTP's overheads."""
    uniform = _plan(costs, tp, (0,) * dp, microbatches, "drop")["step_s"]
    wins, lines = [], []
    for row in rows:
        label = f"k={row['k']} {row['placement']}"
        ntp, drop = row["ntp balanced"], row["drop"]
        if ntp > drop:
            wins.append(label)
            continue
        if row["tp_reduced"] is None:
            lines.append(f"  {label}: equal ({ntp:.2%}): the failures take out whole replicas, NTP has none to keep")
            continue
        failed = place_failures(dp, tp, row["k"], row["placement"])
        ntp_plan = _plan(costs, tp, failed, microbatches, "ntp balanced")
        drop_plan = _plan(costs, tp, failed, microbatches, "drop")
        # in healthy micro-batch times: a replica at TP=t needs tp/t per micro-batch (over its efficiency)
        work = [
            m * tp / t / (costs.degraded_efficiency if t < tp else 1.0)
            for m, t in zip(ntp_plan["counts"], ntp_plan["degrees"])
        ]
        slowest = max(range(len(work)), key=work.__getitem__)
        r = row["tp_reduced"]
        sync = costs.sync_s * _ring(len(ntp_plan["degrees"])) / _ring(costs.sync_replicas)
        overhead = costs.ntp_overhead_s / uniform
        layout = (sync + costs.other_s) * (tp / r - 1) / uniform
        lines.append(
            f"  {label}: balanced NTP {ntp:.2%} <= drop {drop:.2%} (ideal {row['ideal']:.2%}): the slowest replica "
            f"computes {work[slowest]:.3g} healthy micro-batch times under NTP ({ntp_plan['counts'][slowest]} "
            f"micro-batches at TP={ntp_plan['degrees'][slowest]}) and {max(drop_plan['counts'])} under drop "
            f"(integer shares of {microbatches}; fluid shares would give NTP {row['ntp balanced fluid']:.2%}, drop "
            f"{row['drop fluid']:.2%}), and NTP adds unfold + fold on every healthy replica ({overhead:.2%} of a "
            f"uniform step) and the DP collective + optimizer over the TP={r} layout (+{layout:.2%})"
        )
    head = (
        f"balanced NTP beats dropping the affected replicas in every row ({len(wins)})"
        if not lines
        else f"balanced NTP beats dropping in {len(wins)} of {len(rows)} rows; not in:"
    )
    return [head] + lines


def costs_from_run(summary: dict, args) -> tuple[StepCosts, dict]:
    """The model's costs from this run: per-micro-batch compute, DP collective and the rest of the
    uniform step from the uniform job; unfold + fold and the degraded replica's per-GPU efficiency
    from the unbalanced NTP phase (equal shares: the same micro-batches on every replica)."""
    uniform = summary["uniform"]
    per_replica = args.global_batch // args.micro_batch // args.replicas
    c = uniform["kinds"]["all"]["compute"] / per_replica
    sync = uniform["kinds"]["all"]["collective"]
    other = max(0.0, uniform["step"] - per_replica * c - sync)
    unbalanced = summary["ntp unbalanced"]
    degraded_c = unbalanced["kinds"]["degraded"]["compute"] / per_replica
    tp_reduced = args.tp_base - args.spares
    efficiency = (args.tp_base / tp_reduced) * c / degraded_c
    costs = StepCosts(
        microbatch_s=c,
        sync_s=sync,
        sync_replicas=args.replicas,
        other_s=other,
        ntp_overhead_s=unbalanced["kinds"]["healthy"]["ntp_overhead"],
        degraded_efficiency=efficiency,
    )
    return costs, dict(dataclasses.asdict(costs), microbatches_per_replica=per_replica)


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
        kinds = (
            {"all": ranks}
            if not job.startswith("ntp")
            else {
                "healthy": [r for r in ranks if not r["degraded"]],
                "degraded": [r for r in ranks if r["degraded"]],
            }
        )
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
    ideal = (world - args.spares) / world * base
    for job in JOBS:
        out[job]["vs_uniform"] = out[job]["tokens_per_s"] / base
        out[job]["vs_ideal"] = out[job]["tokens_per_s"] / (base if job == "uniform" else ideal)
        healthy = out[job]["kinds"].get("healthy")
        out[job]["healthy_overhead_pct"] = 100 * healthy["ntp_overhead"] / out[job]["step"] if healthy else None
    return out


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
        f"\n{'job / replica kind':27} | {'n':>2} | {'mb':>3} | {'zero+unfold':>11} | {'fwd+bwd':>9} | "
        f"{'grad sync':>9} | {'fold':>7} | {'wait':>8} | {'DP coll':>8} | {'optim':>7} | {'unfold+fold':>11}"
    )
    print(
        f"{'':27} | {'':>2} | {'':>3} | {'ms':>11} | {'ms':>9} | {'ms':>9} | {'ms':>7} | {'ms':>8} | {'ms':>8} | "
        f"{'ms':>7} | {'% of step':>11}"
    )
    print("-" * 130)
    for job in JOBS:
        for kind, k in summary[job]["kinds"].items():
            pct = f"{100 * k['ntp_overhead'] / summary[job]['step']:10.2f}%" if kind == "healthy" else "-"
            print(
                f"{job + ' / ' + kind:27} | {k['ranks']:2d} | {k['microbatches']:3d} | {k['zero_unfold'] * ms:11.2f} | "
                f"{k['compute'] * ms:9.1f} | {k['sync'] * ms:9.2f} | {k['fold'] * ms:7.2f} | {k['wait'] * ms:8.2f} | "
                f"{k['collective'] * ms:8.2f} | {k['optimizer'] * ms:7.2f} | {pct:>11}"
            )
    print(
        "grad sync = fold + wait (barrier: the slowest replica) + DP collective (finalize_model_grads); "
        "unfold+fold: a healthy NTP replica's layout changes, without waiting (the slowest healthy rank)"
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


def model_section(summary: dict, args) -> dict:
    """Print the model's check against this run and the large-job table; return both."""
    costs, cost_record = costs_from_run(summary, args)
    total = args.global_batch // args.micro_batch
    failed = (args.spares,) + (0,) * (args.replicas - 1)
    ms = 1e3
    print(
        f"\nlarge-job model: costs from this run (per step of a healthy replica): {costs.microbatch_s * ms:.2f} ms "
        f"fwd+bwd per micro-batch x {cost_record['microbatches_per_replica']}, DP collective "
        f"{costs.sync_s * ms:.2f} ms at DP={costs.sync_replicas}, rest {costs.other_s * ms:.2f} ms, NTP unfold+fold "
        f"{costs.ntp_overhead_s * ms:.2f} ms; degraded per-GPU efficiency {costs.degraded_efficiency:.3f} "
        f"(TP={args.tp_base - args.spares} vs TP={args.tp_base})"
    )
    check = []
    print(f"\n{'check: this run':16} | {'predicted':>9} | {'measured':>8} | {'error':>7}   (tokens/s vs uniform)")
    print("-" * 52)
    for mode in MODES:
        predicted = predict_retained(costs, args.replicas, args.tp_base, failed, total, mode)
        measured = summary[mode]["vs_uniform"]
        check.append(dict(job=mode, predicted=predicted, measured=measured))
        print(f"{mode:16} | {predicted:9.3f} | {measured:8.3f} | {predicted - measured:+7.3f}")
    print(
        "inputs: the uniform job and the unbalanced phase's degraded compute and healthy unfold+fold; the "
        "balanced and drop rows are predictions"
    )

    # The large job: the measured split of a healthy step, a degraded replica at exactly r/tp of a
    # healthy one's speed (TP=r and TP=tp both communicate: the TP=1 vs TP=2 efficiency measured here
    # does not carry over).
    large = dataclasses.replace(costs, degraded_efficiency=1.0)
    per_replica = args.model_microbatches or cost_record["microbatches_per_replica"]
    micro = per_replica * args.model_dp
    rows = large_job_table(large, args.model_dp, args.model_tp, args.model_failed, micro)
    print(
        f"\nlarge job: DP={args.model_dp} x TP={args.model_tp} ({args.model_dp * args.model_tp} GPUs), "
        f"{per_replica} micro-batches per replica ({micro} per global batch, the same for every job); retained "
        "tokens/s vs uniform; fluid: shares in real numbers (no micro-batch granularity)"
    )
    print(
        f"{'k':>2} | {'placement':9} | {'degraded':>8} | {'TP r':>4} | {'ideal':>7} | {'NTP bal':>7} | "
        f"{'NTP unbal':>9} | {'drop':>7} | {'bal - drop':>10} | {'fluid: bal':>10} | {'drop':>7}"
    )
    print("-" * 112)
    for row in rows:
        r = "-" if row["tp_reduced"] is None else str(row["tp_reduced"])
        print(
            f"{row['k']:2d} | {row['placement']:9} | {row['degraded_replicas']:8d} | {r:>4} | {row['ideal']:7.2%} | "
            f"{row['ntp balanced']:7.2%} | {row['ntp unbalanced']:9.2%} | {row['drop']:7.2%} | "
            f"{row['ntp balanced'] - row['drop']:+10.2%} | {row['ntp balanced fluid']:10.2%} | {row['drop fluid']:7.2%}"
        )
    lines = verdict(large, args.model_dp, args.model_tp, micro, rows)
    print("\n".join(lines))
    print(
        "model: the measured split of a healthy step (compute per micro-batch, DP collective, rest, NTP "
        "unfold+fold) carried to the large job; a replica at TP=r computes at r/tp of a healthy one's speed; "
        "under NTP the DP collective and the optimizer run over the TP=r layout (tp/r longer); the collective "
        "scales as a ring all-reduce over the DP size at the measured bus bandwidth; the model must split at "
        "TP=r (heads, query groups, ffn, vocab divisible by r)."
    )
    return dict(
        costs=cost_record,
        check=check,
        large_job=dict(
            dp=args.model_dp,
            tp=args.model_tp,
            microbatches_per_replica=per_replica,
            degraded_efficiency=1.0,
            rows=rows,
            verdict=lines,
        ),
    )


def targets(summary: dict, model: dict, args) -> list[str]:
    """The issue's three targets, each with the value this run reached."""
    bal = summary["ntp balanced"]
    worst = max(summary[j]["healthy_overhead_pct"] for j in ("ntp unbalanced", "ntp balanced"))
    rows = model["large_job"]["rows"]
    losing = [f"k={r['k']} {r['placement']}" for r in rows if r["ntp balanced"] <= r["drop"]]
    world = args.replicas * args.tp_base
    return [
        f"NTP balanced job throughput: {bal['vs_ideal']:.1%} of the ideal ({world - args.spares}/{world} of "
        "uniform); target >= 95%",
        f"healthy-replica overhead (unfold + fold, no waiting): {worst:.2f}% of the step at most; target <= 3%",
        "large-job model: balanced NTP beats dropping in every row"
        if not losing
        else f"large-job model: balanced NTP does not beat dropping in {', '.join(losing)} (see why above)",
    ]


# ---------------------------------------------------------------------------------------- CLI
def _param_count(args) -> int:
    """Parameters of the GPT model (local spec: biases, layer norms, learned positions, untied output)."""
    h, f, v, s = args.hidden, args.ffn, args.vocab, args.seq
    layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    return args.layers * layer + 2 * v * h + s * h + 2 * h


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
    parser.add_argument("--model-dp", type=int_at_least(1), default=64, help="large-job model: replicas")
    parser.add_argument("--model-tp", type=int_at_least(1), default=8, help="large-job model: TP degree")
    parser.add_argument("--model-failed", type=int_at_least(1), default=8, help="large-job model: k = 1..this")
    parser.add_argument(
        "--model-microbatches",
        type=int_at_least(1),
        default=None,
        help="large-job model: micro-batches per replica of the uniform job (default: this run's)",
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
    failed = {0: tuple(range(reduced, args.tp_base))}
    try:
        args.ntp_kwargs = dict(
            tp_base=args.tp_base,
            tp_spares=args.spares,
            non_active_ranks_per_dp=failed,
            launch_mode="simulate",
            balance="tp",
        )
        args.balanced_shares = NonuniformTPConfig(**args.ntp_kwargs).batch_shares(gb, mb, args.replicas)
    except ValueError as exc:
        parser.error(f"--global-batch {gb} / --micro-batch {mb}: {exc}")


def main(argv=None) -> int:
    from megatron_ext.nonuniform_tp import equal_batch_shares

    args = parse_args(argv)
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
        f"replica 0 loses slots {args.ntp_kwargs['non_active_ranks_per_dp'][0]} (TP={args.tp_base - args.spares}); "
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
    goals = targets(summary, model, args)
    print("\ntargets (the issue's, for 4 GPUs):\n" + "\n".join(f"  {line}" for line in goals))

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
