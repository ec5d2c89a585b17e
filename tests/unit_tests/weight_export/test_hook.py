"""The training-script hook: flags -> config (validated), and a Megatron DDP +
optimizer training loop exporting every N steps with version numbers."""

import argparse

import pytest
import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks
from megatron_ext.weight_export import WeightExportConfig, add_weight_export_args

from ._reference import reference_for

SPEC = tiny_llama.TinyLlamaSpec()


def test_flags_round_trip_into_config():
    parser = add_weight_export_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--weight-export-target",
            "10.0.0.2:5555,10.0.0.3:5555",
            "--weight-export-transport",
            "broadcast",
            "--weight-export-bucket-size-mb",
            "256",
            "--weight-export-every-n-steps",
            "10",
            "--weight-export-backend",
            "nccl",
            "--weight-export-vocab-size",
            "151936",
        ]
    )
    cfg = WeightExportConfig.from_args(args)
    assert cfg == WeightExportConfig(
        target="10.0.0.2:5555,10.0.0.3:5555",
        transport="broadcast",
        bucket_size_mb=256,
        every_n_steps=10,
        backend="nccl",
        vocab_size=151936,
    )
    assert cfg.targets == ["10.0.0.2:5555", "10.0.0.3:5555"]
    assert WeightExportConfig.from_args(parser.parse_args([])) == WeightExportConfig()


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (
            dict(transport="tcp"),
            "transport must be one of ('inprocess', 'broadcast', 'ipc', 'ipc-push', 'ipc-direct'), got 'tcp'",
        ),
        (dict(transport="broadcast"), "target is required for transport='broadcast'"),
        (dict(transport="ipc", target="localhost"), "target must be 'host:port"),
        (dict(bucket_size_mb=0), "bucket_size_mb must be > 0"),
        (dict(every_n_steps=-1), "every_n_steps must be >= 0"),
        (dict(backend="mpi"), "backend must be one of ('auto', 'gloo', 'nccl')"),
    ],
)
def test_config_errors_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        WeightExportConfig(**kwargs)


