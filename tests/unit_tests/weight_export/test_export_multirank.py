"""Multi-rank trainers stream their weights to a Hugging Face model in another
process over the broadcast transport (gloo on CPU, NCCL on GPUs): the
receiver's state equals the Megatron weights gathered by plain per-parameter
collectives, exactly; logits match; a NaN in the last element of the last bucket
(held by another rank: gathered over TP, or checked by the last pipeline stage's
leader, which sends its flags) is refused; wrong plans are refused and dead receivers fail the trainer fast."""

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks
from megatron_ext.testing.receiver_proc import start_hf_receiver

from ._reference import gathered_hf_state

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen2", num_layers=4)
TIMEOUT = 240


def _trainer(tp, pp, target, backend, transport="broadcast"):
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    device = tiny_llama_device()
    model = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC, tp=tp, pp=pp), device=device)
    exporter = wx.WeightExporter(
        model,
        wx.RefitConfig(
            target=target,
            transport=transport,
            backend=backend,
            bucket_size_mb=0.03,
            vocab_size=SPEC.hf_vocab_size,
            timeout_s=60,
        ),
    )
    first = exporter.export(version=7)
    with torch.no_grad():  # a training step's worth of change; the plan is not re-sent
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
    second = exporter.export(version=8)
    verify = exporter.verify(tiny_llama.tokens(SPEC).to(device)) if pp == 1 else None
    # version 9 has a NaN in the last element of the last bucket, on the rank that holds it (TP rank 1: gathered
    # and placed by the export rank; with PP2 on the last stage: placed by that stage's leader, which sends the
    # export rank its flags): refused, never published
    from megatron_ext.weight_export.plan.reshard_plan import run_view

    last = exporter.plan.buckets[-1].transfers[-1]
    where = run_view(exporter._tensors[last.src_run.local], last.src_run) if dist.get_rank() == last.src else None
    if where is not None:
        keep = where[-1, -1].item()
        where[-1, -1] = float("nan")
    try:
        exporter.export(version=9)
        nonfinite = None
    except wx.NonFiniteWeights as exc:
        nonfinite = str(exc)
    if where is not None:
        where[-1, -1] = keep
    third = exporter.export(version=10)
    expected = gathered_hf_state(SPEC, model)
    exporter.close()
    # the trainer's layout read from the live groups is the one built from the sizes; another rank order is refused
    specs = wx.specs_from_model(model, vocab_size=SPEC.hf_vocab_size)
    dp = dist.get_world_size() // (tp * pp)
    from_groups = (
        wx.megatron_layout_from_groups(specs).tensors == wx.megatron_layout(specs, tp=tp, pp=pp, dp=dp).tensors
    )
    order = None
    if dp == 2:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(pipeline_model_parallel_size=2, order="tp-cp-ep-pp-dp")
        try:
            order = f"no error: {wx.megatron_layout_from_groups(specs).description}"
        except ValueError as exc:
            order = str(exc)
    return dict(
        from_groups=from_groups,
        order=order,
        first=first,
        second=second,
        third=third,
        nonfinite=nonfinite,
        last=(last.name, last.src),
        verify=verify,
        buckets=len(exporter.plan.buckets),
        expected=expected if exporter.is_export_rank else None,
        extra=exporter.extra_memory_bytes,
        buffer=exporter.plan.buffer_bytes,
    )


