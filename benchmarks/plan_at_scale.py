"""A rank's first-refit plan as the job grows: ours against megatron-core's ``swap_model_weights`` planner, on CPU.

A reshard refit plans before its first transfer. Ours (``build_reshard_plan(src, dst, rank=r)``) cuts only the
tensors rank ``r`` holds or keeps, so its cost follows the rank's share of the model. megatron-core's
(``megatron/core/resharding/planner.py``: ``build_local_reshard_plan``) all-gathers every rank's parameter
metadata (``all_gather_object``), then every rank replays the whole job's schedule
(``build_plan_from_rosters``) and keeps its own ops, so its cost follows the job.

This times both for the same jobs at growing world sizes, without GPUs or a process group: megatron-core's
metadata is built for every rank from the same layouts ours plans (the Megatron local tensors of
:func:`~megatron_ext.sharding.megatron.megatron_layout` and
:func:`~megatron_ext.weight_export.megatron_refit.megatron_engine_layout`: their shapes, TP dimension and
TP / DP / PP groups in Megatron's ``tp-dp-pp`` rank order, as ``extract_param_metadata`` reads them from a
model), then pickled and unpickled as the all-gather does, then indexed and planned for one rank of each side.
Ours plans on layouts built just before each timed plan, so it indexes them as a job's first refit does. Not
timed: the all-gather's transfer, building megatron-core's metadata from a model or our layouts, and executing
either plan.

    python benchmarks/plan_at_scale.py --worlds 8,32,128,512 --out plan_at_scale.json

The job: trainer Megatron TP ``--trainer-tp`` x PP ``--trainer-pp`` x DP (the rest) on ranks ``0..N-1``, engine
Megatron TP ``--engine-tp`` x DP on the same ranks (colocated) or on ranks ``N..2N-1`` (``--separate``). The
model: Qwen3-4B's shapes (``--model``). Prints a table (ms per rank plan) and writes the JSON (machine, date,
command).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import provenance  # noqa: E402

MODELS = {"qwen3-4b": "QWEN3_4B"}


def _groups(world: int, tp: int, dp: int, offset: int) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """Each rank's ``(tp group, dp group, pp group)`` (global ranks), Megatron's ``tp-dp-pp`` order."""
    out = {}
    for i in range(world):
        tp_r, dp_r, pp_r = i % tp, i // tp % dp, i // (tp * dp)
        tp_g = [offset + tp * (dp_r + dp * pp_r) + t for t in range(tp)]
        dp_g = [offset + tp_r + tp * (d + dp * pp_r) for d in range(dp)]
        pp_g = [offset + tp_r + tp * (dp_r + dp * p) for p in range(world // (tp * dp))]
        out[offset + i] = (tp_g, dp_g, pp_g)
    return out


def _metadata(layout, full: dict, groups: dict, rank: int, cache: dict) -> list:
    """megatron-core's ``ParameterMetadata`` of ``rank``'s local tensors in ``layout`` (``full``: each name's
    unsharded shape, whence the TP dimension), rank lists shared as ``extract_param_metadata`` shares them."""
    from megatron.core.resharding.utils import ParameterMetadata

    def shared(ranks):
        return cache.setdefault(tuple(ranks), list(ranks))

    tp_g, dp_g, pp_g = (shared(g) for g in groups[rank])
    out = []
    for name, lt in layout.tensors.get(rank, {}).items():
        dims = [d for d, (a, b) in enumerate(zip(lt.shape, full[name])) if a != b]
        out.append(
            ParameterMetadata(
                name=name,
                shape=tuple(lt.shape),
                dtype=lt.dtype,
                element_size=lt.dtype.itemsize,
                is_tp=bool(dims),
                partition_dim=dims[0] if dims else 0,
                owner_rank=rank,
                tensor_parallel_group_ranks=tp_g,
                data_parallel_group_ranks=dp_g,
                pipeline_parallel_group_ranks=pp_g,
                resolved_name=name,
            )
        )
    return out


def _received_bytes(plan, metadata: list) -> int:
    """Bytes megatron-core's ``plan`` receives (its receive ops' slices of the rank's own tensors)."""
    shapes = {m.name: (m.shape, m.element_size) for m in metadata}
    total = 0
    for op in plan.recv_ops:
        shape, size = shapes[op.param_name]
        n = size
        for sl, dim in zip(op.my_slice, shape):
            n *= len(range(*sl.indices(dim)))
        total += n
    return total


def _median_s(fn, repeats: int, prepare=tuple) -> tuple[float, object]:
    """The median seconds of ``repeats`` calls ``fn(*prepare())`` (``prepare`` not timed) and the last result."""
    times, got = [], None
    for _ in range(repeats):
        args = prepare()
        start = time.perf_counter()
        got = fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), got