def _gathered_hf_state(model):
    """The model's weights via per-parameter TP all-gathers, converted by the test's reference."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    full = {}
    for name, p in model.module.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            if name.endswith("linear_fc1.weight"):
                parts = [x.chunk(2)[0] for x in parts] + [x.chunk(2)[1] for x in parts]
                t = torch.cat(parts, 0)
            else:
                t = torch.cat(parts, p.partition_dim)
        full[name] = t

    class _Full(torch.nn.Module):
        def named_parameters(self, *a, **k):
            return iter(full.items())

    return reference_for(SPEC, _Full())


def _train_and_export(steps, every):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = tiny_llama.transformer_config(SPEC, tp=2)
    model = DistributedDataParallel(
        config=cfg,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=tiny_llama.build_model(SPEC, cfg),
    )
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [model])
    hf = tiny_llama.hf_model(SPEC, cfg)
    receiver = wx.WeightReceiver(wx.HFModelConsumer(hf))
    exporter = wx.WeightExporter(
        model, wx.WeightExportConfig(every_n_steps=every, vocab_size=SPEC.hf_vocab_size), receiver=receiver
    )
    tokens = tiny_llama.tokens(SPEC, batch=2, seed=1)
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    reported, exported_state = [], None
    for step in range(1, steps + 1):
        model.zero_grad_buffer()
        opt.zero_grad()
        labels = torch.roll(tokens, -1, dims=1)
        model(tokens, torch.arange(seq).expand_as(tokens), mask, labels=labels).float().mean().backward()
        model.finish_grad_sync()
        opt.step()
        result = exporter.maybe_export(step)
        if result is not None:
            reported.append(result.applied)
            exported_state = _gathered_hf_state(model)
    final_state = _gathered_hf_state(model)
    return dict(
        reported=reported,
        applied=receiver.applied_version,
        state={n: p.detach().clone() for n, p in hf.named_parameters()},
        exported=exported_state,
        final=final_state,
    )


def test_training_loop_exports_every_n_steps_with_versions():
    out = run_on_ranks(_train_and_export, 2, args=(5, 2), backend="gloo", timeout=240)
    rank0 = out[0]
    assert rank0["reported"] == [(2,), (4,)]
    assert rank0["applied"] == 4
    assert out[1]["reported"] == [(), ()]  # only the export rank hears back
    # The receiver holds the weights of step 4 exactly, not those of step 5.
    for name, ref in rank0["exported"].items():
        assert torch.equal(rank0["state"][name], ref), name
    assert any(not torch.equal(rank0["final"][n], ref) for n, ref in rank0["exported"].items())


# Accepted before, failing later with unrelated errors (or, for ipc-push, only when the sender was built).
BAD_EXPORT_CONFIGS = [
    (
        dict(transport="broadcast", target="127.0.0.1:0"),
        ["--weight-export-transport", "broadcast", "--weight-export-target", "127.0.0.1:0"],
        "WeightExportConfig.target must be 'host:port[,host:port...]' with every port in 1..65535",
    ),
    (
        dict(transport="ipc", target="127.0.0.1:5555,127.0.0.1:99999"),
        ["--weight-export-transport", "ipc", "--weight-export-target", "127.0.0.1:5555,127.0.0.1:99999"],
        "with every port in 1..65535, got '127.0.0.1:5555,127.0.0.1:99999' ('127.0.0.1:99999' is not)",
    ),
    (
        dict(bucket_size_mb=float("inf")),
        ["--weight-export-bucket-size-mb", "inf"],
        "WeightExportConfig.bucket_size_mb must be > 0: a finite number of MiB >= 0.00390625 (4 KiB, one page)",
    ),
    (
        dict(bucket_size_mb=1e-9),
        ["--weight-export-bucket-size-mb", "1e-9"],
        "WeightExportConfig.bucket_size_mb must be > 0: a finite number of MiB >= 0.00390625 (4 KiB, one page)",
    ),
    (
        dict(timeout_s=float("inf")),
        ["--weight-export-timeout-s", "inf"],
        "WeightExportConfig.timeout_s must be > 0 and finite (seconds), got inf",
    ),
    (
        dict(transport="ipc-push", target="127.0.0.1:5555,127.0.0.1:5556"),
        ["--weight-export-transport", "ipc-push", "--weight-export-target", "127.0.0.1:5555,127.0.0.1:5556"],
        "WeightExportConfig.transport='ipc-push' writes into one engine's weights; got 2 targets in "
        "target='127.0.0.1:5555,127.0.0.1:5556' (use transport='ipc' or 'broadcast' for several engines)",
    ),
]


@pytest.mark.parametrize("kwargs,argv,needle", BAD_EXPORT_CONFIGS)
def test_bad_values_refused_directly_naming_the_field(kwargs, argv, needle):
    with pytest.raises(ValueError) as err:
        WeightExportConfig(**kwargs)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("kwargs,argv,needle", BAD_EXPORT_CONFIGS)
def test_bad_flags_refused_by_from_args_naming_the_field(kwargs, argv, needle):
    parser = add_weight_export_args(argparse.ArgumentParser())
    with pytest.raises(ValueError) as err:
        WeightExportConfig.from_args(parser.parse_args(argv))
    assert needle in str(err.value), str(err.value)


def test_port_and_bucket_bounds_are_accepted():
    cfg = WeightExportConfig(target="127.0.0.1:1,127.0.0.1:65535", transport="broadcast", bucket_size_mb=1 / 256)
    assert cfg.targets == ["127.0.0.1:1", "127.0.0.1:65535"]
    assert WeightExportConfig(target="127.0.0.1:5555", transport="ipc-push").targets == ["127.0.0.1:5555"]
