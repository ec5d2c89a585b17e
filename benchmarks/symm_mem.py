"""Benchmark NCCL symmetric-memory staging on ``--world`` GPUs (default 2): collectives and training steps.

    python benchmarks/symm_mem.py [--world N] [--out symm_mem.json] [--quick] [--parts collectives,fsdp,ddp]

Every job runs on ``--world`` ranks (one GPU each), so the collectives and the
size bands derived from them are those of a group of that many ranks.

Part 1, collectives: all-gather, reduce-scatter and all-reduce, bf16 and fp32,
full-buffer sizes 256 KiB .. 512 MiB, plain buffers vs symmetric buffers (send
and receive both from the pool and registered). Launch-free timing: for every
(collective, dtype, size, variant) N back-to-back collectives are captured into
a CUDA graph; each timed replay starts after a barrier and a device sync on
every rank, and the per-call time is the replay's CUDA-event time over N, the
smallest over the ranks (the rank that arrived last never waited for a
peer). Variants are interleaved; median, min and max of the repetitions are
reported, with back-to-back eager timings beside them. The profiler checks
which kernels ran inside the replays (``ncclSymk*`` for symmetric buffers, none
for plain ones); a point whose capture fails, or whose symmetric replay did not
run a symmetric kernel, falls back to eager timing and says so.
``NCCL_GRAPH_REGISTER=0`` keeps NCCL from registering the plain buffers of a
captured graph, so plain replays run the kernels plain eager calls run.

From these timings the benchmark derives the size band per collective where
symmetric buffers are not slower than plain for either dtype (and per dtype)
with ``megatron_ext.fsdp_symm.probe.bands_from_timings`` (the derivation the
start-up probe uses), then measures the policy column the same way with the
derived bands (the candidate defaults of ``megatron_ext/fsdp_symm/config.py``),
against plain.

Part 2, training steps whose communication is exposed (small batch, no
overlap), each model family in its own job of ``--world`` ranks: experimental FSDP (upstream
plain, upstream ``use_symm_mem=True``, ours auto with the derived bands, ours
on) and Megatron DDP (plain, ours auto, ours on; auto with the derived bf16 and
fp32 bands when part 1 ran, else the shipped defaults), ms/step (median, min, max of
repetitions) and the NCCL kernels of one profiled step (their count, summed
time, and the time when only NCCL kernels ran on the GPU: :func:`profile_step`).
Staged models are freed with ``release_symmetric_memory`` between variants.
``benchmarks/train_step.py`` runs the end-to-end step benchmark (a >= 1B GPTModel).

Prints tables and writes JSON (``world``: the ranks of every job). Needs
``--world`` GPUs (NCCL_NVLS_ENABLE=0 on our H200 machines).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import provenance  # noqa: E402
from megatron_ext.fsdp_symm.probe import bands_from_timings  # noqa: E402

MIB = 1 << 20
SIZES = [
    MIB // 4,
    MIB // 2,
    MIB,
    2 * MIB,
    4 * MIB,
    8 * MIB,
    16 * MIB,
    32 * MIB,
    64 * MIB,
    128 * MIB,
    256 * MIB,
    512 * MIB,
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
GRAPH_TARGET_US = 3000.0  # per replay: long enough to amortize the start, short enough to repeat


def _log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


# ------------------------------------------------------------------ timing
def _time(fn, iters, reps):
    """Median over ``reps`` of the mean time of ``iters`` back-to-back calls (us)."""
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / iters)
    return statistics.median(out)


def _calls_per_graph(nbytes):
    est_us = 10.0 + nbytes / 300e3  # ~300 GB/s bus bandwidth at large sizes
    return int(min(100, max(8, round(GRAPH_TARGET_US / est_us))))


def _capture(fn, n):
    """A CUDA graph of ``n`` back-to-back calls of ``fn``, or the error text."""
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        g.replay()  # one untimed replay: first-launch costs stay out of the numbers
        torch.cuda.synchronize()
        return g
    except Exception as exc:  # noqa: BLE001 - reported, then eager timing
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {exc}"


def _aligned_replays(graphs: dict, reps: int) -> dict:
    """Per-call time (us) of each ``name -> (graph, n)``, ``reps`` interleaved
    repetitions; each replay starts after a barrier + device sync on every rank
    and counts as the smallest of the ranks' event times."""
    names = list(graphs)
    times = {n: [] for n in names}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            g, n = graphs[name]
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times[name].append(s.elapsed_time(e) * 1e3 / n)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return {n: t[i].tolist() for i, n in enumerate(names)}


