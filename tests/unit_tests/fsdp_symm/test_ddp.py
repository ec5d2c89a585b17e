"""Megatron DDP with symmetric-memory staging of its buckets.

CPU (gloo): the fallback trains exactly like plain DDP and warns once; the
staging layout itself (per-bucket segments, re-pointed views, AVG kept with a
SUM collective) is exercised with plain allocations standing in for the pool.
2 GPUs (NCCL): losses equal plain DDP, and the profiler shows an ``ncclSymk``
kernel for exactly the buckets the policy put on symmetric memory.
"""

import pytest

from megatron_ext.testing.multirank import run_on_ranks

from ._bodies import GRAD_OPS, _count, assert_losses_equal, ddp_parity

RTOL = 1e-5
STEPS = 4


def test_gloo_fallback_trains_like_plain_ddp_and_warns_once():
    out = run_on_ranks(ddp_parity, 2, args=(False, 1, STEPS, False, "symm", "on"),
                       backend="gloo", timeout=240)
    assert_losses_equal(out, 0.0)
    for r in out:
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "gloo" in r["warnings"][0] and "plain memory" in r["warnings"][0]
        assert r["decisions"] and not any(d.symmetric for _, d in r["decisions"])
        assert all("gloo" in d.reason for _, d in r["decisions"])
        assert r["layout"]["class"] == "_ParamAndGradBuffer"


@pytest.mark.parametrize("distopt,microbatches", [(False, 1), (True, 3)], ids=["allreduce-1mb", "distopt-3mb"])
def test_gloo_staging_layout_trains_like_plain_ddp(distopt, microbatches):
    # average_in_collective=True in the staged run: the symmetric buckets must
    # switch to SUM with a 1/dp pre-scale, which is what plain DDP does here.
    out = run_on_ranks(ddp_parity, 2, args=(distopt, microbatches, STEPS, True, "standin", "auto"),
                       backend="gloo", timeout=300)
    assert_losses_equal(out, 0.0)
    for r in out:
        flags = [d.symmetric for _, d in r["decisions"]]
        assert any(flags) and not all(flags), "the band should split the buckets"
        lay = r["layout"]
        assert lay["class"] == "SymmParamAndGradBuffer"
        assert len(lay["grad_segments"]) > 1 and lay["grad_data_is_none"]
        assert {s for *_, s in lay["grad_segments"]} == {True, False}
        off = r["offload"]  # Megatron's offload/restore walks the segments
        assert all(off["before"]) and not any(off["freed"]) and off["after"] == off["before"]
        assert off["zero"] and off["aliased"]
        # Groups with a symmetric bucket reduce with SUM (pre-scaled); others keep AVG.
        assert lay["groups"] and all(avg == (not symm) for avg, symm in lay["groups"])


@pytest.mark.gpus(2)
@pytest.mark.parametrize("distopt,microbatches", [(False, 1), (False, 3), (True, 1), (True, 3)])
def test_nccl_symmetric_buckets_run_symk_kernels_and_match_plain(distopt, microbatches):
    out = run_on_ranks(ddp_parity, 2, args=(distopt, microbatches, STEPS, True, "symm", "auto"),
                       backend="nccl", timeout=300)
    assert_losses_equal(out, RTOL)
    for r in out:
        decisions = r["decisions"]
        grad = [d for n, d in decisions if n.endswith("grads")]
        param = [d for n, d in decisions if n.endswith("params")]
        assert any(d.symmetric for d in grad) and not all(d.symmetric for d in grad), decisions
        op = "ReduceScatter" if distopt else "AllReduce"
        total, symk = _count(r["kernels"]["grad"], op)
        assert total == len(grad), (r["kernels"]["grad"], decisions)
        assert symk == sum(d.symmetric for d in grad), (r["kernels"]["grad"], decisions)
        other = [n for n in r["kernels"]["grad"] if not any(o in n for o in GRAD_OPS)]
        assert not other, other
        if distopt:
            total, symk = _count(r["kernels"]["param"], "AllGather")
            assert total == len(param), (r["kernels"]["param"], decisions)
            assert symk == sum(d.symmetric for d in param), (r["kernels"]["param"], decisions)
        assert not r["warnings"]
        # One registration per symmetric segment, at allocation, none per step.
        lay = r["layout"]
        n_segments = sum(s[2] for s in lay["grad_segments"] + lay["param_segments"])
        assert 0 < r["rendezvous"] == n_segments
