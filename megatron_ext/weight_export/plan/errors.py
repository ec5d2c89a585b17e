"""The refit's one error family: every failure of the export hook and the reshard
refit is a :class:`RefitError`, so a training loop can catch one class. Each
subclass keeps the built-in base it had (``ValueError`` for refused input,
``RuntimeError`` for a failed peer or transfer). Also :class:`RefitStats`, one
rank's refit, which a :class:`RefitRejected` carries."""

from __future__ import annotations

import dataclasses

__all__ = [
    "ControlError",
    "NonFiniteWeights",
    "PlanMismatch",
    "ReceiverError",
    "RefitError",
    "RefitGroupError",
    "RefitRejected",
    "RefitStats",
]


class RefitError(Exception):
    """A refit (export hook or reshard refit) failed or refused a version; the
    message says what happened and to which peer or tensor."""


class ControlError(RefitError, RuntimeError):
    """The peer broke the protocol, failed authentication, went away, or did not answer in time."""


class ReceiverError(ControlError):
    """A receiver refused, died or did not answer in time."""


class PlanMismatch(RefitError, ValueError):
    """The receiver's model does not match the plan; nothing was written."""


class NonFiniteWeights(RefitError, ValueError):
    """A version had NaN or Inf weights; it was not published (the engines keep the
    version they had, or, after an in-place write, report that they hold none). ``names``:
    the HF tensors with a NaN or Inf, where the raiser knows them."""

    def __init__(self, message: str, *, names: list[str] | None = None):
        super().__init__(message)
        self.names = list(names or [])

    @classmethod
    def found(cls, version: int, names: list[str], then: str = "") -> "NonFiniteWeights":
        """``version has NaN/Inf in N tensor(s): <the first 5 names>[; then]``."""
        more = " ..." if len(names) > 5 else ""
        text = f"version {version} has NaN/Inf in {len(names)} tensor(s): {', '.join(names[:5])}{more}"
        return cls(f"{text}; {then}" if then else text, names=names)


class RefitRejected(RefitError, RuntimeError):
    """A rank refused a version. ``reason``:

    - ``"version"``: a source serves another version (or none);
    - ``"plan"``: a rank runs another plan or bucket size;
    - ``"staging"``: a rank could not allocate its staging buffers;
    - ``"tensors"``: a rank's tensors are not the layout's (a missing name, another
      shape or dtype, not contiguous); that rank's message says which, the others
      quote it;
    - ``"nonfinite"``: a bucket carried a NaN or Inf (its header says so: the copies
      that packed it flagged it), or this rank sent or copies one; the sender names
      the HF tensor and box, a receiver the bucket's tensors;
    - ``"gate"``: the :class:`~..engines.gate.RefitGate` failed (including non-finite logits).

    ``"plan"``, ``"staging"`` and ``"tensors"`` are raised on every rank at the first
    refit, before a byte moves: no tensor was written. ``"version"`` and ``"nonfinite"``
    are raised by the ranks whose data carries it, after the rounds: an atomic
    receiver wrote nothing; a streaming one wrote nothing if the bad bucket came in
    its first round, else it holds no complete version (``version`` None). On
    ``"gate"`` the bytes are written but the rank holds no accepted version
    (``version`` is None) and does not serve in a fan-out."""

    def __init__(self, message: str, *, reason: str, stats: RefitStats | None = None):
        super().__init__(message)
        self.reason, self.stats = reason, stats
        self.wave_stats: list[RefitStats] | None = None  # FanoutRefit: this rank's stats of every wave


class RefitGroupError(RefitError, RuntimeError):
    """A refit peer is missing, died, or did not answer within the group's timeout."""


@dataclasses.dataclass
class RefitStats:
    """One rank's refit. Byte counts are on the wire (headers and alignment included);
    ``staging_bytes`` is the staging memory this rank holds; ``kl`` /
    ``max_logit_diff`` / ``gate_ok`` are set when a :class:`~..engines.gate.RefitGate` ran."""

    version: int
    seconds: float
    sent_bytes: int
    received_bytes: int
    local_bytes: int
    rounds: int
    max_inflight: int = 1
    staging_bytes: int = 0
    kl: float | None = None
    max_logit_diff: float | None = None
    gate_ok: bool | None = None
