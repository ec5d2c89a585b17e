"""Pairs in phases (plan/budget.py): an 8-rank gloo job whose memory budget splits over many peers, so that
every round carries the pairs of one phase and a rank's staging lanes are shared by the peers of other
phases. Each rank plans its own transfers; every transfer a receiver holds afterwards equals its source's
bytes exactly, over two versions (the buffers reused), streaming at 1, 2 and 3 rounds in flight, atomic
staged on the host and on the device (the auto budget: the version on top), and streaming with zero-copy runs;
every rank's staging is what the planner counted and within the budget (but an atomic receiver's version),
and the busiest rank's buckets are at least twice those of one phase."""

import torch

from megatron_ext.testing.multirank import run_on_ranks
from megatron_ext.weight_export import ReshardExecutor, build_reshard_plan, gpt_specs, inference_layout, megatron_layout
from megatron_ext.weight_export.plan.reshard_plan import run_view

from ._reference import SPECS

BUCKET = 16 << 10
BUDGET = 24 << 10  # far below MIN_OP_BYTES: the pairs go in phases
# name: (trainer kwargs, engine kwargs): a trainer rank with 7 peers (one phase each), and 4 x 4 ranks, each with 4
LAYOUTS = {
    "tp1 -> 7 replicas": (dict(tp=1, ranks=[0]), dict(tp=1, dp=7, ranks=list(range(1, 8)))),
    "tp4 -> tp1 x dp4": (dict(tp=4, ranks=[0, 1, 2, 3]), dict(tp=1, dp=4, ranks=[4, 5, 6, 7])),
}
MODES = {
    "streaming m1": dict(atomic=False, max_inflight=1),
    "streaming m2": dict(atomic=False, max_inflight=2),
    "streaming m3": dict(atomic=False, max_inflight=3),
    "atomic host": dict(atomic=True, atomic_staging="host"),
    "atomic auto": dict(atomic=True, memory_budget_strict=False),  # the version on the device, on top
    "zero-copy": dict(atomic=False, zero_copy_bytes=512),
    # a low target: 2-4 phases, so a rank's peers of one phase share a round, each in its own lane
    "lanes": dict(atomic=False, min_op_bytes=4096),
}


def _source(plan, rank: int, version: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s trainer tensors at ``version``: the same on every rank that asks (seeded)."""
    out = {}
    for i, (name, lt) in enumerate(sorted(plan.src.tensors.get(rank, {}).items())):
        gen = torch.Generator().manual_seed(version * 100_003 + rank * 1009 + i)
        out[name] = torch.randn(lt.shape, generator=gen)
    return out


def _body():
    rank = torch.distributed.get_rank()
    specs = gpt_specs(**(SPECS | {"num_groups": 4}))  # TP4 needs 4 query groups
    out = {}
    for name, (mk, ek) in LAYOUTS.items():
        src, dst = megatron_layout(specs, **mk), inference_layout(specs, **ek)
        plan = build_reshard_plan(src, dst, rank=rank)
        sources = {r: {v: _source(plan, r, v) for v in (1, 2)} for r in src.ranks}
        for mode, kw in MODES.items():
            for phased in (True, False):
                tensors = {n: t.clone() for n, t in sources.get(rank, {}).get(1, {}).items()}
                tensors.update({n: torch.zeros(lt.shape) for n, lt in dst.tensors.get(rank, {}).items()})
                one = {} if phased else {"min_op_bytes": None}
                ex = ReshardExecutor(plan, rank, tensors, bucket_bytes=BUCKET, memory_budget_bytes=BUDGET, **(kw | one))
                wrong = []
                for version in (1, 2):
                    for n, t in sources.get(rank, {}).get(version, {}).items():
                        tensors[n].copy_(t)  # in place: the executor keeps views
                    ex.refit(version)
                    for t in ex.transfers:
                        if t.dst != rank:
                            continue
                        want = run_view(sources[t.src][version][t.src_run.local], t.src_run).reshape(-1)
                        got = run_view(tensors[t.dst_run.local], t.dst_run).reshape(-1)  # the box, row-major
                        if not torch.equal(got, want):
                            wrong.append((version, t.name, t.src))
                out[(name, mode, phased)] = dict(
                    phases=ex.phases,
                    bucket=min(ex.staging_plan.pair_bytes.values()),
                    staging=ex.staging_bytes,
                    planned=ex.staging_plan.device_bytes.get(rank, 0),
                    allocated=sum(b.numel() for b in ex.staging.bufs.values()),
                    wrong=wrong,
                    peers=len({*ex.send, *ex.recv}),
                    lanes=max(ex._lanes.values(), default=-1) + 1,
                )
    return out


def test_pairs_in_phases_move_every_byte_exactly_within_the_budget():
    results = run_on_ranks(_body, 8, backend="gloo", timeout=300)
    dst_ranks = {name: set(ek["ranks"]) for name, (_, ek) in LAYOUTS.items()}
    for name in LAYOUTS:
        for mode in MODES:
            for r, res in enumerate(results):
                got, one = res[(name, mode, True)], res[(name, mode, False)]
                assert not got["wrong"] and not one["wrong"], (name, mode, r, got["wrong"][:3], one["wrong"][:3])
                assert got["staging"] == got["planned"] == got["allocated"], (name, mode, r, got)
                assert got["staging"] <= BUDGET or (mode == "atomic auto" and r in dst_ranks[name]), (name, r, got)
                assert one["phases"] == 1 and got["phases"] > 1, (name, mode, r, got["phases"])
            if mode == "lanes":  # several peers in one round: two or more lanes on the busiest rank of each side
                assert max(res[(name, mode, True)]["lanes"] for res in results) >= 2, name
                continue
            busiest = max(range(8), key=lambda r: results[r][(name, mode, True)]["peers"])
            got, one = results[busiest][(name, mode, True)], results[busiest][(name, mode, False)]
            assert got["peers"] >= 4 and got["bucket"] >= 2 * one["bucket"], (name, mode, got, one)