def _stats(values):
    med = statistics.median(values)
    return dict(median=med, min=min(values), max=max(values), spread=(max(values) - min(values)) / med)


# ------------------------------------------------------------------ buffers, kernels
def _buffers(collective, nbytes, dtype, ws, symm):
    numel = nbytes // dtype.itemsize
    numel -= numel % ws
    shapes = {"all_gather": (numel // ws, numel), "reduce_scatter": (numel, numel // ws), "all_reduce": (numel, numel)}[
        collective
    ]
    if symm is None:
        send = torch.randn(shapes[0], device="cuda").to(dtype)
        recv = torch.empty(shapes[1], device="cuda", dtype=dtype)
        return send, recv
    from megatron_ext.fsdp_symm import SymmetricPlacementMismatch

    for attempt in range(3):
        try:
            # check=True: the same place of the pool on both ranks, or an error
            # on both (then let pending frees land and try again).
            send = symm.empty(shapes[0], dtype, check=True)
            recv = send if collective == "all_reduce" else symm.empty(shapes[1], dtype, check=True)
            break
        except SymmetricPlacementMismatch:
            if attempt == 2:
                raise
            send = recv = None
            time.sleep(0.5)
            _quiesce()
    send.copy_(torch.randn(shapes[0], device="cuda"))
    return send, recv


def _op(collective, send, recv):
    if collective == "all_gather":
        return lambda: dist.all_gather_into_tensor(recv, send)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(recv, send, op=dist.ReduceOp.SUM)
    return lambda: dist.all_reduce(send, op=dist.ReduceOp.SUM)


def _gpu_events(prof):
    """The GPU work the profiler saw: kernels, memcpys, memsets (not user annotations mirrored on the GPU)."""
    return [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]


def _nccl_events(prof):
    return sorted((e for e in _gpu_events(prof) if "nccl" in e.name.lower()), key=lambda e: e.time_range.start)


def _kernel_names(calls):
    """Kernel names of each ``(fn, n_kernels)`` run once, in one profiler
    session when the kernels map to the calls by count, else one session each."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn, _ in calls:
            fn()
            torch.cuda.synchronize()
    names = [e.name.split("(")[0] for e in _nccl_events(prof)]
    if len(names) == sum(n for _, n in calls):
        out, i = [], 0
        for _, n in calls:
            out.append(sorted(set(names[i : i + n])))
            i += n
        return out
    out = []
    for fn, _ in calls:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        out.append(sorted({e.name.split("(")[0] for e in _nccl_events(prof)}))
    return out


def _symk(names):
    return any("symk" in n.lower() for n in names)


# ------------------------------------------------------------------ part 1
def _measure_point(collective, dname, dtype, nbytes, ws, variants, reps, use_graphs):
    """Time ``variants`` (name -> buffers or None for a symmetric alias) at one point."""
    fns = {name: _op(collective, *bufs) for name, bufs in variants.items()}
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    n = _calls_per_graph(nbytes)
    row = dict(collective=collective, dtype=dname, nbytes=nbytes, calls_per_replay=n)
    graphs, errors = {}, {}
    if use_graphs:
        for name, fn in fns.items():
            g = _capture(fn, n)
            (graphs.__setitem__ if not isinstance(g, str) else errors.__setitem__)(name, g)
    if errors:
        row["graph_error"] = errors
    eager = {name: _time(fn, n, 3) for name, fn in fns.items()}
    for name in fns:
        row[f"eager_{name}_us"] = eager[name]
    calls = [(fns[name], 1) for name in fns] + [(graphs[name].replay, n) for name in graphs]
    names = _kernel_names(calls)
    for name, kn in zip(fns, names[: len(fns)]):
        row[f"eager_{name}_kernels"] = kn
    for name, kn in zip(graphs, names[len(fns) :]):
        row[f"graph_{name}_kernels"] = kn
    # Graph timing only where every variant captured and the graph ran the same
    # kind of kernel as the eager call (symmetric or not).
    ok = len(graphs) == len(fns) and all(
        _symk(row[f"graph_{k}_kernels"]) == _symk(row[f"eager_{k}_kernels"]) for k in graphs
    )
    if ok:
        times = _aligned_replays({k: (graphs[k], n) for k in fns}, reps)
        row["timing"] = "graph"
    else:
        times = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():
                times[k].append(_time(fn, n, 1))
        row["timing"] = "eager" + ("" if len(graphs) == len(fns) else " (capture failed)")
    for k, v in times.items():
        st = _stats(v)
        row[f"{k}_us"] = st["median"]
        row[f"{k}_us_min"], row[f"{k}_us_max"], row[f"{k}_spread"] = st["min"], st["max"], st["spread"]
        row[f"{k}_reps_us"] = v
        row[f"{k}_kernels"] = row.get(f"graph_{k}_kernels") if ok else row[f"eager_{k}_kernels"]
    del graphs
    torch.cuda.synchronize()
    return row


def bench_collectives(quick, reps, use_graphs):
    from megatron_ext.fsdp_symm import decide
    from megatron_ext.fsdp_symm.capability import probe
    from megatron_ext.fsdp_symm.memory import SymmetricMemory

    ws = dist.get_world_size()
    group = dist.group.WORLD
    cap = probe(group)
    _log(f"capability: {cap}")
    symm = SymmetricMemory(torch.device("cuda", torch.cuda.current_device()), group)
    sizes = SIZES[::3] if quick else SIZES
    rows = []
    # Phase A: plain vs symmetric at every point.
    for collective in COLLECTIVES:
        for dname, dtype in DTYPES.items():
            for nbytes in sizes:
                variants = {
                    "plain": _buffers(collective, nbytes, dtype, ws, None),
                    "symmetric": _buffers(collective, nbytes, dtype, ws, symm),
                }
                row = _measure_point(collective, dname, dtype, nbytes, ws, variants, reps, use_graphs)
                row.update(symk_engaged=_symk(row["symmetric_kernels"]), plain_symk=_symk(row["plain_kernels"]))
                rows.append(row)
                del variants
                _log(
                    f"{collective:<15}{dname:<5}{nbytes / MIB:>8.2f} MiB [{row['timing']:<5}] "
                    f"plain {row['plain_us']:8.1f} us (±{100 * row['plain_spread']:.1f}%)  "
                    f"symm {row['symmetric_us']:8.1f} us (±{100 * row['symmetric_spread']:.1f}%)  "
                    f"{row['plain_us'] / row['symmetric_us']:.3f}x  symk={row['symk_engaged']}  "
                    f"eager {row['eager_plain_us']:7.1f}/{row['eager_symmetric_us']:7.1f} us  "
                    f"{row['symmetric_kernels'][:1]}"
                )
    bands = bands_from_timings(rows)
    dtype_bands = {d: bands_from_timings(rows, dtypes=(d,)) for d in DTYPES}
    cfg = config_from_bands(bands, bands)  # one band for both dtypes
    dtype_cfg = {d: config_from_bands(b, b) for d, b in dtype_bands.items()}
    _log(f"recommended bands (MiB) at {ws} ranks:", _mib_bands(bands))
    for d, b in dtype_bands.items():
        _log(f"  {d} only:", _mib_bands(b))
    # Phase B: the policy with the derived bands against plain, measured the same way.
    policy_rows = []
    for collective in COLLECTIVES:
        for dname, dtype in DTYPES.items():
            for nbytes in sizes:
                d = decide(collective, nbytes, cfg, dtype=dtype)
                dd = decide(collective, nbytes, dtype_cfg[dname], dtype=dtype)
                plain = _buffers(collective, nbytes, dtype, ws, None)
                variants = {
                    "plain": plain,
                    "policy": _buffers(collective, nbytes, dtype, ws, symm if d.symmetric else None),
                }
                if dd.symmetric != d.symmetric:
                    variants["policy_dtype"] = _buffers(collective, nbytes, dtype, ws, symm if dd.symmetric else None)
                row = _measure_point(collective, dname, dtype, nbytes, ws, variants, reps, use_graphs)
                row.update(
                    policy_symmetric=d.symmetric,
                    policy_reason=d.reason,
                    policy_symk=_symk(row["policy_kernels"]),
                    policy_ratio=row["policy_us"] / row["plain_us"],
                )
                if "policy_dtype" in variants:
                    row.update(
                        policy_dtype_symmetric=dd.symmetric, policy_dtype_ratio=row["policy_dtype_us"] / row["plain_us"]
                    )
                policy_rows.append(row)
                _log(
                    f"policy {collective:<15}{dname:<5}{nbytes / MIB:>8.2f} MiB "
                    f"[{'S' if d.symmetric else 'P'}] {row['policy_ratio']:.3f}x plain time "
                    f"(symk={row['policy_symk']})"
                    + (
                        f"  per-dtype [{'S' if dd.symmetric else 'P'}] {row['policy_dtype_ratio']:.3f}x"
                        if "policy_dtype" in variants
                        else ""
                    )
                )
                del variants, plain
    return dict(
        collectives=rows,
        policy=policy_rows,
        recommended_bands=bands,
        recommended_bands_per_dtype=dtype_bands,
        policy_worst_vs_plain=max(r["policy_ratio"] for r in policy_rows),
        policy_symk_matches_decision=all(r["policy_symk"] == r["policy_symmetric"] for r in policy_rows),
    )


def config_from_bands(bands, fp32_bands=None, **kwargs):
    """A ``SymmMemConfig`` whose auto bands are ``bands`` (``None``: never
    symmetric), and ``fp32_bands`` for float32 buffers when given."""
    from megatron_ext.fsdp_symm import SymmMemConfig

    fields = {}
    for prefix, table in (("", bands), ("fp32_", fp32_bands or {})):
        for name, band in table.items():
            lo, hi = band if band is not None else (0, 0)
            fields.update({f"{name}_{prefix}min_bytes": lo, f"{name}_{prefix}max_bytes": hi})
    return SymmMemConfig(**fields, **kwargs)


def _mib_bands(bands):
    return {k: v and (v[0] / MIB, v[1] / MIB) for k, v in bands.items()}


def collectives_rank(quick, reps, use_graphs):
    return bench_collectives(quick, reps, use_graphs)


# ------------------------------------------------------------------ part 2
def _quiesce():
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()


def step_stats(step, steps, reps, warmup=3):
    """This rank's ms per step of ``step``: after ``warmup`` untimed steps, ``reps``
    repetitions of ``steps`` back-to-back steps, each after a device sync and a barrier
    (CUDA-event time over ``steps``); median, min, max and every repetition."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    per_rep = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        per_rep.append(_time(step, steps, 1) / 1e3)
    return dict(ms_per_step=statistics.median(per_rep), ms_min=min(per_rep), ms_max=max(per_rep), ms_reps=per_rep)


def merged_intervals(intervals):
    """``(start, end)`` intervals merged into sorted, disjoint ones."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(i) for i in out]


def busy_us(intervals) -> float:
    """The time covered by at least one of ``intervals``."""
    return sum(end - start for start, end in merged_intervals(intervals))


def exposed_us(comm, other) -> float:
    """The time covered by ``comm`` intervals and by none of ``other``: on a GPU
    timeline, communication that no other GPU work hides."""
    a, b = merged_intervals(comm), merged_intervals(other)
    overlap, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            overlap += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return busy_us(a) - overlap


def profile_step(step):
    """The GPU work of one ``step`` under the profiler: NCCL kernels (count, how many
    ran symmetric ``ncclSymk`` kernels, summed time), the time NCCL kernels ran
    (on any stream), the part of it no other kernel, memcpy or memset overlapped
    (exposed), and the time the GPU ran anything."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gpu = _gpu_events(prof)
    events = sorted((e for e in gpu if "nccl" in e.name.lower()), key=lambda e: e.time_range.start)
    names = [e.name.split("(")[0] for e in events]
    comm = [(e.time_range.start, e.time_range.end) for e in events]
    other = [(e.time_range.start, e.time_range.end) for e in gpu if "nccl" not in e.name.lower()]
    return {
        "nccl_kernels": len(names),
        "symk_kernels": sum("symk" in n.lower() for n in names),
        # Includes time spent waiting for the peer inside the kernel.
        "nccl_kernel_us": sum(e.time_range.elapsed_us() for e in events),
        "nccl_busy_us": busy_us(comm),
        "exposed_nccl_us": exposed_us(comm, other),
        "gpu_busy_us": busy_us(comm + other),
    }


def fsdp_rank(width, layers, batch, steps, reps, bands):
    from torch.distributed.device_mesh import init_device_mesh
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MixedPrecisionPolicy
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import (
        Flat,
        Placements,
        fully_shard as upstream_fully_shard,
        fully_shard_optimizer,
    )

    from megatron_ext.fsdp_symm import SymmMemConfig, fully_shard, release_symmetric_memory

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    placements = Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])
    auto = config_from_bands(*bands, report=False) if bands else SymmMemConfig(report=False)
    out = {}
    for variant in ("upstream plain", "upstream use_symm_mem", "ours (auto)", "ours (on)"):
        try:
            torch.manual_seed(1234)
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
            model = model.to(device="cuda", dtype=torch.bfloat16)
            mp = MixedPrecisionPolicy(main_params_dtype=torch.float32)
            for m in model:
                if variant.startswith("ours"):
                    cfg = SymmMemConfig(mode="on", report=False) if variant == "ours (on)" else auto
                    fully_shard(m, mesh=mesh, placements=placements, mixed_precision_policy=mp, symm_mem_config=cfg)
                else:
                    upstream_fully_shard(
                        m,
                        mesh=mesh,
                        placements=placements,
                        mixed_precision_policy=mp,
                        use_symm_mem=variant == "upstream use_symm_mem",
                    )
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            fully_shard_optimizer(opt)
            x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
            y = torch.randn_like(x)
            losses = []

            def step():
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.detach())

            r = step_stats(step, steps, reps)
            r.update(profile_step(step), final_loss=losses[-1].float().item())
            if variant.startswith("ours"):
                r["symmetric_collectives"] = sum(
                    g.all_gather_decision.symmetric + g.reduce_scatter_decision.symmetric
                    for layer in model
                    for g in layer.parameter_groups
                )
                r["released_bytes"] = release_symmetric_memory(model)
            out[variant] = r
            _log(
                f"FSDP w={width} L={layers} {variant:<22} {r['ms_per_step']:.3f} ms/step "
                f"[{r['ms_min']:.3f}, {r['ms_max']:.3f}]  nccl {r['nccl_kernels']} "
                f"symk {r['symk_kernels']}  nccl kernel time {r['nccl_kernel_us']:.0f} us"
            )
        except Exception:  # noqa: BLE001 - keep the other variants
            import traceback

            out[variant] = {"error": traceback.format_exc()}
            _log(f"FSDP w={width} L={layers} {variant} failed:\n{out[variant]['error']}")
        model = opt = step = None
        _quiesce()
    return out


