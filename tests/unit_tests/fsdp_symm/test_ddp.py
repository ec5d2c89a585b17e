"""Megatron DDP with symmetric-memory staging of its buckets.

CPU (gloo): the fallback trains exactly like plain DDP and warns once; the
staging layout itself (per-bucket segments, re-pointed views, AVG kept with a
SUM collective) is exercised with plain allocations standing in for the pool.
2 GPUs (NCCL): losses equal plain DDP, and the profiler shows an ``ncclSymk``
kernel for exactly the buckets the policy put on symmetric memory.
"""

import pytest

from megatron_ext.testing.multirank import run_on_ranks

from ._bodies import (
    GRAD_OPS,
    _count,
    assert_losses_equal,
    ddp_fallback_and_release,
    ddp_parity,
    placement_check,
    staged_models_lifecycle,
)

RTOL = 1e-5
STEPS = 4


def test_gloo_fallback_trains_like_plain_ddp_and_warns_once():
    out = run_on_ranks(ddp_parity, 2, args=(False, 1, STEPS, False, "symm", "on"), backend="gloo", timeout=240)
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
    out = run_on_ranks(
        ddp_parity, 2, args=(distopt, microbatches, STEPS, True, "standin", "auto"), backend="gloo", timeout=300
    )
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


def test_gloo_placement_mismatch_falls_back_to_plain_and_release_frees_segments():
    # A segment whose symmetric buffer would sit at different places of the
    # ranks' pools is staged plain on every rank, with a warning and a reason
    # in the report; training is unchanged; release frees every segment.
    out = run_on_ranks(ddp_fallback_and_release, 2, args=(True, STEPS), backend="gloo", timeout=240)
    assert_losses_equal(out, 0.0)
    for r in out:
        fell_back = [f for symm, f in r["segments"] if f]
        assert len(fell_back) == 1 and "placement differed" in fell_back[0], r["segments"]
        assert any(symm for symm, _ in r["segments"]), "later segments stay symmetric"
        plain = [d for _, d in r["decisions"] if not d.symmetric]
        assert plain and all("placement differed" in d.reason for d in plain), r["decisions"]
        assert len(r["warnings"]) == 1 and "plain memory" in r["warnings"][0], r["warnings"]
        assert r["total"] > 0 and r["freed"] == r["total"] and not any(r["after"])


def test_gloo_placement_check_raises_on_every_rank_when_placements_differ():
    out = run_on_ranks(placement_check, 2, backend="gloo", timeout=120)
    for r in out:
        assert r["same"] == "ok"
        assert "different places" in r["differ"] and "release_symmetric_memory" in r["differ"]


@pytest.mark.gpus(2)
@pytest.mark.parametrize("distopt,microbatches", [(False, 1), (False, 3), (True, 1), (True, 3)])
def test_nccl_symmetric_buckets_run_symk_kernels_and_match_plain(distopt, microbatches):
    out = run_on_ranks(
        ddp_parity, 2, args=(distopt, microbatches, STEPS, True, "symm", "auto"), backend="nccl", timeout=300
    )
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


@pytest.mark.gpus(2)
def test_nccl_staged_models_built_and_released_in_one_process_reuse_their_windows():
    out = run_on_ranks(staged_models_lifecycle, 2, args=(3, 2), backend="nccl", timeout=240)
    for r in out:
        first = r["ddp_losses"][0]
        for losses in r["ddp_losses"][1:] + [r["diverged"]]:
            assert losses == pytest.approx(first, rel=RTOL), r["ddp_losses"]
        # Released segments are reused: no new windows after the first build.
        assert r["ddp_windows"][0] and all(w == r["ddp_windows"][0] for w in r["ddp_windows"]), r["ddp_windows"]
        assert all(f > 0 for f in r["freed"])
        # FSDP: the second model's staged buffers reuse the released segments
        # (construction registers no window); its unshard and gradient buffers
        # come from the new model's own CUDA streams, whose blocks the caching
        # allocator does not share with the old streams, so training may add some.
        (g1, _, built1, _), (g2, before2, built2, _) = r["fsdp_windows"]
        assert built1 > 0 and g1 == g2 and built2 == before2, r["fsdp_windows"]
        # Pools diverged (model released on rank 0 only): every rank fell back to
        # plain for the mismatched buffers, said so, and trained like the others.
        plain = [d for _, d in r["decisions"] if not d.symmetric]
        assert plain and all("placement differed" in d.reason for d in plain), r["decisions"]
        assert r["warnings"] and all("different places" in w for w in r["warnings"]), r["warnings"]
