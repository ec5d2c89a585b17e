"""Per-bucket choice between symmetric and plain staging, and the start-up report."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from .config import COLLECTIVES, SymmMemConfig

__all__ = ["ARMS", "Decision", "arm_decisions", "decide", "format_report", "Reporter", "REPORTER"]

logger = logging.getLogger("megatron_ext.fsdp_symm")

# The whole-model staging arms auto mode's step A/B compares (step_ab.py): no buffer
# symmetric, the size bands' choice per buffer, every buffer with a symmetric kernel.
ARMS = ("plain", "bands", "on")


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether one collective buffer is staged in symmetric memory, and why."""

    collective: str
    nbytes: int
    symmetric: bool
    reason: str


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.3g} MiB"


# NCCL's symmetric kernels reduce only floating types of at most 32 bits, with SUM.
_REDUCIBLE = {"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}


def decide(collective: str, nbytes: int, config: SymmMemConfig, unavailable: str | None = None, dtype=None) -> Decision:
    """Choose staging for a ``collective`` over a full buffer of ``nbytes``.

    ``unavailable`` is the capability probe's reason when this process group
    cannot run symmetric kernels (``None`` when it can). ``dtype`` (a
    ``torch.dtype``), when given, rules out reductions NCCL has no symmetric
    kernel for (anything but floats of at most 32 bits) and picks the band
    (float32 buffers have their own, see :class:`SymmMemConfig`).
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(map(repr, COLLECTIVES))}; got {collective!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0; got {nbytes}")
    if config.mode == "off":
        return Decision(collective, nbytes, False, "mode=off")
    if unavailable is not None:
        return Decision(collective, nbytes, False, f"unavailable: {unavailable}")
    if dtype is not None and collective != "all_gather":
        name = str(dtype).removeprefix("torch.")
        if name not in _REDUCIBLE:
            return Decision(collective, nbytes, False, f"{name}: no symmetric reduction kernel (floats <= 32 bit only)")
    if config.mode == "on":
        return Decision(collective, nbytes, True, "mode=on")
    lo, hi = config.band(collective, dtype)
    auto = "auto (fp32 band)" if str(dtype).removeprefix("torch.") == "float32" else "auto"
    if nbytes < lo:
        return Decision(collective, nbytes, False, f"{auto}: {_mib(nbytes)} < min {_mib(lo)}")
    if nbytes > hi:
        return Decision(collective, nbytes, False, f"{auto}: {_mib(nbytes)} > max {_mib(hi)}")
    return Decision(collective, nbytes, True, f"{auto}: {_mib(lo)} <= {_mib(nbytes)} <= {_mib(hi)}")


def arm_decisions(
    collective: str, nbytes: int, config: SymmMemConfig, unavailable: str | None = None, dtype=None
) -> dict[str, Decision]:
    """Per arm of :data:`ARMS`, the decision for one buffer (see :func:`decide`
    for the arguments; ``config``'s mode is ignored: ``bands`` decides with its
    bands, ``on`` as mode ``on``). A buffer that cannot be symmetric (the group
    is unavailable, no symmetric kernel for its dtype) has the same plain
    decision, with the reason, in every arm."""
    on = decide(collective, nbytes, dataclasses.replace(config, mode="on"), unavailable, dtype)
    if not on.symmetric:
        return dict.fromkeys(ARMS, on)
    bands = decide(collective, nbytes, dataclasses.replace(config, mode="auto"), unavailable, dtype)
    return {
        "plain": Decision(collective, nbytes, False, "step A/B arm plain"),
        "bands": dataclasses.replace(bands, reason=f"step A/B arm bands, {bands.reason}"),
        "on": Decision(collective, nbytes, True, "step A/B arm on"),
    }


def format_report(rows: list[tuple[str, Decision]], notes: Sequence[str] = ()) -> str:
    """A table of ``(bucket name, decision)`` rows, then ``notes`` (where the
    bands came from), one line each."""
    n_symm = sum(d.symmetric for _, d in rows)
    lines = [f"symmetric-memory staging: {n_symm} of {len(rows)} collective buffers symmetric"]
    width = max([len(name) for name, _ in rows] + [6])
    lines.append(f"  {'bucket':<{width}}  {'collective':<14} {'size':>11}  staging    why")
    for name, d in rows:
        staging = "symmetric" if d.symmetric else "plain"
        lines.append(f"  {name:<{width}}  {d.collective:<14} {_mib(d.nbytes):>11}  {staging:<9}  {d.reason}")
    lines += [f"  note: {note}" for note in notes]
    return "\n".join(lines)


class Reporter:
    """Collects decisions as buffers are built; logs them once, at first use."""

    def __init__(self):
        self.pending: list[tuple[str, Decision]] = []
        self.notes: list[str] = []
        self.last_report: str | None = None

    def add(self, name: str, decision: Decision) -> None:
        self.pending.append((name, decision))

    def note(self, text: str) -> None:
        """Add a line under the next report (once, however often it is added)."""
        if text not in self.notes:
            self.notes.append(text)

    def flush(self, enabled: bool = True) -> str | None:
        """Log the pending decisions and notes (rank 0 only) and return the text;
        ``None`` if there are none."""
        if not self.pending and not self.notes:
            return None
        text = format_report(self.pending, self.notes)
        self.pending, self.notes = [], []
        self.last_report = text
        if enabled and _is_rank0():
            logger.warning(text)
        return text


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


REPORTER = Reporter()