def tiny_llama_device():
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.mark.parametrize(
    "tp,pp,dp,backend,transport,receiver_device",
    [
        (2, 2, 1, "gloo", "broadcast", "cpu"),
        (2, 1, 2, "gloo", "broadcast", "cpu"),
        # NCCL TP gather on GPUs 0-1; the receiver shares GPU 0 with the export rank.
        pytest.param(2, 1, 1, "nccl", "ipc", "cuda:0", marks=pytest.mark.gpus(2)),
        # The NCCL TP gather writes straight into the receiver's weights on GPU 0.
        pytest.param(2, 1, 1, "nccl", "ipc-push", "cuda:0", marks=pytest.mark.gpus(2)),
    ],
    ids=["tp2-pp2", "tp2-dp2", "tp2-nccl-ipc", "tp2-nccl-ipc-push"],
)
def test_trainer_streams_to_hf_receiver_process(tp, pp, dp, backend, transport, receiver_device):
    with start_hf_receiver(tiny_llama.build_hf, (SPEC,), device=receiver_device) as receiver:
        out = run_on_ranks(
            _trainer,
            tp * pp * dp,
            args=(tp, pp, receiver.address, backend, transport),
            backend=backend,
            timeout=TIMEOUT,
            watch=receiver.failure,
        )
        got = receiver.result()
    assert got["ok"], got.get("error")
    assert got["applied"] == [7, 8, 10], "version 9 (a NaN) is dropped; the receiver kept 8 until 10"
    assert got["plans"] == 1, "the plan must be sent once, then only bytes"
    export_rank = out[0]
    assert export_rank["first"].applied == (7,) and export_rank["second"].applied == (8,)
    assert export_rank["third"].applied == (10,)
    name, holder = export_rank["last"]
    assert holder != 0, "the NaN must come from another rank (gathered, or forwarded by the last stage)"
    assert export_rank["nonfinite"].startswith(f"version 9 has NaN/Inf in 1 tensor(s): {name}"), export_rank
    assert all(r["nonfinite"] is None for r in out[1:]), "only the export rank checks and refuses"
    assert export_rank["buckets"] > 4
    expected = export_rank["expected"]
    assert got["state"].keys() == expected.keys()
    for name, ref in expected.items():
        assert torch.equal(got["state"][name], ref.cpu()), name
    if pp == 1:
        assert export_rank["verify"].max_abs_diff < 1e-4 and abs(export_rank["verify"].kl) < 1e-6
    # Trainer memory: two export buffers plus (TP > 1) one gather scratch of ~ a bucket.
    for rank_out in out:
        assert rank_out["extra"] <= 4 * rank_out["buffer"]
    assert all(r["from_groups"] for r in out)
    if dp == 2:  # rank 0's pipeline group is [0, 1] under tp-pp-dp, [0, 2] under Megatron's default order
        assert "pipeline-parallel group is [0, 1]" in out[0]["order"] and "[0, 2]" in out[0]["order"], out[0]["order"]


def _trainer_against_bad_receivers(wrong_target, dying_target):
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel()
    model = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC))
    outcomes = {}
    for what, target, transport in (("wrong", wrong_target, "broadcast"), ("dying", dying_target, "broadcast")):
        exporter = wx.WeightExporter(
            model,
            wx.RefitConfig(
                target=target,
                transport=transport,
                backend="gloo",
                bucket_size_mb=0.03,
                vocab_size=SPEC.hf_vocab_size,
                timeout_s=30,
            ),
        )
        start = time.monotonic()
        try:
            exporter.export()
            outcomes[what] = ("no error", None, time.monotonic() - start)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcomes[what] = (str(exc), type(exc).__name__, time.monotonic() - start)
        exporter.close()
    return outcomes


def test_wrong_plan_refused_and_dead_receiver_fails_fast():
    wrong_spec = dataclasses.replace(SPEC, num_query_groups=4)  # k/v_proj shapes differ
    with (
        start_hf_receiver(tiny_llama.build_hf, (wrong_spec,)) as wrong,
        start_hf_receiver(tiny_llama.build_hf, (SPEC,), die_after=2) as dying,
    ):
        (outcomes,) = run_on_ranks(
            _trainer_against_bad_receivers, 1, args=(wrong.address, dying.address), backend="gloo", timeout=TIMEOUT
        )
        got_wrong, got_dying = wrong.result(), dying.result()
    message, kind, _ = outcomes["wrong"]
    assert kind == "PlanMismatch", message
    assert "'model.layers.0.self_attn.k_proj.weight' has shape (32, 64), the receiver's has (64, 64)" in message
    got = got_wrong
    assert got["ok"] and got["applied"] == [] and got["plans"] == 0
    untouched = tiny_llama.build_hf(wrong_spec)
    for name, p in untouched.named_parameters():
        assert torch.equal(got["state"][name], p), f"{name} was written despite the refusal"

    for what, got in (("dying", got_dying),):
        message, kind, seconds = outcomes[what]
        assert kind == "ReceiverError", message
        assert "receiver" in message and ("died" in message or "failed" in message), message
        assert seconds < 30, f"{what}: took {seconds:.1f}s to notice the dead receiver"
        assert got["exitcode"] == 3
    assert dying.address in outcomes["dying"][0]