def ddp_rank(hidden, layers, bucket_mib, distopt, steps, reps, bands):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.fsdp_symm import SymmMemConfig, SymmMemDistributedDataParallel, release_symmetric_memory
    from megatron_ext.testing import tiny_gpt

    ps.initialize_model_parallel()
    spec = tiny_gpt.TinyGPTSpec(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=16,
        ffn_hidden_size=4 * hidden,
        vocab_size=8192,
        seq_length=128,
        micro_batch_size=1,
    )
    auto = config_from_bands(*bands, report=False) if bands else SymmMemConfig(report=False)
    out = {}
    for variant in ("plain", "ours (auto)", "ours (on)"):
        try:
            cfg = tiny_gpt.transformer_config(spec)  # fp32 params and grads
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=distopt,
                overlap_grad_reduce=True,
                bucket_size=bucket_mib * MIB // 4,
            )
            module = tiny_gpt.build_model(spec, cfg, device="cuda")
            if variant == "plain":
                ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=module)
            else:
                scfg = SymmMemConfig(mode="on", report=False) if variant == "ours (on)" else auto
                ddp = SymmMemDistributedDataParallel(
                    config=cfg, ddp_config=ddp_config, module=module, symm_mem_config=scfg
                )
            opt = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=distopt), [ddp]
            )
            tokens, labels = tiny_gpt.global_batch(spec, step=dist.get_rank(), num_samples=1)
            tokens, labels = tokens.cuda(), labels.cuda()

            def step():
                ddp.zero_grad_buffer()
                opt.zero_grad()
                tiny_gpt.forward_loss(ddp, tokens, labels).backward()
                ddp.finish_grad_sync()
                opt.step()

            r = step_stats(step, steps, reps)
            decisions = getattr(ddp, "symm_mem_decisions", [])
            r.update(
                profile_step(step),
                buckets=len(ddp.buffers[0].buckets),
                bucket_mib=[b.grad_data.numel() * 4 / MIB for b in ddp.buffers[0].buckets],
                symmetric_buffers=sum(d.symmetric for _, d in decisions),
                collective_buffers=len(decisions),
            )
            if variant != "plain":
                r["released_bytes"] = release_symmetric_memory(ddp)
            out[variant] = r
            _log(
                f"DDP distopt={distopt} {variant:<12} {r['ms_per_step']:.3f} ms/step "
                f"[{r['ms_min']:.3f}, {r['ms_max']:.3f}]  nccl {r['nccl_kernels']} "
                f"symk {r['symk_kernels']} buckets {r['buckets']} symmetric {r['symmetric_buffers']}"
            )
        except Exception:  # noqa: BLE001 - keep the other variants
            import traceback

            out[variant] = {"error": traceback.format_exc()}
            _log(f"DDP distopt={distopt} {variant} failed:\n{out[variant]['error']}")
        ddp = opt = module = step = None
        _quiesce()
    return out


