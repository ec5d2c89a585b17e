"""The reshard refit's memory budget on one process (no job spawned: each rank's executor is built and
allocates its staging, nothing moves): every rank's device staging, as allocated, is what the planner
counted and at most the budget, for ranks with 2, 3 and 7 peers, streaming and atomic staged on the host;
an atomic receiver that keeps the version on the device and does not fit is refused by name (under the
auto budget it keeps it on top); a budget
below one row per slot is refused naming the tensor and the least budget, which is accepted. The bytes
that move under a budget are checked exactly in the spawned job of ``test_reshard_refit``."""

import re

import pytest
import torch

from megatron_ext.weight_export import ReshardExecutor, build_reshard_plan, gpt_specs, inference_layout, megatron_layout
from megatron_ext.weight_export.plan.budget import plan_staging

from ._reference import SPECS

MIB = 1 << 20
BUDGET = 32 << 10  # 32 KiB: under the unbudgeted staging of every layout below
BUCKET = 16 << 10

# name: (trainer kwargs, engine kwargs); peers of the busiest rank in brackets
LAYOUTS = {
    "tp1_to_dp2 [2]": (dict(tp=1, ranks=[0]), dict(tp=1, dp=2, ranks=[1, 2])),
    "tp2_to_dp3 [3]": (dict(tp=2, ranks=[0, 1]), dict(tp=1, dp=3, ranks=[2, 3, 4])),
    "tp1_to_dp7 [7]": (dict(tp=1, ranks=[0]), dict(tp=1, dp=7, ranks=list(range(1, 8)))),
}


def _plan(name):
    specs = gpt_specs(**SPECS)
    mk, ek = LAYOUTS[name]
    return build_reshard_plan(megatron_layout(specs, **mk), inference_layout(specs, **ek))


def _tensors(plan, rank):
    out = {n: torch.randn(lt.shape) for n, lt in plan.src.tensors.get(rank, {}).items()}
    out.update({n: torch.zeros(lt.shape) for n, lt in plan.dst.tensors.get(rank, {}).items()})
    return out


def _executor(plan, rank, **kw):
    return ReshardExecutor(plan, rank, _tensors(plan, rank), bucket_bytes=BUCKET, **kw)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", [dict(atomic=False), dict(atomic=True, atomic_staging="host")])
def test_every_rank_stages_what_the_planner_counted_within_the_budget(name, mode):
    plan = _plan(name)
    ranks = sorted({*plan.src.ranks, *plan.dst.ranks})
    peers = {r: len({t.dst for t in plan.transfers if t.src == r} - {r}) for r in ranks}
    assert max(peers.values()) == int(name[-2]), peers
    busiest = max(ranks, key=lambda r: peers[r])
    unbudgeted = _executor(plan, busiest, **mode)
    unbudgeted._allocate()
    assert unbudgeted.staging_bytes > BUDGET, "the budget must bind for the test to mean anything"
    for r in ranks:
        ex = _executor(plan, r, memory_budget_bytes=BUDGET, **mode)
        assert ex.budget_problem is None
        ex._allocate()
        planned = ex.staging_plan
        assert ex.staging_bytes == planned.device_bytes.get(r, 0) <= BUDGET, r
        assert ex.staging_host_bytes == planned.host_bytes.get(r, 0), r
        if mode["atomic"] and ex.recv:  # the host holds every bucket this rank receives
            assert ex.staging_host_bytes == ex.received_bytes > 0
        # the planner counted what the allocator holds: one buffer per slot, each its largest bucket
        assert ex.staging_bytes == sum(b.numel() for b in ex.staging.bufs.values())
        # a pair's bucket is the same on both sides (each side cut it from the plan alone)
        for p in ex.send:
            theirs = plan_staging(
                plan.transfers, bucket_bytes=BUCKET, max_inflight=2, atomic=False, budget_bytes=BUDGET
            )
            assert ex.staging_plan.pair_bytes[(r, p)] == theirs.pair_bytes[(r, p)]


def test_an_atomic_receiver_on_the_device_that_does_not_fit_is_refused_by_name():
    plan = _plan("tp1_to_dp2 [2]")
    ex = _executor(plan, 1, memory_budget_bytes=BUDGET, atomic=True)  # an engine rank: its whole share
    assert ex.budget_problem is not None and ex.budget_problem.reason == "staging"
    msg = str(ex.budget_problem)
    assert "--refit-memory-budget-mb 0.03125 MiB cannot hold rank 1's staging" in msg, msg
    assert "--refit-atomic-staging host" in msg and "--no-refit-atomic" in msg, msg
    # the trainer rank sends only: its slots fit the same budget
    assert _executor(plan, 0, memory_budget_bytes=BUDGET, atomic=True).budget_problem is None
    # host staging fits
    assert _executor(plan, 1, memory_budget_bytes=BUDGET, atomic=True, atomic_staging="host").budget_problem is None
    # the auto budget (not strict) cuts the same buckets but keeps the atomic version on the device on top
    auto = _executor(plan, 1, memory_budget_bytes=BUDGET, memory_budget_strict=False, atomic=True)
    streaming = _executor(plan, 1, memory_budget_bytes=BUDGET, atomic=False)
    assert auto.budget_problem is None and auto.staging_plan.pair_bytes == streaming.staging_plan.pair_bytes
    assert auto.staging_plan.device_bytes[1] > BUDGET >= streaming.staging_plan.device_bytes[1]
    assert "(auto: an atomic receiver's version on the device comes on top)" in auto.staging_plan.line(1)
    assert auto.wire_id == streaming.wire_id  # both jobs agree whatever each one's atomic mode


def test_a_budget_below_one_row_per_slot_is_refused_naming_the_tensor_and_the_least_budget():
    plan = _plan("tp1_to_dp7 [7]")
    ex = _executor(plan, 0, memory_budget_bytes=4096, atomic=False)
    msg = str(ex.budget_problem)
    # the widest row: down_proj's (ffn 48 floats = 192 bytes, 256 aligned); rank 0 stages 2 buckets x 7 peers
    assert "cannot stage model.layers.0.mlp.down_proj.weight: a bucket of rank 0 -> 1 must hold one row" in msg, msg
    least = int(re.search(r"at least (\d+) bytes", msg).group(1))
    assert least == (256 + 256) * 2 * 7, msg  # header + one aligned row, per slot
    # the least budget works, one byte less does not (every rank computes the same from the plan)
    assert _executor(plan, 0, memory_budget_bytes=least, atomic=False).budget_problem is None
    assert _executor(plan, 3, memory_budget_bytes=least - 1, atomic=False).budget_problem is not None
    # and the refit refuses it on every rank before anything is allocated or sent
    with pytest.raises(Exception) as err:
        ex.refit(1)
    assert getattr(err.value, "reason", None) == "staging" and ex.staging is None, err.value


def test_the_plan_line_says_what_was_chosen():
    plan = _plan("tp2_to_dp3 [3]")
    ex = _executor(plan, 0, memory_budget_bytes=BUDGET, atomic=False)
    line = ex.staging_plan.line(0)
    assert line.startswith(f"staging {ex.staging_plan.device_bytes[0] / MIB:.1f} MiB on the device"), line
    assert "budget 0.0 MiB; bucket MiB per pair:" in line, line
