"""SymmMemConfig validation, argparse flags, the size-aware policy, and the
probed bands: their derivation, the cache, resolve_config (CPU: one gloo job;
the real probe: gpus(2) and gpus(1))."""

import argparse
import os

import pytest

from megatron_ext.fsdp_symm import SymmMemConfig, add_fsdp_symm_args, decide, format_report
from megatron_ext.fsdp_symm.config import COLLECTIVES, DEFAULT_BANDS, DEFAULT_BANDS_FP32
from megatron_ext.fsdp_symm.probe import PROBE_POINTS, PROBE_SIZES

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


# --------------------------------------------------------------------------- probed bands
SIZES = [MIB // 4 << i for i in range(8)]  # 0.25 .. 32 MiB


def _rows(ratios, collective="all_reduce", dtype="bf16", **extra):
    """Timing rows with plain 100 us and symmetric 100 * ratio us per size."""
    return [
        dict(collective=collective, dtype=dtype, nbytes=n, plain_us=100.0, symmetric_us=100.0 * r, **extra)
        for n, r in zip(SIZES, ratios)
    ]


def test_bands_from_timings_takes_the_longest_run_of_not_slower_sizes():
    from megatron_ext.fsdp_symm import bands_from_timings

    # Two runs where symmetric is not slower: sizes 1-2 and 4-6; the longer wins.
    rows = _rows([1.2, 0.9, 0.95, 1.1, 0.8, 0.9, 1.0, 1.3])
    assert bands_from_timings(rows) == {"all_reduce": (SIZES[4], SIZES[6])}
    # A run from the smallest size starts the band at 0.
    assert bands_from_timings(_rows([0.9, 0.9, 0.9, 1.2, 1.2, 0.9, 1.2, 1.2])) == {"all_reduce": (0, SIZES[2])}
    # Runs equally long: the one of smaller sizes.
    assert bands_from_timings(_rows([1.2, 0.9, 0.9, 1.2, 0.9, 0.9, 1.2, 1.2])) == {"all_reduce": (SIZES[1], SIZES[2])}


def test_bands_from_timings_tolerance_edge():
    from megatron_ext.fsdp_symm import bands_from_timings

    # 1.25 and 100 * 1.25 are exact in binary: at the edge counts as not slower.
    at_edge = _rows([1.3, 1.25, 1.25, 1.3, 1.3, 1.3, 1.3, 1.3])
    assert bands_from_timings(at_edge, tolerance=0.25) == {"all_reduce": (SIZES[1], SIZES[2])}
    over = [
        dict(r, symmetric_us=r["symmetric_us"] + 1e-9 if r["nbytes"] == SIZES[2] else r["symmetric_us"])
        for r in at_edge
    ]
    assert bands_from_timings(over, tolerance=0.25) == {"all_reduce": (SIZES[1], SIZES[1])}
    assert bands_from_timings(at_edge, tolerance=0.0) == {"all_reduce": None}
    with pytest.raises(ValueError, match="tolerance"):
        bands_from_timings(at_edge, tolerance=-0.1)


def test_bands_from_timings_never_symmetric_when_never_faster_or_not_engaged():
    from megatron_ext.fsdp_symm import bands_from_timings

    rows = _rows([1.5] * 8, "all_gather") + _rows([1.02] * 8, "reduce_scatter") + _rows([2.0] * 8, "all_reduce")
    assert bands_from_timings(rows) == {"all_gather": None, "reduce_scatter": None, "all_reduce": None}
    # Faster, but the symmetric kernel did not run / the timing measured the host: never in a band.
    assert bands_from_timings(_rows([0.5] * 8, symk_engaged=False)) == {"all_reduce": None}
    assert bands_from_timings(_rows([0.5] * 8, host_bound=True)) == {"all_reduce": None}
    assert bands_from_timings(_rows([0.5] * 8, symk_engaged=None)) == {"all_reduce": (0, SIZES[-1])}


def test_bands_from_timings_needs_every_dtype_unless_told_which():
    from megatron_ext.fsdp_symm import bands_from_timings

    rows = _rows([1.2, 0.9, 0.9, 0.9, 1.2, 1.2, 1.2, 1.2]) + _rows(
        [1.2, 0.9, 0.9, 0.9, 0.9, 0.9, 1.2, 1.2], dtype="fp32"
    )
    assert bands_from_timings(rows) == {"all_reduce": (SIZES[1], SIZES[3])}
    assert bands_from_timings(rows, dtypes=("fp32",)) == {"all_reduce": (SIZES[1], SIZES[5])}


def test_recorded_2xh200_run_gives_the_default_bands():
    # The shipped defaults are this derivation of the recorded benchmark run.
    import json
    import pathlib

    from megatron_ext.fsdp_symm import bands_from_timings

    path = pathlib.Path(__file__).parents[3] / "benchmarks/results/symm_mem_2xH200_run3_graphs.json"
    rows = json.loads(path.read_text())["collectives"]
    assert bands_from_timings(rows, dtypes=("bf16",)) == DEFAULT_BANDS
    assert bands_from_timings(rows, dtypes=("fp32",)) == DEFAULT_BANDS_FP32


def _entry(lo):
    band = [lo, 2 * lo]
    return {"bands": dict.fromkeys(COLLECTIVES, band), "bands_fp32": dict.fromkeys(COLLECTIVES, None)}


def test_band_cache_reads_writes_and_merges(tmp_path):
    from megatron_ext.fsdp_symm.probe import read_cache, write_entry

    path = str(tmp_path / "sub" / "bands.json")
    assert read_cache(path) == ({}, None)
    write_entry(path, "gpu A | 2 ranks", _entry(MIB))
    write_entry(path, "gpu A | 4 ranks", _entry(2 * MIB))
    write_entry(path, "gpu A | 2 ranks", _entry(4 * MIB))  # replaces its own entry only
    entries, problem = read_cache(path)
    assert problem is None
    assert entries == {"gpu A | 2 ranks": _entry(4 * MIB), "gpu A | 4 ranks": _entry(2 * MIB)}
    assert not [p for p in os.listdir(tmp_path / "sub") if p.startswith(".symm_mem_bands.")], "temp files left"


def test_cache_key_tells_interconnects_apart(monkeypatch):
    # Same GPU model, versions and variables; hosts that differ only in how the
    # GPUs are linked get different keys, the same host the same key.
    import sys
    import types

    import torch

    from megatron_ext.fsdp_symm import probe

    for name in probe.KEY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    tail = f"2 ranks on one host | NCCL 2.28.9 | torch {torch.__version__} | probe {probe.PROBE_VERSION}"
    assert probe.cache_key(2, "cpu") == f"cpu | {tail}"  # CPU: no interconnect part

    def key(gpus, peer):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", peer)
        return probe.cache_key(2, torch.device("cuda", 0))

    nvlink, pcie = (lambda a, b: True), (lambda a, b: False)
    paired = lambda a, b: a // 2 == b // 2  # noqa: E731 - peers 0<->1 and 2<->3 only
    keys = [key(4, nvlink), key(4, pcie), key(4, paired), key(1, nvlink)]
    assert keys == [f"NVIDIA H200 | {p2p} | {tail}" for p2p in ("P2P all", "P2P none", "P2P 4/12 pairs", "P2P n/a")]
    assert key(4, nvlink) == keys[0] and key(4, pcie) == keys[1]

    # With pynvml: the active NVLink links of this rank's GPU; any NVML failure leaves them out.
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0),
    )
    nvml = types.SimpleNamespace(
        NVML_NVLINK_MAX_LINKS=18,
        NVML_FEATURE_ENABLED=1,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByPciBusId=lambda bus_id: {"00000000:1b:00.0": "gpu0"}[bus_id],
        nvmlDeviceGetNvLinkState=lambda handle, link: int(link < 18),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert key(4, nvlink) == f"NVIDIA H200 | P2P all | NVLink 18 | {tail}"

    def fail(*args):
        raise RuntimeError("NVML error")

    monkeypatch.setattr(nvml, "nvmlDeviceGetNvLinkState", fail)  # e.g. no NVLink on this GPU
    assert key(4, pcie) == f"NVIDIA H200 | P2P none | NVLink 0 | {tail}"
    monkeypatch.setattr(nvml, "nvmlInit", fail)
    assert key(4, nvlink) == keys[0]


@pytest.mark.parametrize("text,why", [("{not json", "JSONDecodeError"), ('{"entries": []}', "format-1")])
def test_unreadable_band_cache_is_a_problem_not_a_crash(tmp_path, text, why):
    from megatron_ext.fsdp_symm.probe import read_cache, write_entry

    path = tmp_path / "bands.json"
    path.write_text(text)
    entries, problem = read_cache(str(path))
    assert entries == {} and why in problem
    write_entry(str(path), "k", _entry(MIB))  # an unreadable file is replaced
    assert read_cache(str(path)) == ({"k": _entry(MIB)}, None)


def test_concurrent_cache_writers_keep_every_entry(tmp_path):
    # Writers of different groups at once: read-modify-write under the lock
    # loses nothing (without it, entries written between a read and a replace vanish).
    import threading

    from megatron_ext.fsdp_symm.probe import read_cache, write_entry

    path = str(tmp_path / "bands.json")
    per_writer, writers = 40, 4

    def write(w):
        for i in range(per_writer):
            write_entry(path, f"writer {w} entry {i}", _entry(MIB + i))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries, problem = read_cache(path)
    assert problem is None
    assert len(entries) == per_writer * writers


def test_band_cache_over_ranks_and_resolve_config(tmp_path):
    from megatron_ext.testing.multirank import run_on_ranks

    from ._bodies import FAKE_BANDS, FAKE_BANDS_FP32, band_cache_and_resolve

    out = run_on_ranks(band_cache_and_resolve, 2, args=(str(tmp_path / "bands.json"),), backend="gloo", timeout=120)
    for rank, r in enumerate(out):
        # Miss: every rank measured once; rank 0 wrote one entry.
        assert r["miss"] == ("probe", FAKE_BANDS, FAKE_BANDS_FP32, 1)
        ((key, entry),) = r["file_after_miss"]["entries"].items()
        assert "2 ranks" in key and entry["bands"]["reduce_scatter"] is None
        assert entry["bands_fp32"]["all_reduce"] == [0, 8 * MIB]
        # Hit: the stored bands, nothing measured.
        assert r["hit"] == ("cache", FAKE_BANDS, FAKE_BANDS_FP32, 1.5, key, 1)
        # Corrupt file: one warning (the reading rank), a miss, the file rewritten.
        source, calls, warned = r["corrupt"]
        assert source == "probe" and calls == 2
        if rank == 0:
            assert len(warned) == 1 and "unreadable" in warned[0] and "bands.json" in warned[0], warned
        else:
            assert warned == []
        assert list(r["file_after_corrupt"]["entries"]) == [key]
        # Every rank repeats a run that any rank was late for (else ranks issue different collectives).
        assert r["late"] == (True, False)
        # gloo: unchanged, not probed.
        assert r["gloo_resolve"] == (True, 0)
        # Available (stand-in): probed bands where the user set none, loaded once for three calls.
        resolved, same, calls = r["resolved"]
        assert same and calls == 1
        assert resolved.band("all_gather") == FAKE_BANDS["all_gather"]
        assert resolved.band("reduce_scatter") == (0, 0)  # never faster: never symmetric
        assert resolved.band("reduce_scatter", "float32") == FAKE_BANDS_FP32["reduce_scatter"]
        # all_reduce_max_bytes was set: kept; its min probed; fp32 follows the set band.
        assert resolved.band("all_reduce") == (0, 2 * MIB) == resolved.band("all_reduce", "float32")
        assert not decide("reduce_scatter", MIB, resolved).symmetric
        assert (
            decide("all_reduce", 2 * MIB, resolved).symmetric and not decide("all_reduce", 3 * MIB, resolved).symmetric
        )
        notes = "\n".join(r["notes"])
        assert "probed bands for 2 ranks" in notes and "set by the user, kept: all_reduce_max_bytes" in notes
        if rank == 0:
            assert r["one_rank"] and r["measured_other_size"]
            assert "a group of 1 rank: no bands probed" in notes
            assert "measured at 2 ranks" in notes and "this group has 1" in notes and "--symm-mem-bands probe" in notes


def _measured(bands, bands_fp32=None):
    from megatron_ext.fsdp_symm import MeasuredBands

    return MeasuredBands(bands=bands, bands_fp32=bands_fp32 or bands, ranks=8, seconds=1.0)


def test_set_band_flags_win_over_probed_bands():
    measured = _measured(
        {"all_gather": (4 * MIB, 128 * MIB), "reduce_scatter": (MIB, 8 * MIB), "all_reduce": None},
        {"all_gather": (4 * MIB, 128 * MIB), "reduce_scatter": (MIB, 64 * MIB), "all_reduce": (MIB, 16 * MIB)},
    )
    from megatron_ext.fsdp_symm.probe import apply_bands

    parser = add_fsdp_symm_args(argparse.ArgumentParser())
    # A flag equal to the default counts as set: --symm-mem-all-gather-max-mib 64 stays 64 MiB.
    args = [
        "--symm-mem-bands",
        "probe",
        "--symm-mem-all-gather-max-mib",
        "64",
        "--symm-mem-fp32-all-reduce-max-mib",
        "4",
    ]
    cfg = SymmMemConfig.from_args(parser.parse_args(args))
    assert cfg.pinned_bands == ("all_gather_max_bytes", "all_reduce_fp32_max_bytes")
    assert cfg.set_band_fields() == ("all_gather_max_bytes", "all_reduce_fp32_max_bytes")
    resolved = apply_bands(cfg, measured)
    assert resolved.band("all_gather") == (4 * MIB, 64 * MIB)
    assert resolved.band("all_gather", "float32") == (4 * MIB, 64 * MIB)  # follows the set band
    assert resolved.band("reduce_scatter") == (MIB, 8 * MIB)
    assert resolved.band("reduce_scatter", "float32") == (MIB, 64 * MIB)
    assert resolved.band("all_reduce") == (0, 0)
    assert resolved.band("all_reduce", "float32") == (MIB, 4 * MIB)
    assert apply_bands(resolved, measured) == resolved
    # A set bound and the probed one that do not overlap: never symmetric.
    high = SymmMemConfig(bands="probe", reduce_scatter_min_bytes=16 * MIB)
    assert apply_bands(high, measured).band("reduce_scatter") == (0, 0)
    # Every band set: nothing probed is used.
    flags = ["--symm-mem-bands", "probe"]
    for c in COLLECTIVES:
        for prefix in ("", "fp32-"):
            flags += [f"--symm-mem-{prefix}{c.replace('_', '-')}-min-mib", "1"]
            flags += [f"--symm-mem-{prefix}{c.replace('_', '-')}-max-mib", "2"]
    every = apply_bands(SymmMemConfig.from_args(parser.parse_args(flags)), measured)
    assert all(every.band(c) == every.band(c, "float32") == (MIB, 2 * MIB) for c in COLLECTIVES)


@pytest.mark.parametrize(
    "kwargs,field,hint",
    [
        (dict(bands="fast"), "bands", "'measured', 'probe'"),
        (dict(probe_cache=""), "probe_cache", "non-empty path"),
        (dict(probe_cache=3), "probe_cache", "non-empty path"),
        (dict(pinned_bands=("all_gather_max",)), "pinned_bands", "all_gather_max_bytes"),
        (dict(pinned_bands="all_gather_max_bytes"), "pinned_bands", "tuple of band field names"),
    ],
)
def test_bad_band_source_values_name_the_field(kwargs, field, hint):
    with pytest.raises(ValueError) as err:
        SymmMemConfig(**kwargs)
    assert f"SymmMemConfig.{field}" in str(err.value) and hint in str(err.value)


def test_probe_leaves_min_max_check_to_the_probe_when_one_bound_is_unset():
    # The max comes from the probe, so a min above the default max is no error yet...
    cfg = SymmMemConfig(bands="probe", reduce_scatter_min_bytes=16 * MIB)
    assert cfg.set_band_fields() == ("reduce_scatter_min_bytes",)
    # ...but it is with the shipped bands, or with both bounds set.
    with pytest.raises(ValueError, match="reduce_scatter_min_bytes .* must be <= reduce_scatter_max_bytes"):
        SymmMemConfig(reduce_scatter_min_bytes=16 * MIB)
    with pytest.raises(ValueError, match="all_reduce_fp32_min_bytes .* must be <= all_reduce_fp32_max_bytes"):
        SymmMemConfig(bands="probe", all_reduce_fp32_min_bytes=2 * MIB, all_reduce_fp32_max_bytes=MIB)


def test_band_source_flags(tmp_path):
    parser = add_fsdp_symm_args(argparse.ArgumentParser())
    cfg = SymmMemConfig.from_args(parser.parse_args([]))
    assert cfg.bands == "measured" and cfg.probe_cache is None and cfg.pinned_bands == ()
    path = str(tmp_path / "b.json")
    cfg = SymmMemConfig.from_args(parser.parse_args(["--symm-mem-bands", "probe", "--symm-mem-probe-cache", path]))
    assert cfg.bands == "probe" and cfg.probe_cache == path
    assert SymmMemConfig(probe_cache=tmp_path / "b.json").probe_cache == path
    with pytest.raises(SystemExit):
        parser.parse_args(["--symm-mem-bands", "guess"])


def test_report_notes_follow_the_table():
    from megatron_ext.fsdp_symm.policy import Reporter

    rep = Reporter()
    rep.add("b0", decide("all_reduce", MIB, SymmMemConfig()))
    rep.note("bands from somewhere")
    rep.note("bands from somewhere")
    text = rep.flush(enabled=False)
    assert text.splitlines()[-1] == "  note: bands from somewhere" and text.count("note:") == 1
    assert rep.flush(enabled=False) is None


@pytest.mark.gpus(2)
def test_nccl_probe_measures_caches_and_stages_with_the_same_bands_on_every_rank(tmp_path):
    from megatron_ext.testing.multirank import run_on_ranks

    from ._bodies import probe_on_gpus

    out = run_on_ranks(probe_on_gpus, 2, args=(str(tmp_path / "bands.json"),), backend="nccl", timeout=300)
    print("probe:", out[0]["seconds"], "s;", out[0]["bands"], out[0]["bands_fp32"])
    assert out[0]["bands"] == out[1]["bands"] and out[0]["bands_fp32"] == out[1]["bands_fp32"]
    for r in out:
        assert r["source"] == "probe"
        assert len(r["rows"]) == len(PROBE_POINTS) * len(PROBE_SIZES), "every (collective, dtype) at every size"
        assert all(row["symk_engaged"] for row in r["rows"]), [row for row in r["rows"] if not row["symk_engaged"]]
        assert not any(row["host_bound"] for row in r["rows"])
        # Each probe buffer has max(PROBE_SIZES) bytes; registering the symmetric
        # ones keeps a little bookkeeping (2 KiB seen on one H100): no buffer stays.
        assert r["allocated_delta"] < PROBE_SIZES[-1], "the probe's buffers must be freed"
        ((key, entry),) = r["file"]["entries"].items()
        assert "2 ranks" in key and entry["bands"] == {c: list(b) if b else None for c, b in r["bands"].items()}
        assert r["again"] == ("cache", r["bands"], r["bands_fp32"])
        # The DDP's group decided with the cached bands (all-gather min set to 0 by the user).
        assert len(r["decisions"]) == len(r["expected"])
        for got, want in zip(r["decisions"], r["expected"]):
            if "coalesces" not in got.reason:
                assert (got.symmetric, got.reason) == (want.symmetric, want.reason)
        assert "probed bands for 2 ranks" in r["report"] and "from the cache" in r["report"]


@pytest.mark.gpus(1)
def test_nccl_probe_machinery_on_one_gpu(tmp_path):
    # One rank: timings of NCCL's one-rank copies, not of communication; this checks
    # the probe runs, fills every point, frees its buffers and caches; staging
    # (resolve_config) does not probe a group of one rank.
    from megatron_ext.testing.multirank import run_on_ranks

    from ._bodies import probe_on_one_gpu

    (r,) = run_on_ranks(probe_on_one_gpu, 1, args=(str(tmp_path / "bands.json"),), backend="nccl", timeout=240)
    print("one-GPU probe:", r["seconds"], "s")
    assert r["source"] == "probe" and r["again"] == "cache"
    rows = r["rows"]
    assert len(rows) == len(PROBE_POINTS) * len(PROBE_SIZES)
    assert all(row["plain_us"] >= 0 and row["symmetric_us"] >= 0 for row in rows)
    # One rank's all-gather and reduce-scatter copy (one rank's in-place all-reduce moves nothing).
    assert all(row["plain_us"] > 0 and row["symmetric_us"] > 0 for row in rows if row["collective"] != "all_reduce")
    assert not any(row["host_bound"] for row in r["rows"])
    assert r["allocated_delta"] < PROBE_SIZES[-1], "the probe's 256 MiB buffers must be freed"
    assert r["same"] and any("a group of 1 rank" in n for n in r["notes"])
