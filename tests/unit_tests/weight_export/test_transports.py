"""One trainer rank streams to a Hugging Face model in another process over each
cross-process transport: broadcast (gloo on CPU, NCCL from GPU 0 to GPU 1) and
CUDA IPC on one GPU (shared buffers with acknowledgements, direct, push), and a version with a NaN in
the last element of its last bucket refused on each."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks
from megatron_ext.testing.receiver_proc import start_hf_receiver

from ._reference import reference_for

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen3", num_layers=3)


def _trainer(target, transport, backend):
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.weight_export.plan.reshard_plan import run_view

    ps.initialize_model_parallel()
    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    model = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC), device=device)
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
    first = exporter.export()
    buffers = [b.data_ptr() for b in exporter._buffers]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.5)
    second = exporter.export()
    same_buffers = buffers == [b.data_ptr() for b in exporter._buffers]
    verify = exporter.verify(tiny_llama.tokens(SPEC))
    # a NaN in the last element of the last bucket: refused (by the copy that moves it), then undone
    last = exporter.plan.buckets[-1].transfers[-1]
    where = run_view(exporter._tensors[last.src_run.local], last.src_run).view(last.box.shape)
    keep = where[(-1,) * where.dim()].item()
    where[(-1,) * where.dim()] = float("nan")
    try:
        exporter.export()
        nonfinite = "published"
    except wx.NonFiniteWeights as exc:
        nonfinite = str(exc)
    where[(-1,) * where.dim()] = keep
    fourth = exporter.export()
    extra = exporter.extra_memory_bytes
    exporter.close()
    return dict(
        first=first,
        second=second,
        nonfinite=nonfinite,
        last=last.name,
        fourth=fourth,
        verify=verify,
        same_buffers=same_buffers,
        extra=extra,
        buckets=len(exporter.plan.buckets),
        expected=reference_for(SPEC, model),
    )


@pytest.mark.parametrize(
    "transport,backend,receiver_device",
    [
        ("broadcast", "gloo", "cpu"),
        pytest.param("ipc", "nccl", "cuda:0", marks=pytest.mark.gpus(1), id="cuda-ipc-same-gpu"),
        pytest.param("ipc-direct", "nccl", "cuda:0", marks=pytest.mark.gpus(1), id="cuda-ipc-direct-same-gpu"),
        pytest.param("ipc-push", "nccl", "cuda:0", marks=pytest.mark.gpus(1), id="cuda-ipc-push-same-gpu"),
        pytest.param("broadcast", "nccl", "cuda:1", marks=pytest.mark.gpus(2), id="nccl-gpu0-to-gpu1"),
    ],
)
def test_single_trainer_streams_over_transport(transport, backend, receiver_device):
    with start_hf_receiver(tiny_llama.build_hf, (SPEC,), device=receiver_device) as receiver:
        (out,) = run_on_ranks(
            _trainer,
            1,
            args=(receiver.address, transport, backend),
            backend=backend,
            timeout=240,
            watch=receiver.failure,
        )
        got = receiver.result()
    assert got["ok"], got.get("error")
    # version 3 had a NaN in the last element of its last bucket: never published. The trainer's copies
    # find it and abort the version (the engine keeps version 2, or after ipc-push's in-place writes
    # none); ipc-direct's engine finds it in its own copy and ends the version holding none
    assert out["nonfinite"].startswith("version 3 has NaN/Inf in 1 tensor(s): " + out["last"]), out["nonfinite"]
    assert got["applied"] == ([1, 2, None, 4] if transport == "ipc-direct" else [1, 2, 4]) and got["plans"] == 1
    assert out["first"].applied == (1,) and out["second"].applied == (2,) and out["fourth"].applied == (4,)
    assert out["buckets"] > 4 and out["same_buffers"]
    assert got["state"].keys() == out["expected"].keys()
    for name, ref in out["expected"].items():
        assert torch.equal(got["state"][name], ref.cpu()), name
    assert out["verify"].max_abs_diff < 1e-3 and abs(out["verify"].kl) < 1e-5, out["verify"]
    if transport in ("ipc-push", "ipc-direct"):
        assert out["extra"] == 0, "in-place transports hold no export buffers"


def _push_to_cpu_engine(target):
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel()
    model = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC), device="cuda")
    exporter = wx.WeightExporter(
        model, wx.RefitConfig(target=target, transport="ipc-push", vocab_size=SPEC.hf_vocab_size, timeout_s=60)
    )
    try:
        exporter.export()
        return "no error"
    except wx.PlanMismatch as exc:
        return str(exc)
    finally:
        exporter.close()


@pytest.mark.gpus(1)
def test_ipc_push_to_an_engine_off_the_gpu_is_refused_by_name():
    with start_hf_receiver(tiny_llama.build_hf, (SPEC,), device="cpu") as receiver:
        (msg,) = run_on_ranks(_push_to_cpu_engine, 1, args=(receiver.address,), backend="nccl", timeout=240)
    assert "model.embed_tokens.weight is on cpu" in msg and "transport='ipc'" in msg, msg