def measure(world: int, *, model: str, trainer_tp: int, trainer_pp: int, engine_tp: int, separate: bool, repeats: int):
    """One job of ``world`` trainer ranks: each side's first rank, both planners (seconds)."""
    from megatron.core.resharding.planner import build_plan_from_rosters, index_metadata_rosters

    from megatron_ext.sharding import megatron_layout
    from megatron_ext.sharding.spec import gpt_specs
    from megatron_ext.weight_export.megatron_refit import megatron_engine_layout, megatron_engine_specs
    from megatron_ext.weight_export.plan import simulate
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    specs = gpt_specs(**getattr(simulate, MODELS[model]))
    trainer_dp = world // (trainer_tp * trainer_pp)
    engine_dp = world // engine_tp
    first = world if separate else 0

    def layouts():
        return (
            megatron_layout(megatron_engine_specs(specs), tp=trainer_tp, pp=trainer_pp, dp=trainer_dp),
            megatron_engine_layout(specs, tp=engine_tp, dp=engine_dp, ranks=range(first, first + world)),
        )

    src, dst = layouts()
    full = {n: lt.shape for n, lt in megatron_layout(megatron_engine_specs(specs)).tensors[0].items()}
    ranks = sorted({*src.ranks, *dst.ranks})
    src_groups = _groups(world, trainer_tp, trainer_dp, 0)
    dst_groups = _groups(world, engine_tp, engine_dp, first)
    cache: dict = {}
    start = time.perf_counter()
    gathered = [
        (
            _metadata(src, full, src_groups, r, cache) if r in src_groups else [],
            _metadata(dst, full, dst_groups, r, cache) if r in dst_groups else [],
        )
        for r in ranks
    ]
    build_s = time.perf_counter() - start
    # what all_gather_object does on every rank: pickle its own, unpickle everyone's
    sent = [pickle.dumps(pair) for pair in gathered]
    unpickle_s, received = _median_s(lambda: [pickle.loads(b) for b in sent], repeats)
    index_s, rosters = _median_s(lambda: index_metadata_rosters(received), repeats)
    rows = []
    for side, r in (("trainer", src.ranks[0]), ("engine", dst.ranks[0])):
        if side == "engine" and not separate:
            r = dst.ranks[-1]  # colocated: the last rank (the first is the trainer's)
        # on layouts built just before (not timed), so the plan indexes them as a job's first refit does (a
        # layout keeps its index of holdings once built)
        ours_s, plan = _median_s(lambda s, d: build_reshard_plan(s, d, rank=r), repeats, layouts)
        mcore_s, mplan = _median_s(lambda: build_plan_from_rosters(*rosters, r), repeats)
        # the two plans deliver the same bytes to this rank (its local copies included): the same job
        ours_in = sum(t.nbytes for t in plan.transfers if t.dst == r)
        mcore_in = _received_bytes(mplan, gathered[ranks.index(r)][1])
        if ours_in != mcore_in:
            raise SystemExit(f"rank {r}: our plan delivers {ours_in} bytes, megatron-core's {mcore_in}: not one job")
        rows.append(
            dict(
                side=side,
                rank=r,
                ours_plan_s=ours_s,
                ours_transfers=len(plan.transfers),
                mcore_plan_s=mcore_s,
                mcore_gather_unpickle_s=unpickle_s,
                mcore_index_s=index_s,
                mcore_total_s=mcore_s + unpickle_s + index_s,
                mcore_ops=len(mplan.send_ops) + len(mplan.recv_ops),
                received_bytes=ours_in,
            )
        )
    return dict(
        world=world,
        ranks=len(ranks),
        trainer=src.description,
        engine=dst.description,
        colocated=not separate,
        gathered_bytes=sum(len(b) for b in sent),
        metadata_build_s=build_s,
        rows=rows,
    )


def _table(results: list[dict]) -> str:
    head = (
        f"{'ranks':>6} {'side':<8} {'rank':>5} {'ours ms':>9} {'transfers':>9} {'mcore ms':>9} "
        f"{'(plan':>8} {'unpickle':>9} {'index)':>8} {'mcore ops':>9} {'gathered MB':>11}"
    )
    lines = [head, "-" * len(head)]
    for res in results:
        for row in res["rows"]:
            lines.append(
                f"{res['ranks']:>6} {row['side']:<8} {row['rank']:>5} {row['ours_plan_s'] * 1e3:>9.1f} "
                f"{row['ours_transfers']:>9} {row['mcore_total_s'] * 1e3:>9.1f} {row['mcore_plan_s'] * 1e3:>8.1f} "
                f"{row['mcore_gather_unpickle_s'] * 1e3:>9.1f} {row['mcore_index_s'] * 1e3:>8.1f} "
                f"{row['mcore_ops']:>9} {res['gathered_bytes'] / 1e6:>11.1f}"
            )
    return "\n".join(lines)


def _worlds(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--worlds takes comma-separated integers, got {text!r}") from None
    if not worlds or any(w < 1 for w in worlds):
        raise argparse.ArgumentTypeError(f"--worlds takes positive integers, got {text!r}")
    return worlds


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=_worlds, default=[8, 32, 128], help="trainer ranks per job (default 8,32,128)")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-4b")
    p.add_argument("--trainer-tp", type=int, default=2)
    p.add_argument("--trainer-pp", type=int, default=2)
    p.add_argument("--engine-tp", type=int, default=1)
    p.add_argument("--separate", action="store_true", help="the engine on its own ranks (default: colocated)")
    p.add_argument("--repeats", type=int, default=3, help="median of this many runs of each timed step")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    for w in a.worlds:
        if w % (a.trainer_tp * a.trainer_pp) or w % a.engine_tp:
            p.error(f"--worlds: {w} is not a multiple of trainer TP x PP ({a.trainer_tp * a.trainer_pp}) and engine TP")
    results = []
    for w in a.worlds:
        print(f"planning a job of {w} trainer ranks ...", flush=True)
        results.append(
            measure(
                w,
                model=a.model,
                trainer_tp=a.trainer_tp,
                trainer_pp=a.trainer_pp,
                engine_tp=a.engine_tp,
                separate=a.separate,
                repeats=a.repeats,
            )
        )
    print(_table(results))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(provenance("benchmarks/plan_at_scale.py", argv), results=results), f, indent=1)
        print(f"wrote {a.out}")
    return results


if __name__ == "__main__":
    main()
