"""Reshard refit checks on one rank (no job spawned; trainer and engine TP1 both on rank 0, so every byte is a
local copy): a version with a NaN or Inf is refused naming the HF tensor (atomic: before anything is written;
streaming: as it is copied, then holding no complete version); rows
the layout does not keep are not checked; tensors that are not the layout's are reported at the first refit;
the KL gate refuses NaN limits and fails on non-finite logits; each refit logs one progress line."""

import logging
import math

import pytest
import torch

from megatron_ext.weight_export import (
    RefitGate,
    RefitRejected,
    ReshardExecutor,
    VerifyResult,
    build_reshard_plan,
    gpt_specs,
    inference_layout,
    megatron_layout,
)

from ._reference import SPECS  # a small dense model's gpt_specs arguments

BUCKET = 1024


def _plan():
    specs = gpt_specs(**SPECS)
    return build_reshard_plan(megatron_layout(specs, ranks=[0]), inference_layout(specs, ranks=[0]))


def _tensors(plan, seed=0):
    """Trainer tensors (the embedding with Megatron's 128 padded rows, of which the layout keeps 100) and
    NaN-filled engine tensors."""
    g = torch.Generator().manual_seed(seed)
    trainer = {n: torch.randn(lt.shape, generator=g) for n, lt in plan.src.tensors[0].items()}
    trainer["embedding.word_embeddings.weight"] = torch.randn(128, 32, generator=g)
    engine = {n: torch.full(lt.shape, float("nan")) for n, lt in plan.dst.tensors[0].items()}
    return trainer, engine


def _snap(tensors):
    return {n: t.clone() for n, t in tensors.items()}


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("atomic", [True, False])
def test_nonfinite_version_is_refused_naming_the_tensor(atomic):
    plan = _plan()
    trainer, engine = _tensors(plan)
    ex = ReshardExecutor(plan, 0, {**trainer, **engine}, bucket_bytes=BUCKET, atomic=atomic)
    ex.refit(1)
    v1 = _snap(engine)
    assert not any(t.isnan().any() for t in v1.values())
    fc2 = trainer["decoder.layers.1.mlp.linear_fc2.weight"]
    for bad in (float("nan"), float("inf"), -float("inf")):
        for t in trainer.values():
            t.mul_(2)  # the next version
        fc2[5, 7] = bad
        with pytest.raises(RefitRejected) as err:
            ex.refit(2)
        assert err.value.reason == "nonfinite"
        msg = str(err.value)
        assert "this rank copies a NaN or Inf in model.layers.1.mlp.down_proj.weight[0:32, 0:48]" in msg, msg
        if atomic:  # the local copies' sources are checked before the version is applied
            assert ex.version == 1 and _same(engine, v1), "nothing may be written"  # bit for bit
        else:  # checked as it was copied: written, and no complete version
            assert ex.version is None and "holds no complete version" in msg, msg
        fc2[5, 7] = 0.0
        for t in trainer.values():
            t.div_(2)
    # [gate; up] is one range on both sides, so one copy: a NaN in its up half names up_proj alone
    assert any([t.name.split(".")[-2] for t in ts] == ["gate_proj", "up_proj"] for ts in ex.staging.local_groups), (
        ex.staging.local_groups
    )
    fc1 = trainer["decoder.layers.1.mlp.linear_fc1.weight"]
    ffn = fc1.shape[0] // 2
    fc1[ffn + 3, 5] = float("nan")
    for t in trainer.values():
        t.mul_(2)
    with pytest.raises(RefitRejected) as err:
        ex.refit(2)
    msg = str(err.value)
    assert f"a NaN or Inf in model.layers.1.mlp.up_proj.weight[0:{ffn}, 0:" in msg and "gate_proj" not in msg, msg
    fc1[ffn + 3, 5] = 0.0
    for t in trainer.values():
        t.div_(2)
    # a NaN in Megatron's padded vocabulary rows (never sent) is not the version's: it applies
    trainer["embedding.word_embeddings.weight"][120, 3] = float("nan")
    for t in trainer.values():
        t.mul_(2)
    ex.refit(3)
    assert ex.version == 3
    want = 2 * v1["model.embed_tokens.weight"]
    assert torch.equal(engine["model.embed_tokens.weight"], want)


