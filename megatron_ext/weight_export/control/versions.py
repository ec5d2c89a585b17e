"""The version/ack scheme of every refit path (no communication of its own).

The trainer announces each version before its bytes move, and every engine
answers each announcement, whatever happened to it, with the version its weights
hold afterwards: the new one; the previous one (the version was refused, or an
atomic refit was interrupted); or none (an in-place refit was interrupted after
its first write, so the weights are mixed). The export hook carries these over
its control channel (``begin`` / ``end`` / ``abort``, answered by a
:data:`HOLDS` message), the reshard refit through the refit store (an
announcement key per refit, an ack key per engine rank); both encode them here.
"""

from __future__ import annotations

from ..plan.wire import NO_VERSION

__all__ = ["CLOSE", "HOLDS", "ack", "acked", "announced", "announcement", "describe"]

CLOSE = "close"  # announced instead of a version: no more versions come
HOLDS = "holds"  # the control-channel message an engine answers ``end`` and ``abort`` with


def announcement(version: int | None) -> str:
    """What the trainer announces: ``version``, or :data:`CLOSE` for None."""
    return CLOSE if version is None else str(int(version))


def announced(raw: bytes | str) -> int | None:
    """The version an announcement names (None: the trainer closed)."""
    value = raw.decode() if isinstance(raw, bytes) else raw
    return None if value == CLOSE else int(value)


def ack(held: int | None) -> str:
    """An engine's answer: the version it holds (None: no complete version, written as the bucket
    headers' :data:`~..plan.wire.NO_VERSION`)."""
    return str(NO_VERSION if held is None else int(held))


def acked(raw: bytes | str) -> int | None:
    v = int(raw)
    return None if v == NO_VERSION else v


def describe(held: int | None) -> str:
    """``held`` in a message: "version N" or "no complete version"."""
    return "no complete version" if held is None else f"version {held}"
