"""ReshardRefitConfig: validation names the field, flags round-trip, and the config drives a real refit."""

import argparse

import pytest
import torch

from megatron_ext.weight_export import (
    ReshardExecutor,
    ReshardRefitConfig,
    add_reshard_refit_args,
    build_reshard_plan,
    gpt_specs,
    inference_layout,
    megatron_layout,
)

SPECS = dict(
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_groups=2,
    head_dim=8,
    ffn_hidden_size=48,
    vocab_size=100,
    padded_vocab_size=128,
    dtype=torch.float32,
)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(engine_tp=0), "engine_tp"),
        (dict(engine_dp=-1), "engine_dp"),
        (dict(engine_ep=1.5), "engine_ep"),
        (dict(engine_tp=2, engine_ep=4), "engine_ep must divide"),
        (dict(vocab_padding=0), "vocab_padding"),
        (dict(max_inflight=0), "max_inflight"),
        (dict(bucket_size_mb=0), "bucket_size_mb"),
        (dict(every_n_steps=-1), "every_n_steps"),
        (dict(backend="mpi"), "backend must be one of"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(store="localhost"), "store must be 'host:port'"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ReshardRefitConfig(**kw)


def test_flags_round_trip_and_defaults():
    parser = add_reshard_refit_args(argparse.ArgumentParser())
    assert ReshardRefitConfig.from_args(parser.parse_args([])) == ReshardRefitConfig()
    cfg = ReshardRefitConfig.from_args(
        parser.parse_args(
            [
                "--reshard-refit-engine-tp",
                "2",
                "--reshard-refit-engine-dp",
                "4",
                "--reshard-refit-engine-ep",
                "8",
                "--reshard-refit-bucket-size-mb",
                "256",
                "--reshard-refit-max-inflight",
                "4",
                "--no-reshard-refit-atomic",
                "--no-reshard-refit-check-finite",
                "--reshard-refit-every-n-steps",
                "10",
                "--reshard-refit-store",
                "10.0.0.1:29600",
                "--reshard-refit-backend",
                "nccl",
                "--reshard-refit-timeout-s",
                "30",
                "--reshard-refit-vocab-padding",
                "128",
            ]
        )
    )
    assert cfg == ReshardRefitConfig(
        engine_tp=2,
        engine_dp=4,
        engine_ep=8,
        vocab_padding=128,
        bucket_size_mb=256,
        max_inflight=4,
        atomic=False,
        check_finite=False,
        every_n_steps=10,
        store="10.0.0.1:29600",
        backend="nccl",
        timeout_s=30,
    )
    assert cfg.executor_kwargs == dict(bucket_bytes=256 << 20, max_inflight=4, atomic=False, check_finite=False)
    assert cfg.store_address == ("10.0.0.1", 29600)
    assert [s for s in range(1, 31) if cfg.due(s)] == [10, 20, 30] and not ReshardRefitConfig().due(10)
    with pytest.raises(ValueError, match="--reshard-refit-store"):
        ReshardRefitConfig().join(0, 2)


def test_config_builds_the_engine_layout_and_runs_a_refit():
    """The engine layout is inference_layout's; the executor kwargs drive a one-process refit (trainer and
    engine TP1 both on rank 0, so every byte is a local copy) that delivers the trainer's bytes exactly."""
    specs = gpt_specs(**SPECS)
    cfg = ReshardRefitConfig(engine_tp=2, engine_dp=3, vocab_padding=32, bucket_size_mb=0.01, max_inflight=3)
    want = inference_layout(specs, tp=2, dp=3, vocab_padding=32, ranks=range(4, 10))
    got = cfg.engine_layout(specs, ranks=range(4, 10))
    assert got.ranks == want.ranks and got.tensors == want.tensors
    one = ReshardRefitConfig(bucket_size_mb=0.01, atomic=False)
    src, dst = megatron_layout(specs, tp=1, ranks=[0]), one.engine_layout(specs, ranks=[0])
    g = torch.Generator().manual_seed(0)
    trainer = {n: torch.randn(lt.shape, generator=g) for n, lt in src.tensors[0].items()}
    engine = {n: torch.full(lt.shape, float("nan")) for n, lt in dst.tensors[0].items()}
    ex = ReshardExecutor(build_reshard_plan(src, dst), 0, {**trainer, **engine}, **one.executor_kwargs)
    assert (ex.bucket_bytes, ex.max_inflight, ex.atomic) == (one.bucket_bytes, 2, False)
    ex.refit(1)
    hf = dst.hf_tensors(0, engine)
    assert hf and all(not t.isnan().any() for t in engine.values())
    assert torch.equal(
        dict(hf)["model.layers.0.mlp.down_proj.weight"], trainer["decoder.layers.0.mlp.linear_fc2.weight"]
    )


# Accepted before, failing later with unrelated errors.
BAD_REFIT_CONFIGS = [
    (
        dict(store="10.0.0.1:70000"),
        ["--reshard-refit-store", "10.0.0.1:70000"],
        "ReshardRefitConfig.store must be 'host:port' with a port in 1..65535",
    ),
    (
        dict(store="10.0.0.1:0"),
        ["--reshard-refit-store", "10.0.0.1:0"],
        "ReshardRefitConfig.store must be 'host:port' with a port in 1..65535",
    ),
    (
        dict(bucket_size_mb=float("inf")),
        ["--reshard-refit-bucket-size-mb", "inf"],
        "ReshardRefitConfig.bucket_size_mb must be > 0: a finite number of MiB >= 0.00390625 (4 KiB, one page)",
    ),
    (
        dict(bucket_size_mb=1e-9),
        ["--reshard-refit-bucket-size-mb", "1e-9"],
        "ReshardRefitConfig.bucket_size_mb must be > 0: a finite number of MiB >= 0.00390625 (4 KiB, one page)",
    ),
    (
        dict(bucket_size_mb=0.001),
        ["--reshard-refit-bucket-size-mb", "0.001"],  # 1048 bytes: below one page
        "ReshardRefitConfig.bucket_size_mb must be > 0: a finite number of MiB >= 0.00390625 (4 KiB, one page)",
    ),
    (
        dict(timeout_s=float("inf")),
        ["--reshard-refit-timeout-s", "inf"],
        "ReshardRefitConfig.timeout_s must be > 0 and finite (seconds), got inf",
    ),
]


@pytest.mark.parametrize("kw,argv,needle", BAD_REFIT_CONFIGS)
def test_bad_values_refused_directly_naming_the_field_and_range(kw, argv, needle):
    with pytest.raises(ValueError) as err:
        ReshardRefitConfig(**kw)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("kw,argv,needle", BAD_REFIT_CONFIGS)
def test_bad_flags_refused_by_from_args_naming_the_field_and_range(kw, argv, needle):
    parser = add_reshard_refit_args(argparse.ArgumentParser())
    with pytest.raises(ValueError) as err:
        ReshardRefitConfig.from_args(parser.parse_args(argv))
    assert needle in str(err.value), str(err.value)


def test_smallest_bucket_fits_the_alignment_and_header_it_is_derived_from():
    from megatron_ext.weight_export import config, wire

    assert config.MIN_BUCKET_BYTES >= wire.ALIGN and config.MIN_BUCKET_BYTES > wire.HEADER_BYTES
    cfg = ReshardRefitConfig(bucket_size_mb=config.MIN_BUCKET_BYTES / (1 << 20), store="10.0.0.1:65535")
    assert cfg.bucket_bytes == config.MIN_BUCKET_BYTES and cfg.store_address == ("10.0.0.1", 65535)
    assert ReshardRefitConfig(store="h:1").store_address == ("h", 1)