def test_wrong_tensors_are_reported_at_the_first_refit():
    plan = _plan()
    trainer, engine = _tensors(plan)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    engine[qkv] = engine[qkv].half()
    ex = ReshardExecutor(plan, 0, {**trainer, **engine}, bucket_bytes=BUCKET)  # no error yet: peers must hear it
    assert ex.problem.startswith(f"rank 0: {qkv} is (64, 32) torch.float16, the layout keeps (64, 32) torch.float32")
    for _ in range(2):  # every refit refuses, and allocates nothing
        with pytest.raises(RefitRejected) as err:
            ex.refit(1)
        assert err.value.reason == "tensors" and str(err.value).startswith(ex.problem), str(err.value)
        assert ex.staging_bytes == 0 and ex.version is None
    del engine[qkv]
    ex = ReshardExecutor(plan, 0, {**trainer, **engine})
    assert ex.problem.startswith(f"rank 0: the plan needs local tensor '{qkv}'"), ex.problem


@pytest.mark.parametrize(
    "kw, arg",
    [
        (dict(max_kl=math.nan), "max_kl"),
        (dict(max_kl=math.inf), "max_kl"),
        (dict(max_kl=-1e-3), "max_kl"),
        (dict(max_kl=None), "max_kl"),
        (dict(max_logit_diff=math.nan), "max_logit_diff"),
        (dict(max_logit_diff=-math.inf), "max_logit_diff"),
    ],
)
def test_gate_refuses_nonfinite_limits(kw, arg):
    with pytest.raises(ValueError, match=rf"RefitGate: {arg} must be a finite number >= 0"):
        RefitGate(None, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, 8), **kw)


class _Logits:
    def __init__(self, logits):
        self.value = logits

    def logits(self, tokens):
        return self.value


def test_gate_fails_on_nonfinite_logits():
    plan = _plan()
    trainer, engine = _tensors(plan)
    ref = torch.randn(1, 4, 100)
    consumer = _Logits(ref.clone())
    gate = RefitGate(consumer, torch.zeros(1, 4, dtype=torch.long), ref, max_kl=1e-6, load=False)
    assert not gate.passes(VerifyResult(max_abs_diff=math.nan, kl=math.nan))
    assert not gate.passes(VerifyResult(max_abs_diff=math.inf, kl=0.0))
    ex = ReshardExecutor(plan, 0, {**trainer, **engine}, bucket_bytes=BUCKET)
    assert ex.refit(1, verify=gate).gate_ok
    consumer.value[0, 2, 5] = float("nan")
    with pytest.raises(RefitRejected) as err:
        ex.refit(2, verify=gate)
    assert err.value.reason == "gate" and not err.value.stats.gate_ok and ex.version is None
    assert "the logits are not finite (the engine's logits" in str(err.value), str(err.value)
    # report mode records the failure and keeps the version
    gate.on_fail = "report"
    stats = ex.refit(3, verify=gate)
    assert stats.gate_ok is False and math.isnan(stats.kl) and ex.version == 3


def test_refit_logs_one_progress_line(caplog):
    plan = _plan()
    trainer, engine = _tensors(plan)
    ex = ReshardExecutor(plan, 0, {**trainer, **engine}, bucket_bytes=BUCKET, atomic=False)
    with caplog.at_level(logging.INFO, logger="megatron_ext.weight_export.exec.reshard"):
        ex.refit(1)
        ex.refit(2)
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_ext.weight_export.exec.reshard"]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in caplog.records), lines
    mb = ex.local_bytes / 1e6
    assert lines[1].startswith(f"reshard refit: rank 0 version 2: sent 0.00 MB, received 0.00 MB, local {mb:.2f} MB"), (
        lines[1]
    )
    assert "GB/s" in lines[1] and " ms " in lines[1]


def test_check_finite_off_applies_a_nan_version_and_is_part_of_the_plan_check():
    plan = _plan()
    trainer, engine = _tensors(plan)
    ex = ReshardExecutor(plan, 0, {**trainer, **engine}, bucket_bytes=BUCKET, check_finite=False)
    trainer["decoder.layers.1.mlp.linear_fc2.weight"][5, 7] = float("nan")
    ex.refit(1)  # the user chose not to spend the check: the bytes move as they are
    assert ex.version == 1 and engine["model.layers.1.mlp.down_proj.weight"].isnan().sum() == 1
    # ranks that disagree about the check would disagree about its collective: another wire id
    on = ReshardExecutor(plan, 0, {**trainer, **engine}, bucket_bytes=BUCKET)
    assert on.wire_id != ex.wire_id
