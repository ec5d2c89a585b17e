"""SymmMemConfig validation, argparse flags and the size-aware policy (no ranks)."""

import argparse

import pytest

from megatron_ext.fsdp_symm import SymmMemConfig, add_fsdp_symm_args, decide, format_report
from megatron_ext.fsdp_symm.config import DEFAULT_BANDS, DEFAULT_BANDS_FP32

MIB = 1 << 20


def test_defaults_are_the_measured_bands():
    import torch

    cfg = SymmMemConfig()
    assert cfg.mode == "auto"
    for name, band in DEFAULT_BANDS.items():
        assert cfg.band(name) == band == cfg.band(name, torch.bfloat16) == cfg.band(name, torch.float16)
        assert cfg.band(name, torch.float32) == DEFAULT_BANDS_FP32[name] == cfg.band(name, "float32")


def test_fp32_band_follows_a_set_band_unless_set_itself():
    import torch

    # A band set alone applies to every dtype, float32 included.
    cfg = SymmMemConfig(all_reduce_min_bytes=0, all_reduce_max_bytes=MIB)
    assert cfg.band("all_reduce", torch.float32) == (0, MIB)
    assert cfg.band("reduce_scatter", torch.float32) == DEFAULT_BANDS_FP32["reduce_scatter"]
    # fp32 fields override, each bound on its own.
    cfg = SymmMemConfig(all_reduce_fp32_max_bytes=64 * MIB)
    assert cfg.band("all_reduce", torch.float32) == (DEFAULT_BANDS_FP32["all_reduce"][0], 64 * MIB)
    assert cfg.band("all_reduce", torch.bfloat16) == DEFAULT_BANDS["all_reduce"]
    fp32 = decide("all_reduce", 48 * MIB, cfg, dtype=torch.float32)
    bf16 = decide("all_reduce", 48 * MIB, cfg, dtype=torch.bfloat16)
    assert fp32.symmetric and "fp32 band" in fp32.reason
    assert not bf16.symmetric and "> max" in bf16.reason


@pytest.mark.parametrize(
    "kwargs,field,hint",
    [
        (dict(all_gather_fp32_max_bytes=-1), "all_gather_fp32_max_bytes", ">= 0"),
        (dict(reduce_scatter_fp32_min_bytes=2.0), "reduce_scatter_fp32_min_bytes", "None or an int"),
        (
            dict(all_reduce_fp32_min_bytes=64 * MIB, all_reduce_fp32_max_bytes=MIB),
            "all_reduce_fp32_min_bytes",
            "must be <=",
        ),
        # An fp32 min above the fp32 default max is caught on the resolved band.
        (dict(all_reduce_fp32_min_bytes=1 << 40), "all_reduce_fp32_min_bytes", "float32 band"),
    ],
)
def test_bad_fp32_values_name_the_field(kwargs, field, hint):
    with pytest.raises(ValueError) as err:
        SymmMemConfig(**kwargs)
    assert field in str(err.value) and hint in str(err.value)


