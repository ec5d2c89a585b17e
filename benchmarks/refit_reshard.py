"""Reshard refit vs gather-then-broadcast, same model and layouts, plus the simulator.

    # GPU machine with 2N GPUs: Megatron TP N on GPUs 0..N-1 -> engine TP N on N..2N-1
    python benchmarks/refit.py --reshard --preset 3b --out refit_reshard.json
    # colocated: Megatron TP 2N on every GPU -> engine TP1 x DP 2N on the same GPUs
    python benchmarks/refit.py --reshard --preset 3b --layout colocated --out refit_reshard_colocated.json
    # CPU smoke test (gloo)
    python benchmarks/refit_reshard.py --preset tiny --device cpu --world 4 --out /tmp/rr.json

Measured in one job of ``--world`` ranks. ``--layout cross``: the trainer is
Megatron TP ``world/2`` (its data-parallel replica 0 on ranks
``0..world/2-1`` is the source), the engine TP ``world/2`` on the other half.
``--layout colocated``: the trainer is Megatron TP ``world`` and the engine
``world`` TP1 replicas on the same ranks; each engine rank already holds its
trainer shard and needs the rest. Rows:

- limit: point-to-point bandwidth per GPU (``batch_isend_irecv``,
  ``--limit-gib`` payload): every trainer rank sends to one engine rank at
  once (cross), or every rank sends to the next and receives from the previous
  at once (colocated);
- reshard: :class:`~megatron_ext.weight_export.exec.reshard.ReshardExecutor`, each
  engine rank receives only its shards, straight from the owning trainer ranks
  (one row per ``--sweep`` setting: bucket size, rounds in flight, atomic or
  streaming);
- gather-then-broadcast: the export hook gathers full HF tensors to rank 0,
  which broadcasts them to the engine ranks; each keeps its shards.

Seconds per refit (median of ``--iters``, slowest rank); GB/s per GPU: the
bytes the busiest engine rank must receive over a link (what it keeps and does
not already hold) / seconds; fraction of the limit; and whether both methods
give the engine the same bytes. Then the simulator's predictions for large
configs.
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

from benchmarks.common import provenance, slowest, sync  # noqa: E402

from megatron_ext.testing import tiny_llama  # noqa: E402
from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402

GiB = 1 << 30


def _timed(fn, iters, device):
    import torch.distributed as dist

    fn()  # warm-up: buffers allocated, plans built
    times = []
    for _ in range(iters):
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(slowest(time.perf_counter() - start, device))
    return statistics.median(times)


def _link_bytes(plan, rank: int) -> int:
    """Bytes ``rank`` receives from other ranks under ``plan``."""
    return sum(t.nbytes for t in plan.transfers if t.dst == rank and t.src != rank)


def _rank(spec, iters, limit_bytes, bucket_bytes, settings, layout="cross"):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from megatron_ext import weight_export as wx
    from megatron_ext.sharding import megatron_layout, specs_from_config
    from megatron_ext.weight_export.plan.layout import inference_layout
    from megatron_ext.weight_export.exec.reshard import ReshardExecutor, megatron_tensors
    from megatron_ext import copy_check
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan
    from benchmarks.common import megatron_config as _mconfig

    world, rank = dist.get_world_size(), dist.get_rank()
    tp = world // 2 if layout == "cross" else world
    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = _mconfig(spec, gpu)
    model = Float16Module(config, tiny_llama.build_model(spec, config, device=device))
    specs = specs_from_config(
        config,
        vocab_size=spec.hf_vocab_size,
        padded_vocab_size=spec.vocab_size,
        tie_embeddings=spec.tie_embeddings,
        dtype=torch.bfloat16,
    )
    src = megatron_layout(specs, tp=tp, ranks=range(tp))
    if layout == "cross":
        dst = inference_layout(specs, tp=tp, ranks=range(tp, world))
    else:
        dst = inference_layout(specs, tp=1, dp=world, ranks=range(world))
    t0 = time.perf_counter()
    plan = build_reshard_plan(src, dst)
    plan_s = time.perf_counter() - t0
    engine = {n: torch.zeros(lt.shape, dtype=lt.dtype, device=device) for n, lt in dst.tensors.get(rank, {}).items()}
    held = dst.bytes_held(rank) if rank in dst.ranks else 0
    out = dict(
        plan_s=plan_s,
        held_bytes=held,
        link_bytes=_link_bytes(plan, rank),
        transfers=len(plan.transfers),
        plan=plan if rank == 0 else None,
    )

    # limit: cross: every trainer rank i sends to engine rank tp + i; colocated: every rank sends to
    # the next and receives from the previous; all at once
    buf = torch.empty(limit_bytes, dtype=torch.uint8, device=device)
    if layout == "cross":
        peer = rank + tp if rank < tp else rank - tp
        ops = [(dist.isend if rank < tp else dist.irecv, buf, peer)]
    else:
        rbuf = torch.empty_like(buf)
        ops = [(dist.isend, buf, (rank + 1) % world), (dist.irecv, rbuf, (rank - 1) % world)]

    def p2p():
        for req in dist.batch_isend_irecv([dist.P2POp(op, b, p) for op, b, p in ops]):  # noqa: F821 (del after)
            req.wait()

    out["limit_gbps"] = limit_bytes / _timed(p2p, 3, device) / 1e9
    del buf, ops
    rbuf = None

    # reshard refit, once per setting (bucket bytes, rounds in flight, atomic)
    tensors = dict(megatron_tensors(model)) if rank in src.ranks else {}
    tensors.update(engine)
    version = iter(range(1, 10**6))
    out["reshard"] = []
    reshard_result = None
    for bucket, inflight, atomic in settings:
        for t in engine.values():
            t.zero_()
        ex = ReshardExecutor(plan, rank, tensors, bucket_bytes=bucket, max_inflight=inflight, atomic=atomic)
        # the steady state: the checked-copy kernel compiled (it compiles in the background from here on, and
        # refits check by a second read until it has)
        copy_check.prewarm(device, {t.dtype for t in tensors.values()}, wait=True)
        seconds = _timed(lambda: ex.refit(next(version)), iters, device)  # noqa: F821 (called here, ex bound)
        got = {n: t.clone() for n, t in engine.items()}
        same = reshard_result is None or all(torch.equal(reshard_result[n], got[n]) for n in engine)
        reshard_result = reshard_result or got
        out["reshard"].append(
            dict(
                bucket_bytes=bucket,
                max_inflight=inflight,
                atomic=atomic,
                seconds=seconds,
                rounds=ex.rounds,
                staging_bytes=ex.staging_bytes,
                same_bytes=same,
            )
        )
        del ex, got
        if gpu:
            torch.cuda.empty_cache()

    # gather-then-broadcast: full HF tensors gathered to rank 0, broadcast to the engine ranks
    offsets, total = {}, 0
    for s in specs:
        offsets[s.name] = (total, s.nbytes)
        total += (s.nbytes + 255) // 256 * 256
    bcast_ranks = sorted({0, *dst.ranks})
    group = dist.new_group(bcast_ranks)
    flat = torch.empty(total, dtype=torch.uint8, device=device) if rank in bcast_ranks else None

    def load(weights):
        for name, t in weights:
            off, n = offsets[name]
            flat[off : off + n].view(t.dtype).view(t.shape).copy_(t)

    receiver = wx.WeightReceiver(wx.LoadWeightsConsumer(load)) if rank == 0 else None
    exporter = wx.WeightExporter(
        model,
        wx.RefitConfig(vocab_size=spec.hf_vocab_size, bucket_size_mb=bucket_bytes / (1 << 20)),
        receiver=receiver,
    )
    spec_by = {s.name: s for s in specs}

    def gather_broadcast():
        exporter.export()
        if flat is None:
            return
        for start in range(0, total, bucket_bytes):
            dist.broadcast(flat[start : start + bucket_bytes], 0, group=group)
        for name, lt in dst.tensors.get(rank, {}).items():
            parts = []
            for seg in lt.segments:
                off, n = offsets[seg.name]
                full = flat[off : off + n].view(spec_by[seg.name].dtype).view(spec_by[seg.name].shape)
                parts.append(full[tuple(slice(a, b) for a, b in seg.box.ranges)])
            torch.cat(parts, out=engine[name])

    out["gather_broadcast_s"] = _timed(gather_broadcast, iters, device)
    out["same_bytes"] = all(torch.equal(reshard_result[n], engine[n]) for n in engine) and all(
        r["same_bytes"] for r in out["reshard"]
    )
    return out


def _settings(sweep: str | None, bucket_mb: float, max_inflight: int, streaming: bool):
    """``(bucket bytes, rounds in flight, atomic)`` per reshard row: ``--sweep`` entries
    ``MiB:inflight:atomic|stream`` (comma-separated), else the single setting of the flags."""
    if not sweep:
        return [(int(bucket_mb * (1 << 20)), max_inflight, not streaming)]
    out = []
    for item in sweep.split(","):
        try:
            mb, m, mode = item.split(":")
            if mode not in ("atomic", "stream"):
                raise ValueError
            out.append((int(float(mb) * (1 << 20)), int(m), mode == "atomic"))
        except ValueError:
            raise SystemExit(
                f"--sweep: bad entry {item!r}; expected MiB:inflight:atomic|stream, e.g. 256:2:atomic,256:2:stream"
            ) from None
    return out


def main(argv=None) -> int:
    from benchmarks.common import PRESETS, spec_for

    from megatron_ext.weight_export.plan import simulate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="3b")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--world", type=int, default=0, help="ranks (even); default: all GPUs, 4 on CPU")
    p.add_argument("--bucket-size-mb", type=float, default=256)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--max-inflight", type=int, default=2, help="reshard rounds in flight (ReshardExecutor)")
    p.add_argument("--streaming", action="store_true", help="reshard with atomic=False (each round written on arrival)")
    p.add_argument(
        "--sweep",
        default=None,
        help="several reshard settings in one job: MiB:inflight:atomic|stream,... "
        "(overrides --bucket-size-mb/--max-inflight/--streaming for the reshard rows)",
    )
    p.add_argument(
        "--layout",
        choices=["cross", "colocated"],
        default="cross",
        help="cross: Megatron TP N -> engine TP N on the other N GPUs; colocated: Megatron TP 2N -> "
        "engine TP1 x DP 2N on the same GPUs",
    )
    p.add_argument("--limit-gib", type=float, default=1.0)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--no-simulate", action="store_true", help="skip the simulator's large configurations")
    p.add_argument("--out", default="refit_reshard.json")
    a = p.parse_args(argv)
    gpus = torch.cuda.device_count()
    gpu = a.device == "cuda" or (a.device == "auto" and gpus >= 2)
    world = a.world or (gpus if gpu else 4)
    if world < 2 or world % 2:
        p.error(f"--world must be even and >= 2, got {world}")
    if gpu and gpus < world:
        p.error(f"--world {world} needs {world} GPUs, found {gpus}")
    spec = spec_for(a.preset)
    settings = _settings(a.sweep, a.bucket_size_mb, a.max_inflight, a.streaming)
    layouts = (
        f"Megatron TP{world // 2} -> engine TP{world // 2} on the other GPUs"
        if a.layout == "cross"
        else f"Megatron TP{world} -> engine TP1 x DP{world} on the same GPUs"
    )
    print(
        f"reshard refit benchmark: preset {a.preset}, {world} ranks ({'nccl' if gpu else 'gloo'}), {layouts}, "
        f"{len(settings)} reshard setting(s)",
        flush=True,
    )
    res = run_on_ranks(
        _rank,
        world,
        args=(spec, a.iters, int(a.limit_gib * GiB), int(a.bucket_size_mb * (1 << 20)), settings, a.layout),
        backend="nccl" if gpu else "gloo",
        timeout=a.timeout_s,
    )
    engine = res[world // 2 :] if a.layout == "cross" else res
    held = max(r["held_bytes"] for r in engine)
    link = max(r["link_bytes"] for r in engine)  # the busiest engine rank's bytes over links
    limit = min(r["limit_gbps"] for r in res)
    rows = []

    def row(name, seconds, **extra):
        gbps = link / seconds / 1e9
        rows.append(dict(name=name, seconds=seconds, gbps_per_gpu=gbps, fraction_of_limit=gbps / limit, **extra))

    for i, setting in enumerate(res[0]["reshard"]):
        mode = "atomic" if setting["atomic"] else "stream"
        seconds = max(r["reshard"][i]["seconds"] for r in res)
        row(
            f"reshard {setting['bucket_bytes'] / (1 << 20):g}MiB m={setting['max_inflight']} {mode}",
            seconds,
            bucket_bytes=setting["bucket_bytes"],
            max_inflight=setting["max_inflight"],
            atomic=setting["atomic"],
            rounds=setting["rounds"],
            staging_bytes=max(r["reshard"][i]["staging_bytes"] for r in res),
        )
    row("gather-then-broadcast", res[0]["gather_broadcast_s"])
    # the simulator on this very plan, with the link speed measured above (all ranks on one "node")
    links = simulate.Links(
        nvlink_gbps=limit, nic_gbps=limit, gpus_per_node=world, bucket_bytes=int(a.bucket_size_mb * (1 << 20))
    )
    pred = simulate.predict(res[0].pop("plan"), links)
    for r in res:
        r.pop("plan", None)
    row("simulator, measured limit", pred.seconds, lower_bound_s=pred.lower_bound_s)
    head = f"{'method':34} {'seconds':>9} {'GB/s/GPU':>9} {'of limit':>8}"
    print(
        f"\nengine GPU keeps {held / 1e9:.3f} GB, receives {link / 1e9:.3f} GB over links; limit (p2p per GPU) "
        f"{limit:.2f} GB/s; same bytes: {all(r['same_bytes'] for r in engine)}"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['name']:34} {r['seconds']:9.4f} {r['gbps_per_gpu']:9.2f} {r['fraction_of_limit']:8.0%}")
    sim = []
    if not a.no_simulate:
        print("\nsimulator (H100: NVLink 450 GB/s, NIC 400 Gb/s per GPU, 8 GPUs per node):")
        for name in simulate.CONFIGS:
            sim.append(simulate.simulate_config(name))
        print(simulate.format_rows(sim))
    result = dict(
        **provenance("benchmarks/refit_reshard.py", argv),
        preset=a.preset,
        world=world,
        layout=a.layout,
        settings=settings,
        limit_gbps=limit,
        held_bytes=held,
        link_bytes=link,
        rows=rows,
        ranks=res,
        same_bytes=all(r["same_bytes"] for r in engine),
        simulated=sim,
    )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
