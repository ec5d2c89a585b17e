"""Experimental Megatron-FSDP with symmetric staging of both sides of each
all-gather and reduce-scatter.

CPU (gloo): falls back to plain buffers, trains exactly like upstream's plain
FSDP, warns once. 2 GPUs (NCCL): losses equal upstream plain FSDP; the profiler
shows ``ncclSymk`` kernels for exactly the collectives of the groups the policy
put on symmetric memory; no new window registrations after the first step.
"""

import pytest

from megatron_ext.testing.multirank import run_on_ranks

from ._bodies import _count, assert_losses_equal, fsdp_parity

STEPS = 4
KIB = 1 << 10


def test_gloo_fallback_trains_like_upstream_and_warns_once():
    out = run_on_ranks(fsdp_parity, 2, args=(2, STEPS, "on", 128 * KIB), backend="gloo", timeout=240)
    assert_losses_equal(out, 0.0)
    for r in out:
        assert len(r["warnings"]) == 1 and "gloo" in r["warnings"][0], r["warnings"]
        for ag, rs in r["decisions"]:
            assert not ag.symmetric and not rs.symmetric and "gloo" in ag.reason
        assert r["windows"] == (0, 0)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("microbatches", [1, 3])
def test_nccl_symmetric_groups_run_symk_kernels_and_match_upstream(microbatches):
    out = run_on_ranks(fsdp_parity, 2, args=(microbatches, STEPS, "auto", 128 * KIB), backend="nccl", timeout=300)
    assert_losses_equal(out, 1e-5)
    for r in out:
        ag = [a for a, _ in r["decisions"]]
        rs = [b for _, b in r["decisions"]]
        assert any(d.symmetric for d in ag) and not all(d.symmetric for d in ag), r["decisions"]
        names = r["kernels"]
        total, symk = _count(names, "AllGather")
        assert total == 2 * microbatches * len(ag), names
        assert symk == 2 * microbatches * sum(d.symmetric for d in ag), names
        total, symk = _count(names, "ReduceScatter")
        assert total == microbatches * len(rs), names
        assert symk == microbatches * sum(d.symmetric for d in rs), names
        first, last = r["windows"]
        assert first > 0 and first == last, "windows must be registered once, not per step"
        assert not r["warnings"]


@pytest.mark.parametrize("microbatches", [1, 3])
def test_gloo_symmetric_code_paths_train_like_upstream(microbatches):
    # Plain allocations stand in for the pool: exercises the staged unshard,
    # the SUM reduce-scatter + divide (AVG), and the accumulation scratch.
    from ._bodies import fsdp_standin_parity

    out = run_on_ranks(fsdp_standin_parity, 2, args=(microbatches, STEPS, 128 * KIB), backend="gloo", timeout=240)
    assert_losses_equal(out, 1e-6)
    for r in out:
        flags = [a.symmetric for a, _ in r["decisions"]]
        assert any(flags) and not all(flags), r["decisions"]
        # The accumulation scratch exists exactly where a symmetric RS accumulated.
        expect = [rs.symmetric and microbatches > 1 for _, rs in r["decisions"]]
        assert r["scratch"] == expect
        # release_symmetric_memory frees every pool buffer of the groups.
        total, freed, after = r["release"]
        assert total > 0 and freed == total and not any(after)
