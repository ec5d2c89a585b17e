"""Configuration of symmetric-memory staging: mode, size thresholds, flags."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

__all__ = [
    "AB_DEFAULTS",
    "BAND_FIELDS",
    "BANDS",
    "COLLECTIVES",
    "DECIDE_BY",
    "DEFAULT_BANDS",
    "DEFAULT_BANDS_FP32",
    "DEFAULT_BANDS_RANKS",
    "MODES",
    "SymmMemConfig",
    "add_fsdp_symm_args",
]

MODES = ("auto", "on", "off")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
# Where the auto-mode bands come from: "measured" = DEFAULT_BANDS / DEFAULT_BANDS_FP32
# below; "probe" = timed on the machine that runs, at start-up, and cached (probe.py).
BANDS = ("measured", "probe")
# How auto mode decides: "step" = an in-job A/B of whole-model staging arms (plain, the bands, every
# buffer) over the first training steps, the faster kept and cached (step_ab.py); "bands" = per buffer
# by its size band alone.
DECIDE_BY = ("step", "bands")
# The step A/B's schedule: untimed warm-up steps, then ab_rounds rounds in which every arm runs one
# settle step (untimed: the switch and first allocations) and ab_steps timed steps.
AB_DEFAULTS = {"ab_warmup_steps": 5, "ab_steps": 5, "ab_rounds": 3}
# The band fields, in the order of COLLECTIVES: (min, max) of the band for every
# dtype but float32, then (min, max) of the float32 band.
BAND_FIELDS = tuple(
    f"{name}_{prefix}{bound}_bytes" for name in COLLECTIVES for prefix in ("", "fp32_") for bound in ("min", "max")
)

_MIB = 1 << 20

# Default size bands (bytes of the full, unsharded buffer: all-gather output,
# reduce-scatter input, all-reduce buffer) in which NCCL's symmetric kernels were
# not slower than plain buffers (within 1%): for each collective the longest run
# of measured sizes, from ``benchmarks/symm_mem.py`` (CUDA-graph replays, kernel
# time without launch overhead) on 2x H200 (NVLink, NCCL_NVLS_ENABLE=0), torch
# 2.11.0+cu130, NCCL 2.28.9, 2026-11-22
# (benchmarks/results/symm_mem_2xH200_run3_graphs.json; docs/fsdp_symm.md).
# DEFAULT_BANDS hold for bf16 (and are used for every dtype but float32);
# float32 reductions win over a wider range, so they have their own bands.
# Measured plain/symmetric time ratios:
#   all-gather      0.86-1.01 below 1 MiB, 1.02-1.43 at 1-64 MiB, 0.91-0.97 above
#   reduce-scatter  0.71-1.01 below 2 MiB; bf16 1.06-1.11 at 2-4 MiB, 0.92-0.96 at
#                   8-32 MiB; fp32 1.02-1.26 at 2-32 MiB; 0.71-0.91 from 64 MiB
#   all-reduce      0.74-1.06 below 2 MiB; bf16 1.00-1.27 at 2-8 MiB, 0.93-0.94 at
#                   16-32 MiB; fp32 1.06-1.37 at 2-32 MiB; 0.73-0.91 from 64 MiB
DEFAULT_BANDS: dict[str, tuple[int, int]] = {
    "all_gather": (1 * _MIB, 64 * _MIB),
    "reduce_scatter": (2 * _MIB, 4 * _MIB),
    "all_reduce": (2 * _MIB, 8 * _MIB),
}
DEFAULT_BANDS_FP32: dict[str, tuple[int, int]] = {
    "all_gather": (1 * _MIB, 64 * _MIB),
    "reduce_scatter": (2 * _MIB, 32 * _MIB),
    "all_reduce": (2 * _MIB, 32 * _MIB),
}
# The number of ranks of the group the default bands were measured with.
DEFAULT_BANDS_RANKS = 2
# Timed steps per arm the step A/B needs at least (a median and a spread of them).
MIN_AB_SAMPLES = 3


@dataclasses.dataclass
class SymmMemConfig:
    """How buffers are staged in NCCL symmetric memory.

    ``mode``: ``"auto"`` uses symmetric memory for a bucket only when its size lies
    in the band measured to be faster for its collective; ``"on"`` uses it for
    every bucket; ``"off"`` never does. In every mode a process group that cannot
    run NCCL symmetric kernels (not NCCL, NCCL < 2.27, a torch without the
    symmetric-memory pool, ranks without peer access) falls back to plain buffers
    with one warning.

    The ``*_min_bytes`` / ``*_max_bytes`` fields bound the band per collective, in
    bytes of the full buffer (all-gather output, reduce-scatter input, all-reduce
    buffer); ``min <= size <= max`` selects symmetric memory in ``auto`` mode.
    They apply to every dtype except float32 buffers, which use the
    ``*_fp32_min_bytes`` / ``*_fp32_max_bytes`` fields. An fp32 field left at
    ``None`` means: the measured fp32 default while that collective's band is at
    its default, otherwise that collective's band (so setting a band alone
    applies it to every dtype).
    ``bands`` says where the bands come from: ``"measured"`` (default) keeps the
    fields as they are, whose defaults were measured on 2x H200 at 2 ranks;
    ``"probe"`` replaces every band field the user did not set by bands timed on
    the machine that runs, once per group of ranks at start-up and cached in the
    JSON file ``probe_cache`` (``None``: ``~/.cache/megatron_ext/symm_mem_bands.json``);
    see :func:`megatron_ext.fsdp_symm.probe.resolve_config`. An fp32 field counts
    as set when it is not ``None``, any other band field when it differs from its
    default or is named in ``pinned_bands`` (:meth:`from_args` names there every
    field whose flag was given, so a flag equal to the default counts as set).
    With ``"probe"``, ``min <= max`` is checked for bands whose two bounds are
    set; a set bound beyond the probed other bound means no symmetric buffers
    for that band.
    ``report`` logs, once at start-up, which buckets use symmetric memory and why.

    ``decide_by`` says how ``auto`` decides: ``"step"`` (default) runs an A/B of
    whole-model arms in the job itself: ``plain`` (no buffer symmetric), ``bands``
    (the per-buffer bands above) and ``on`` (every buffer NCCL has a symmetric
    kernel for), each for ``ab_steps`` timed steps in each of ``ab_rounds`` rounds
    after ``ab_warmup_steps`` untimed steps, and keeps plain unless an arm's median
    step is faster by more than the noise (:func:`megatron_ext.fsdp_symm.step_ab.choose_arm`);
    the choice is cached in ``probe_cache`` per machine, ranks, versions and
    buffer layout, so later jobs start with it. ``"bands"`` decides each buffer by
    its band alone (no A/B).
    """

    mode: str = "auto"
    all_gather_min_bytes: int = DEFAULT_BANDS["all_gather"][0]
    all_gather_max_bytes: int = DEFAULT_BANDS["all_gather"][1]
    reduce_scatter_min_bytes: int = DEFAULT_BANDS["reduce_scatter"][0]
    reduce_scatter_max_bytes: int = DEFAULT_BANDS["reduce_scatter"][1]
    all_reduce_min_bytes: int = DEFAULT_BANDS["all_reduce"][0]
    all_reduce_max_bytes: int = DEFAULT_BANDS["all_reduce"][1]
    all_gather_fp32_min_bytes: int | None = None
    all_gather_fp32_max_bytes: int | None = None
    reduce_scatter_fp32_min_bytes: int | None = None
    reduce_scatter_fp32_max_bytes: int | None = None
    all_reduce_fp32_min_bytes: int | None = None
    all_reduce_fp32_max_bytes: int | None = None
    report: bool = True
    bands: str = "measured"
    probe_cache: str | None = None
    pinned_bands: tuple[str, ...] = ()
    decide_by: str = "step"
    ab_warmup_steps: int = AB_DEFAULTS["ab_warmup_steps"]
    ab_steps: int = AB_DEFAULTS["ab_steps"]
    ab_rounds: int = AB_DEFAULTS["ab_rounds"]

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"SymmMemConfig.mode must be one of {', '.join(map(repr, MODES))}; got {self.mode!r}")
        if self.decide_by not in DECIDE_BY:
            raise ValueError(
                f"SymmMemConfig.decide_by must be one of {', '.join(map(repr, DECIDE_BY))}; got {self.decide_by!r} "
                "('step': an A/B of plain / bands / on over the first training steps; 'bands': per buffer by its "
                "size band)"
            )
        for field, least in (("ab_warmup_steps", 0), ("ab_steps", 1), ("ab_rounds", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"SymmMemConfig.{field} must be an int >= {least}; got {value!r}")
        if self.ab_steps * self.ab_rounds < MIN_AB_SAMPLES:
            raise ValueError(
                f"SymmMemConfig.ab_steps x ab_rounds must be >= {MIN_AB_SAMPLES} (timed steps per arm, for the "
                f"spread the decision's noise rule needs); got {self.ab_steps} x {self.ab_rounds}"
            )
        if self.bands not in BANDS:
            raise ValueError(
                f"SymmMemConfig.bands must be one of {', '.join(map(repr, BANDS))}; got {self.bands!r} "
                "('measured': the shipped 2-rank bands; 'probe': measure on this machine at start-up)"
            )
        if self.probe_cache is not None:
            if isinstance(self.probe_cache, os.PathLike):
                self.probe_cache = os.fspath(self.probe_cache)
            if not isinstance(self.probe_cache, str) or not self.probe_cache:
                raise ValueError(
                    f"SymmMemConfig.probe_cache must be None (the default file) or a non-empty path; "
                    f"got {self.probe_cache!r}"
                )
        if not isinstance(self.pinned_bands, (tuple, list, set, frozenset)) or not all(
            isinstance(f, str) for f in self.pinned_bands
        ):
            raise ValueError(
                f"SymmMemConfig.pinned_bands must be a tuple of band field names; got {self.pinned_bands!r}"
            )
        unknown = sorted(set(self.pinned_bands) - set(BAND_FIELDS))
        if unknown:
            raise ValueError(
                f"SymmMemConfig.pinned_bands has unknown fields {unknown}; allowed: {', '.join(BAND_FIELDS)}"
            )
        self.pinned_bands = tuple(f for f in BAND_FIELDS if f in self.pinned_bands)
        # With bands="probe", a bound left unset is the probe's: min <= max can
        # only be checked when both are set (resolve_config handles the rest).
        given = set(self.set_band_fields()) if self.bands == "probe" else set(BAND_FIELDS)
        for name in COLLECTIVES:
            lo_field, hi_field = f"{name}_min_bytes", f"{name}_max_bytes"
            lo, hi = getattr(self, lo_field), getattr(self, hi_field)
            for field, value in ((lo_field, lo), (hi_field, hi)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"SymmMemConfig.{field} must be an int >= 0 (bytes); got {value!r}")
            if lo > hi and {lo_field, hi_field} <= given:
                raise ValueError(
                    f"SymmMemConfig.{lo_field} ({lo}) must be <= {hi_field} ({hi}); "
                    f"raise {hi_field} or lower {lo_field}"
                )
            lo_field, hi_field = f"{name}_fp32_min_bytes", f"{name}_fp32_max_bytes"
            for field in (lo_field, hi_field):
                value = getattr(self, field)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                    raise ValueError(f"SymmMemConfig.{field} must be None or an int >= 0 (bytes); got {value!r}")
            lo, hi = self.band(name, "float32")
            if lo > hi and {lo_field, hi_field} <= given:
                raise ValueError(
                    f"SymmMemConfig.{lo_field} ({lo}) must be <= {hi_field} ({hi}) (the float32 "
                    f"band; None fields take the {name} band or its fp32 default); "
                    f"raise {hi_field} or lower {lo_field}"
                )
        if not isinstance(self.report, bool):
            raise ValueError(f"SymmMemConfig.report must be a bool; got {self.report!r}")

    def band(self, collective: str, dtype=None) -> tuple[int, int]:
        """The ``(min_bytes, max_bytes)`` band of ``collective`` for buffers of
        ``dtype`` (a ``torch.dtype`` or its name; ``None``: not float32)."""
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {', '.join(map(repr, COLLECTIVES))}; got {collective!r}")
        band = getattr(self, f"{collective}_min_bytes"), getattr(self, f"{collective}_max_bytes")
        if str(dtype).removeprefix("torch.") != "float32":
            return band
        fallback = DEFAULT_BANDS_FP32[collective] if band == DEFAULT_BANDS[collective] else band
        lo, hi = getattr(self, f"{collective}_fp32_min_bytes"), getattr(self, f"{collective}_fp32_max_bytes")
        return (fallback[0] if lo is None else lo), (fallback[1] if hi is None else hi)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SymmMemConfig":
        """Build the config from flags added by :func:`add_fsdp_symm_args`."""
        kwargs = {
            "mode": args.symm_mem,
            "report": not args.symm_mem_no_report,
            "bands": getattr(args, "symm_mem_bands", "measured"),
            "probe_cache": getattr(args, "symm_mem_probe_cache", None),
            "decide_by": getattr(args, "symm_mem_decide_by", "step"),
        }
        for field, default in AB_DEFAULTS.items():
            value = getattr(args, f"symm_mem_{field}", None)
            kwargs[field] = default if value is None else value
        pinned = []
        for name in COLLECTIVES:
            for prefix in ("", "fp32_"):
                flag = f"{prefix}{name}".replace("_", "-")
                for bound in ("min", "max"):
                    mib = getattr(args, f"symm_mem_{prefix}{name}_{bound}_mib")
                    if mib is not None:
                        # nan and inf would fail below in int(round(...)) without naming the flag.
                        if not (math.isfinite(mib) and mib >= 0):
                            raise ValueError(f"--symm-mem-{flag}-{bound}-mib must be >= 0 and finite (MiB); got {mib}")
                        kwargs[f"{name}_{prefix}{bound}_bytes"] = int(round(mib * _MIB))
                        pinned.append(f"{name}_{prefix}{bound}_bytes")
        return cls(**kwargs, pinned_bands=tuple(pinned))

    def set_band_fields(self) -> tuple[str, ...]:
        """The band fields the user set: fp32 fields that are not ``None``; the
        others when named in ``pinned_bands`` or different from their default.
        ``bands="probe"`` keeps them."""
        out = []
        for field in BAND_FIELDS:
            value = getattr(self, field)
            name, bound = field.removesuffix("_bytes").rsplit("_", 1)
            if name.endswith("_fp32"):
                given = value is not None
            else:
                given = field in self.pinned_bands or value != DEFAULT_BANDS[name][0 if bound == "min" else 1]
            if given:
                out.append(field)
        return tuple(out)


def _int_at_least(least: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}; got {text!r}")
        return value

    return parse


def add_fsdp_symm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--symm-mem*`` flags of :class:`SymmMemConfig` to ``parser``."""
    group = parser.add_argument_group("NCCL symmetric-memory staging (megatron_ext.fsdp_symm)")
    group.add_argument(
        "--symm-mem",
        choices=MODES,
        default="auto",
        help="Stage collective buffers in NCCL symmetric memory: auto (what makes the training step faster: "
        "see --symm-mem-decide-by), on (all buckets), off (never). Default: auto.",
    )
    for name in COLLECTIVES:
        flag = name.replace("_", "-")
        lo, hi = DEFAULT_BANDS[name]
        group.add_argument(
            f"--symm-mem-{flag}-min-mib",
            type=float,
            default=None,
            help=f"auto mode: smallest {name} buffer (MiB) to stage in symmetric memory (default {lo / _MIB:g}).",
        )
        group.add_argument(
            f"--symm-mem-{flag}-max-mib",
            type=float,
            default=None,
            help=f"auto mode: largest {name} buffer (MiB) to stage in symmetric memory (default {hi / _MIB:g}).",
        )
        lo, hi = DEFAULT_BANDS_FP32[name]
        for bound, value in (("min", lo), ("max", hi)):
            group.add_argument(
                f"--symm-mem-fp32-{flag}-{bound}-mib",
                type=float,
                default=None,
                help=f"auto mode, float32 buffers: {'smallest' if bound == 'min' else 'largest'} "
                f"{name} buffer (MiB) to stage in symmetric memory (default {value / _MIB:g} "
                f"while the {name} band is at its default, else that band).",
            )
    group.add_argument(
        "--symm-mem-bands",
        choices=BANDS,
        default="measured",
        help="Where auto mode's size bands come from: measured (the shipped bands, measured on 2x H200 "
        "at 2 ranks) or probe (time plain vs symmetric collectives on this machine at start-up, a few "
        "seconds per group of ranks, cached; band flags given here still win). Default: measured.",
    )
    group.add_argument(
        "--symm-mem-probe-cache",
        default=None,
        metavar="PATH",
        help="JSON file of probed bands (--symm-mem-bands probe) and of step A/B choices (--symm-mem-decide-by "
        "step); default ~/.cache/megatron_ext/symm_mem_bands.json. Delete an entry or the file to measure again.",
    )
    group.add_argument(
        "--symm-mem-decide-by",
        choices=DECIDE_BY,
        default="step",
        help="How auto mode decides: step (an A/B of plain, the bands and every buffer symmetric over the first "
        "training steps, the faster kept unless within the noise, cached per machine, ranks, versions and "
        "buffer layout) or bands (per buffer by its size band). Default: step.",
    )
    for field, default in AB_DEFAULTS.items():
        what = {
            "ab_warmup_steps": "untimed steps before the A/B",
            "ab_steps": "timed steps per arm and round",
            "ab_rounds": "rounds of the A/B (arms in alternating order)",
        }[field]
        group.add_argument(
            f"--symm-mem-{field.replace('_', '-')}",
            type=_int_at_least(0 if field == "ab_warmup_steps" else 1),
            default=None,
            metavar="N",
            help=f"step A/B: {what} (default {default}).",
        )
    group.add_argument(
        "--symm-mem-no-report",
        action="store_true",
        help="Do not log which buckets use symmetric memory at start-up.",
    )
    return parser