# ------------------------------------------------------------------ driver
def _job(result, key, fn, args, timeout, out_path, world):
    from megatron_ext.testing.multirank import RankFailure, run_on_ranks

    t0 = time.time()
    try:
        value = run_on_ranks(fn, world, args=args, backend="nccl", timeout=timeout)[0]
    except RankFailure as exc:
        value = {"error": str(exc)[-6000:]}
        print(f"{key} failed:\n{value['error']}", flush=True)
    result.setdefault("wall_s", {})[key] = time.time() - t0
    node, *rest = key.split("/")
    if rest:
        result.setdefault(node, {})[rest[0]] = value
    else:
        result[node] = value
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (GPUs) of every job (default 2)")
    parser.add_argument("--out", default="symm_mem.json")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and models")
    parser.add_argument("--parts", default="collectives,fsdp,ddp")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per point")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (eager timing only)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed repetition")
    parser.add_argument("--step-reps", type=int, default=7)
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error(f"--world must be >= 2 (ranks of every job, one GPU each); got {args.world}")
    if torch.cuda.device_count() < args.world:
        parser.error(
            f"--world {args.world} needs {args.world} CUDA GPUs (NCCL, one per rank); "
            f"{torch.cuda.device_count()} visible"
        )
    parts = set(args.parts.split(","))
    # Plain buffers of a captured graph must run the kernels plain eager calls run.
    os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
    result = dict(
        **provenance("benchmarks/symm_mem.py", argv),
        nvls=os.environ.get("NCCL_NVLS_ENABLE"),
        graph_register=os.environ.get("NCCL_GRAPH_REGISTER"),
        world=args.world,
        args=vars(args),
    )
    bands = None
    if "collectives" in parts:
        value = _job(
            result,
            "collectives_part",
            collectives_rank,
            (args.quick, args.reps, not args.eager),
            590,
            args.out,
            args.world,
        )
        if "error" not in value:
            result.pop("collectives_part")
            result.update(value)
            # Steps use the bands as the config ships them: the bf16 band for
            # every dtype but float32, which gets its own.
            per_dtype = value["recommended_bands_per_dtype"]
            bands = (per_dtype["bf16"], per_dtype["fp32"])
            _log_summary(value, args.world)
    result["step_bands"] = bands
    if "fsdp" in parts:
        for width, layers in [(2048, 8)] if args.quick else [(2048, 8), (4096, 4), (8192, 2)]:
            _job(
                result,
                f"fsdp/w{width}xL{layers}",
                fsdp_rank,
                (width, layers, 4, args.steps, args.step_reps, bands),
                300,
                args.out,
                args.world,
            )
    if "ddp" in parts:
        for distopt in (False, True):
            _job(
                result,
                f"ddp/{'distopt' if distopt else 'allreduce'}",
                ddp_rank,
                (1024, 4, 4, distopt, args.steps, args.step_reps, bands),
                300,
                args.out,
                args.world,
            )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({args.world} ranks; {sum(result.get('wall_s', {}).values()):.0f} s in jobs)")


def _log_summary(value, world):
    print(f"recommended bands (MiB) at {world} ranks:", _mib_bands(value["recommended_bands"]), flush=True)
    for d, b in value["recommended_bands_per_dtype"].items():
        print(f"  {d} only:", _mib_bands(b), flush=True)
    print(
        f"policy worst vs plain (graph-timed): {value['policy_worst_vs_plain']:.4f}x time; "
        f"symk exactly where the policy chose symmetric: {value['policy_symk_matches_decision']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
