"""``auto`` decided by the training step: an in-job A/B of whole-model staging arms, cached.

The size bands come from collectives timed alone. In a training step a collective
runs beside compute, and there NCCL's symmetric kernels also leave SMs and copy
engines to the compute they overlap: on 4x H200 the 1.5B FSDP step gained 16.6%
with every buffer symmetric and 9.5% with the bands' choice (docs/fsdp_symm.md).
So ``SymmMemConfig(mode="auto", decide_by="step")`` (the default) times the step
itself, in the job, over its first steps:

- arms (:data:`~megatron_ext.fsdp_symm.policy.ARMS`): ``plain`` (no buffer
  symmetric), ``bands`` (the per-buffer band decisions), ``on`` (every buffer
  NCCL has a symmetric kernel for); arms that stage the same buffers as another
  are dropped;
- schedule (:func:`ab_schedule`): ``ab_warmup_steps`` untimed steps in the plain
  arm, then ``ab_rounds`` rounds, the arms in alternating order (plain, bands,
  on; on, bands, plain; ...) so that a drift over the steps favours no arm; in
  each round every arm runs one untimed settle step (the switch: buffers moved
  between plain and symmetric memory, first allocations, window registrations)
  and ``ab_steps`` timed steps. A step's time is the time between two step
  starts on the device (CUDA events), the slowest rank's (one all-reduce at the
  end);
- decision (:func:`choose_arm`, a pure function of the timings): keep plain
  unless an arm's median step is shorter than plain's by more than the noise
  threshold ``max(MIN_GAIN x plain's median, Z x the standard error of the
  difference of the two medians)``, the standard errors from each arm's
  step-to-step spread (1.4826 x the median absolute deviation); of the arms past
  the threshold, the fastest. See :func:`noise_threshold_ms` for why these
  numbers;
- the choice is applied on every rank alike (same agreed timings, same rule) and
  cached in the band cache file (``probe_cache``) under the machine's key (GPU,
  interconnect, ranks, NCCL, torch, NCCL variables: :func:`~megatron_ext.fsdp_symm.probe.cache_key`),
  the family (ddp, fsdp) and a signature of the buffer layout (every buffer's
  collective, dtype, size and arm flags): a later job of the same model on the
  same machine starts in the cached arm and times nothing.

Switching arms keeps every tensor object: a buffer's storage moves between the
caching allocator and the symmetric pool (``memory.move_storage``), so the
views the optimizer and Megatron hold stay valid. Until the A/B decides, the
job trains in whichever arm runs; the arms compute the same thing.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .config import MIN_AB_SAMPLES
from .policy import ARMS

__all__ = [
    "AB_VERSION",
    "ABChoice",
    "ArmStats",
    "MIN_GAIN",
    "SETTLE_STEPS",
    "StepAB",
    "Z",
    "ab_cache_key",
    "ab_schedule",
    "arm_stats",
    "choose_arm",
    "layout_signature",
    "lookup_choice",
    "noise_threshold_ms",
    "samples_by_arm",
]

logger = logging.getLogger("megatron_ext.fsdp_symm")

# Part of every cache key: a changed A/B method decides again.
AB_VERSION = 1
# The noise rule (noise_threshold_ms): z of the one-sided test, and the smallest gain worth an arm.
Z = 3.0
MIN_GAIN = 0.01
# Untimed steps at the start of every window (the switch, first allocations and registrations).
SETTLE_STEPS = 1
_MAD_TO_SIGMA = 1.4826  # the MAD of normal samples is 0.6745 sigma
_MEDIAN_SE = math.sqrt(math.pi / 2)  # SE of a median of n normal samples: 1.2533 sigma / sqrt(n)


# --------------------------------------------------------------------------- the decision (pure)
@dataclasses.dataclass(frozen=True)
class ArmStats:
    """The timed steps of one arm: how many, their median, their spread (robust
    sigma: 1.4826 x the median absolute deviation) and the standard error of the
    median (1.2533 x sigma / sqrt(n)), in ms."""

    arm: str
    n: int
    median_ms: float
    sigma_ms: float
    se_ms: float


def arm_stats(arm: str, samples_ms: Sequence[float]) -> ArmStats:
    """:class:`ArmStats` of ``samples_ms`` (step times in ms, at least
    ``MIN_AB_SAMPLES``, finite and positive)."""
    values = [float(v) for v in samples_ms]
    if len(values) < MIN_AB_SAMPLES:
        raise ValueError(f"arm {arm!r}: {len(values)} timed steps; the noise rule needs at least {MIN_AB_SAMPLES}")
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"arm {arm!r}: step times must be finite and > 0 ms; got {values}")
    median = statistics.median(values)
    sigma = _MAD_TO_SIGMA * statistics.median(abs(v - median) for v in values)
    return ArmStats(arm, len(values), median, sigma, _MEDIAN_SE * sigma / math.sqrt(len(values)))


def noise_threshold_ms(plain: ArmStats, other: ArmStats, z: float = Z, min_gain: float = MIN_GAIN) -> float:
    """How much shorter than plain's an arm's median step must be to be kept:
    ``max(min_gain x plain's median, z x sqrt(se_plain^2 + se_other^2))``.

    Why. The two medians differ by noise alone with standard error
    ``sqrt(se_plain^2 + se_other^2)``; requiring ``z = 3`` of them makes picking an
    arm that is in truth not faster a 0.13% event (one-sided, normal noise), and
    an arm slower by ``d`` rarer still. So ``auto`` is the slower choice only
    within the noise. The floor ``min_gain = 1%`` is the tolerance of the target
    it serves (``auto >= max(on, plain) - 1%``): a gain smaller than that may be
    left, and plain (no pool memory, no windows) is kept for it. On the recorded
    4x H200 run (5 repetitions of 10 steps per variant as samples) the rule asks
    FSDP ``on`` for 15.3 ms (it gained 26.9) and the bands for 7.6 ms (they gained
    16.3), DDP ``on`` for 10.8 ms (its median was 0.2 ms slower than plain's):
    docs/fsdp_symm.md, "auto decided by the step".
    """
    if not (z >= 0 and min_gain >= 0):
        raise ValueError(f"z and min_gain must be >= 0; got {z}, {min_gain}")
    return max(min_gain * plain.median_ms, z * math.hypot(plain.se_ms, other.se_ms))


@dataclasses.dataclass(frozen=True)
class ABChoice:
    """The A/B's outcome: the arm kept and why, with every arm's
    :class:`ArmStats`, gain over plain (plain's median - the arm's, ms) and
    threshold (:func:`noise_threshold_ms`)."""

    arm: str
    reason: str
    stats: dict
    gain_ms: dict
    threshold_ms: dict

    def as_dict(self) -> dict:
        return dict(
            arm=self.arm,
            reason=self.reason,
            stats={a: dataclasses.asdict(s) for a, s in self.stats.items()},
            gain_ms=dict(self.gain_ms),
            threshold_ms=dict(self.threshold_ms),
        )


def choose_arm(samples: Mapping[str, Sequence[float]], *, z: float = Z, min_gain: float = MIN_GAIN) -> ABChoice:
    """The arm to keep, from each arm's timed step times (ms).

    ``samples`` maps arm names of :data:`ARMS` to step times; ``plain`` is
    required. Plain is kept unless some arm's median is shorter than plain's by
    more than :func:`noise_threshold_ms`; of the arms that are, the one with the
    shortest median (equal medians: the earlier in :data:`ARMS`, fewer symmetric
    buffers)."""
    unknown = sorted(set(samples) - set(ARMS))
    if unknown:
        raise ValueError(f"unknown arms {unknown}; allowed: {', '.join(ARMS)}")
    if "plain" not in samples:
        raise ValueError("samples must include the plain arm (the baseline every other arm must beat)")
    stats = {arm: arm_stats(arm, samples[arm]) for arm in ARMS if arm in samples}
    plain = stats["plain"]
    gains = {a: plain.median_ms - s.median_ms for a, s in stats.items() if a != "plain"}
    thresholds = {a: noise_threshold_ms(plain, s, z, min_gain) for a, s in stats.items() if a != "plain"}
    past = [a for a in gains if gains[a] > thresholds[a]]
    if past:
        arm = min(past, key=lambda a: (stats[a].median_ms, ARMS.index(a)))
        pct = 100.0 * gains[arm] / stats[arm].median_ms
        reason = (
            f"{arm}: {stats[arm].median_ms:.2f} vs plain {plain.median_ms:.2f} ms/step ({pct:+.1f}% tokens/s), "
            f"faster by {gains[arm]:.2f} ms > noise threshold {thresholds[arm]:.2f} ms"
        )
    else:
        arm = "plain"
        if gains:
            best = max(gains, key=lambda a: gains[a] - thresholds[a])
            reason = (
                f"plain: no arm faster by more than the noise (best {best}: {stats[best].median_ms:.2f} vs plain "
                f"{plain.median_ms:.2f} ms/step, {gains[best]:+.2f} ms, threshold {thresholds[best]:.2f} ms)"
            )
        else:
            reason = "plain: the only arm"
    return ABChoice(arm, reason, stats, gains, thresholds)


def ab_schedule(arms: Sequence[str], rounds: int, steps: int, settle: int = SETTLE_STEPS) -> tuple:
    """``(arm, timed)`` for every step of the A/B after its warm-up: ``rounds``
    rounds, the arms in ``arms``' order in even rounds and reversed in odd ones;
    per round and arm ``settle`` untimed steps, then ``steps`` timed ones.
    ``arms`` start with ``plain`` (the arm the model is built in)."""
    arms = tuple(arms)
    if not arms or arms[0] != "plain" or len(set(arms)) != len(arms) or set(arms) - set(ARMS):
        raise ValueError(f"arms must be distinct names of {ARMS}, plain first; got {arms}")
    if rounds < 1 or steps < 1 or settle < 0:
        raise ValueError(f"rounds and steps must be >= 1, settle >= 0; got {rounds}, {steps}, {settle}")
    plan = []
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            plan += [(arm, False)] * settle + [(arm, True)] * steps
    return tuple(plan)


def samples_by_arm(plan: Sequence[tuple[str, bool]], durations_ms: Sequence[float]) -> dict[str, list[float]]:
    """The timed steps' times of ``plan`` (:func:`ab_schedule`) per arm."""
    if len(plan) != len(durations_ms):
        raise ValueError(f"{len(durations_ms)} step times for a plan of {len(plan)} steps")
    out: dict[str, list[float]] = {}
    for (arm, timed), ms in zip(plan, durations_ms):
        out.setdefault(arm, [])
        if timed:
            out[arm].append(float(ms))
    return out


# --------------------------------------------------------------------------- the cache
def layout_signature(rows: Sequence[tuple]) -> str:
    """A short name of a model's buffer layout: ``rows`` are per buffer
    ``(collective, dtype, bytes, symmetric per arm...)`` in staging order."""
    digest = hashlib.sha1(repr([tuple(r) for r in rows]).encode()).hexdigest()[:16]
    return f"{len(rows)} buffers {sum(int(r[2]) for r in rows) / (1 << 20):.0f} MiB {digest}"


def ab_cache_key(family: str, signature: str, ranks: int, device) -> str:
    """The cache key of a step A/B choice: the machine's band key
    (:func:`~megatron_ext.fsdp_symm.probe.cache_key`: GPU, interconnect, ranks,
    NCCL, torch, NCCL variables), the A/B's version, the family and the buffer
    layout's :func:`layout_signature`."""
    from .probe import cache_key

    return f"{cache_key(ranks, device)} | step A/B {AB_VERSION} | {family} | {signature}"


def _cache_path(path: str | None) -> str:
    from .probe import default_cache_path

    return os.path.expanduser(path) if path else default_cache_path()


def lookup_choice(key: str, arms: Sequence[str], group, path: str | None) -> dict | None:
    """The cached entry of ``key`` (a dict with ``arm`` among ``arms``), or ``None``.
    Collective over ``group``: its first rank reads the file and sends the entry
    (or a miss) to the others. An unreadable file or an entry naming another arm
    warns once and counts as a miss."""
    from .probe import _warn_once, read_cache

    path = _cache_path(path)
    message: list = [None]
    if dist.get_rank(group) == 0:
        entries, problem = read_cache(path)
        if problem is not None:
            _warn_once(path, f"the symmetric-memory cache {path} is unreadable ({problem}); running the step A/B")
        entry = entries.get(key)
        if entry is not None and not (isinstance(entry, dict) and entry.get("arm") in arms):
            _warn_once(path, f"the step A/B entry {key!r} of {path} names no arm of {list(arms)}; running the A/B")
            entry = None
        message = [entry]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    return message[0]


def _store_choice(key: str, path: str | None, choice: ABChoice, steps: int, seconds: float) -> None:
    from .probe import _warn_once, write_entry

    path = _cache_path(path)
    entry = dict(
        choice.as_dict(),
        steps=steps,
        seconds=round(seconds, 3),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    try:
        write_entry(path, key, entry)
    except OSError as exc:
        _warn_once(path, f"cannot write the symmetric-memory cache {path} ({exc}); the step A/B runs again next job")


# --------------------------------------------------------------------------- the run
class CudaClock:
    """Step starts as CUDA events on the current stream (no synchronization until :meth:`sync`)."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def sync(self) -> None:
        torch.cuda.synchronize()


class HostClock:
    """Step starts by the host's clock (CPU tensors)."""

    def mark(self):
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        return (end - start) * 1e3

    def sync(self) -> None:
        pass


class StepAB:
    """The step A/B of one staged model (see the module docstring).

    ``apply(arm)`` stages the model's buffers as ``arm`` says (collective over
    ``group``; every rank calls it at the same step). ``group``: the ranks that
    must agree (every rank of every collective group the model stages; the
    timings are all-reduced over it); ``device``: where that all-reduce's tensor
    lives. ``key`` / ``path``: where the choice is cached (``path`` ``None``:
    the default cache file). ``cached``: a cache entry, which makes the A/B
    start decided in its arm. ``on_decided(ab)`` runs once when the A/B
    decides.

    Call :meth:`boundary` at the start of every training step on every rank
    (DDP: ``zero_grad_buffer``), or :meth:`optimizer_stepped` after every
    optimizer step and :meth:`forward_boundary` at every forward of the root
    module (FSDP). ``clock`` (``mark()``, ``elapsed_ms(a, b)``, ``sync()``)
    defaults to CUDA events on a CUDA device, the host's clock otherwise.
    """

    @classmethod
    def from_config(cls, config, **kwargs) -> StepAB:
        """The A/B a :class:`~megatron_ext.fsdp_symm.config.SymmMemConfig` asks for: its schedule
        (``ab_warmup_steps``, ``ab_rounds``, ``ab_steps``) and cache file (``probe_cache``); the
        other arguments as :class:`StepAB` takes them."""
        return cls(
            warmup=config.ab_warmup_steps,
            rounds=config.ab_rounds,
            steps=config.ab_steps,
            path=config.probe_cache,
            **kwargs,
        )

    def __init__(
        self,
        *,
        label: str,
        arms: Sequence[str],
        apply: Callable[[str], None],
        group,
        device,
        warmup: int,
        rounds: int,
        steps: int,
        key: str,
        path: str | None,
        cached: dict | None = None,
        on_decided: Callable[[StepAB], None] | None = None,
        clock=None,
    ):
        self.label = label
        self.arms = tuple(arms)
        self.apply = apply
        self.group = group
        self.device = torch.device(device)
        self.warmup = warmup
        self.plan = ab_schedule(self.arms, rounds, steps)
        self.key, self.path = key, path
        self.on_decided = on_decided
        self.clock = clock or (CudaClock() if self.device.type == "cuda" else HostClock())
        self.arm = "plain"  # the model is built in the plain arm
        self.switches: list[str] = []  # every arm switched to, in order
        self.steps_seen = 0
        self.seconds = 0.0
        self.durations_ms: list[float] = []
        self.choice: ABChoice | None = None
        self.cached = cached
        self.state = "running"
        self._marks: list = []
        self._t0 = 0.0
        self._pending_step = True  # the first forward starts step 0
        if cached is not None:
            self.state = "cached"
            self._switch(cached["arm"])

    @property
    def total_steps(self) -> int:
        """Steps until the A/B decides (warm-up and plan); it decides at the start of the next one."""
        return self.warmup + len(self.plan)

    def _switch(self, arm: str) -> None:
        if arm != self.arm:
            self.apply(arm)
            self.arm = arm
            self.switches.append(arm)

    def optimizer_stepped(self) -> None:
        """An optimizer step happened: the next :meth:`forward_boundary` starts a step."""
        self._pending_step = True

    def forward_boundary(self) -> None:
        """A forward of the root module: a step boundary when it is the first after an optimizer step."""
        if self._pending_step:
            self._pending_step = False
            self.boundary()

    def boundary(self) -> None:
        """A training step starts (every rank, same step)."""
        i = self.steps_seen
        self.steps_seen += 1
        if self.state != "running":
            return
        k = i - self.warmup
        if k < 0:
            return
        if k == 0:
            self._t0 = time.perf_counter()
        self._marks.append(self.clock.mark())
        if k == len(self.plan):
            self._finish()
            return
        self._switch(self.plan[k][0])

    def _finish(self) -> None:
        self.clock.sync()
        local = [self.clock.elapsed_ms(a, b) for a, b in zip(self._marks, self._marks[1:])]
        self._marks = []
        agreed = torch.tensor(local, dtype=torch.float64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)  # a step takes its slowest rank
        self.durations_ms = agreed.tolist()
        self.choice = choose_arm(samples_by_arm(self.plan, self.durations_ms))
        self._switch(self.choice.arm)
        self.state = "decided"
        self.seconds = time.perf_counter() - self._t0
        first = dist.get_rank(self.group) == 0
        if first:
            _store_choice(self.key, self.path, self.choice, len(self.plan), self.seconds)
            logger.info(
                "megatron_ext.fsdp_symm: %s step A/B (%d steps, %.1f s): %s",
                self.label,
                len(self.plan),
                self.seconds,
                self.choice.reason,
            )
        if self.on_decided is not None:
            self.on_decided(self)

    def summary(self) -> dict:
        """What the A/B did, for reports and benchmark JSON."""
        out = dict(
            label=self.label,
            state=self.state,
            arm=self.arm,
            arms=list(self.arms),
            warmup=self.warmup,
            plan_steps=len(self.plan),
            seconds=self.seconds,
            switches=list(self.switches),
            key=self.key,
        )
        if self.choice is not None:
            out.update(choice=self.choice.as_dict(), durations_ms=list(self.durations_ms))
        if self.cached is not None:
            out.update(cached=dict(self.cached))
        return out

    def note(self) -> str:
        """One line for the start-up report."""
        if self.state == "cached":
            entry = self.cached or {}
            return (
                f"auto by the step: {self.arm} from the cache ({entry.get('date', '?')}: {entry.get('reason', '')}); "
                f"delete the entry to decide again; key {self.key!r}"
            )
        if self.state == "decided" and self.choice is not None:
            return f"auto by the step, A/B of {', '.join(self.arms)} over {len(self.plan)} steps: {self.choice.reason}"
        return (
            f"auto by the step: A/B of {', '.join(self.arms)} after {self.warmup} warm-up steps, over "
            f"{len(self.plan)} steps (plain until then); key {self.key!r}"
        )