@pytest.mark.parametrize(
    "kwargs,field,hint",
    [
        (dict(mode="always"), "mode", "'auto', 'on', 'off'"),
        (dict(all_gather_max_bytes=-1), "all_gather_max_bytes", ">= 0"),
        (dict(reduce_scatter_min_bytes=1.5), "reduce_scatter_min_bytes", "int"),
        (dict(all_reduce_min_bytes=True), "all_reduce_min_bytes", "int"),
        (dict(all_reduce_min_bytes=10, all_reduce_max_bytes=5), "all_reduce_min_bytes", "must be <="),
        (dict(report="yes"), "report", "bool"),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(kwargs, field, hint):
    with pytest.raises(ValueError) as err:
        SymmMemConfig(**kwargs)
    assert field in str(err.value) and hint in str(err.value)


def test_band_rejects_unknown_collective():
    with pytest.raises(ValueError, match="all_gather"):
        SymmMemConfig().band("broadcast")
    with pytest.raises(ValueError, match="collective"):
        decide("all_to_all", 1, SymmMemConfig())


def test_flags_round_trip():
    parser = add_fsdp_symm_args(argparse.ArgumentParser())
    cfg = SymmMemConfig.from_args(parser.parse_args([]))
    assert cfg == SymmMemConfig()
    args = parser.parse_args(
        [
            "--symm-mem",
            "on",
            "--symm-mem-reduce-scatter-max-mib",
            "2",
            "--symm-mem-all-gather-min-mib",
            "0.25",
            "--symm-mem-no-report",
        ]
    )
    cfg = SymmMemConfig.from_args(args)
    assert cfg.mode == "on" and not cfg.report
    assert cfg.reduce_scatter_max_bytes == 2 * MIB
    assert cfg.all_gather_min_bytes == MIB // 4
    assert cfg.all_reduce_max_bytes == DEFAULT_BANDS["all_reduce"][1]
    cfg = SymmMemConfig.from_args(
        parser.parse_args(["--symm-mem-fp32-reduce-scatter-max-mib", "16", "--symm-mem-fp32-all-gather-min-mib", "0"])
    )
    assert cfg.reduce_scatter_fp32_max_bytes == 16 * MIB and cfg.all_gather_fp32_min_bytes == 0
    assert cfg.all_reduce_fp32_max_bytes is None
    with pytest.raises(ValueError, match="--symm-mem-fp32-all-reduce-min-mib must be >= 0"):
        SymmMemConfig.from_args(parser.parse_args(["--symm-mem-fp32-all-reduce-min-mib", "-2"]))


def test_flags_reject_bad_values():
    parser = add_fsdp_symm_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--symm-mem", "maybe"])
    with pytest.raises(ValueError, match="--symm-mem-all-reduce-max-mib must be >= 0"):
        SymmMemConfig.from_args(parser.parse_args(["--symm-mem-all-reduce-max-mib", "-1"]))
    with pytest.raises(ValueError, match="all_gather_min_bytes"):
        SymmMemConfig.from_args(
            parser.parse_args(["--symm-mem-all-gather-min-mib", "8", "--symm-mem-all-gather-max-mib", "4"])
        )


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_auto_uses_symmetric_memory_inside_the_band_only(collective):
    cfg = SymmMemConfig(**{f"{collective}_min_bytes": MIB, f"{collective}_max_bytes": 8 * MIB})
    below = decide(collective, MIB - 1, cfg)
    at_min = decide(collective, MIB, cfg)
    inside = decide(collective, 4 * MIB, cfg)
    at_max = decide(collective, 8 * MIB, cfg)
    above = decide(collective, 8 * MIB + 1, cfg)
    assert [d.symmetric for d in (below, at_min, inside, at_max, above)] == [False, True, True, True, False]
    assert "< min" in below.reason and "> max" in above.reason and "auto" in inside.reason
    assert inside.collective == collective and inside.nbytes == 4 * MIB


def test_default_policy_for_given_sizes():
    cfg = SymmMemConfig()
    lo_rs, hi_rs = DEFAULT_BANDS["reduce_scatter"]
    assert decide("reduce_scatter", hi_rs, cfg).symmetric
    assert not decide("reduce_scatter", hi_rs + 1, cfg).symmetric
    assert not decide("reduce_scatter", 512 * MIB, cfg).symmetric
    assert not decide("all_gather", 512 * MIB, cfg).symmetric


def test_on_off_and_unavailable_override_the_band():
    assert decide("all_reduce", 1 << 40, SymmMemConfig(mode="on")).symmetric
    off = decide("all_reduce", MIB, SymmMemConfig(mode="off"))
    assert not off.symmetric and off.reason == "mode=off"
    gone = decide("all_reduce", MIB, SymmMemConfig(mode="on"), unavailable="backend is 'gloo'")
    assert not gone.symmetric and "gloo" in gone.reason


def test_report_lists_every_buffer_and_why():
    rows = [
        ("buffer0/bucket0 grads", decide("all_reduce", 4 * MIB, SymmMemConfig())),
        ("buffer0/bucket1 grads", decide("all_reduce", 1 << 30, SymmMemConfig())),
    ]
    text = format_report(rows)
    assert "1 of 2" in text
    assert "bucket0" in text and "symmetric" in text and "> max" in text


def test_reductions_need_a_float_of_at_most_32_bits():
    import torch

    cfg = SymmMemConfig(mode="on")
    assert decide("all_reduce", MIB, cfg, dtype=torch.bfloat16).symmetric
    assert decide("reduce_scatter", MIB, cfg, dtype=torch.float32).symmetric
    f64 = decide("reduce_scatter", MIB, cfg, dtype=torch.float64)
    assert not f64.symmetric and "float64" in f64.reason
    assert not decide("all_reduce", MIB, cfg, dtype=torch.int64).symmetric
    assert decide("all_gather", MIB, cfg, dtype=torch.int64).symmetric


@pytest.mark.parametrize(
    "flag",
    [
        "--symm-mem-all-gather-min-mib",
        "--symm-mem-reduce-scatter-max-mib",
        "--symm-mem-fp32-all-reduce-min-mib",
        "--symm-mem-fp32-all-gather-max-mib",
    ],
)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_mib_flags_name_the_flag_and_the_range(flag, value):
    # Before: a bare ValueError (nan) / OverflowError (inf) from int(round(...)) that named no flag.
    parser = add_fsdp_symm_args(argparse.ArgumentParser())
    with pytest.raises(ValueError) as err:
        SymmMemConfig.from_args(parser.parse_args([flag, value]))
    assert f"{flag} must be >= 0 and finite (MiB); got {value}" in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "field",
    ["all_gather_min_bytes", "reduce_scatter_max_bytes", "all_reduce_fp32_min_bytes", "all_gather_fp32_max_bytes"],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_byte_fields_name_the_field(field, value):
    with pytest.raises(ValueError) as err:
        SymmMemConfig(**{field: value})
    assert f"SymmMemConfig.{field} must be" in str(err.value) and "int >= 0 (bytes)" in str(err.value)
