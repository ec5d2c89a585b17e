"""Balanced batch shares: how many micro-batches of each global batch every
data-parallel replica processes.

Megatron gives every replica ``global_batch_size / (micro_batch_size * dp)``
micro-batches. Under NTP a degraded replica computes at ``tp_reduced`` GPUs and
is then the straggler of every step. With balanced shares each replica gets a
number of micro-batches proportional to its throughput (by default its TP
degree), the global batch stays the same, every sample is used exactly once,
and the gradient stays the exact mean over the global batch:

- :class:`BatchShares` holds the per-replica micro-batch counts; pass
  ``shares.num_microbatches()`` to ``get_forward_backward_func()``'s
  ``num_microbatches``.
- :class:`BalancedPretrainingSampler` is a ``batch_sampler`` in the form of
  Megatron's ``MegatronPretrainingSampler``: it yields this replica's
  micro-batches (lists of sample indices) of every global batch.
- ``NonuniformTPDistributedDataParallel(..., batch_shares=shares)`` weights
  each replica's gradient by its share (see :meth:`BatchShares.gradient_weight`).
- :class:`MeasuredBalance` (``--ntp-balance measured``) starts with the shares
  by TP degree, times every replica's compute over the first steps and then
  hands out shares by the measured throughputs, the same on every rank.

See docs/nonuniform_tp.md, section "Balanced batch shares".
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction

__all__ = [
    "BalancedPretrainingSampler",
    "BatchShares",
    "MeasuredBalance",
    "balanced_batch_shares",
    "equal_batch_shares",
    "reduce_loss_over_replicas",
    "shrunk_batch_shares",
]

logger = logging.getLogger(__name__)

SHARE_UNITS = ("microbatch", "sample")


def _this_replica() -> int:
    # Under NTP, get_data_parallel_rank() is the replica index on every rank
    # (spares included; see process_groups.py); in a uniform job it is the DP rank.
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


@dataclasses.dataclass(frozen=True)
class BatchShares:
    """The split of one global batch over the data-parallel replicas.

    Args:
        micro_batch_size: samples per (full) micro-batch.
        microbatches: micro-batches of every global batch per replica, indexed
            by replica (``parallel_state.get_data_parallel_rank()``); each >= 1.
        throughputs: relative throughput per replica the shares were computed
            from (for :meth:`describe` and :attr:`efficiency`); ``None`` if unknown.
        samples: shares in samples (``--ntp-share-unit sample``, :meth:`in_samples`):
            replica ``d`` processes ``samples[d]`` samples in ``microbatches[d] =
            ceil(samples[d] / micro_batch_size)`` micro-batches, the last one partial
            where it does not divide. ``None``: ``microbatches[d] * micro_batch_size``.
        bubble: the pipeline's fill and drain in samples (``pipeline stages - 1`` full micro-batches): a
            replica's step takes as long as ``bubble`` more samples than it processes (1F1B), which
            :attr:`efficiency` counts. 0 without stages.

    Replica ``d`` processes ``num_samples(d)`` samples of every global batch of
    ``global_batch_size`` = their sum. The ``replica`` argument of the methods
    defaults to this rank's replica.
    """

    micro_batch_size: int
    microbatches: tuple[int, ...]
    throughputs: tuple[float, ...] | None = None
    samples: tuple[int, ...] | None = None
    bubble: int = 0

    def __post_init__(self):
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise ValueError(f"BatchShares.micro_batch_size must be an int >= 1, got {self.micro_batch_size!r}")
        counts = tuple(self.microbatches)
        if not counts or any(not isinstance(m, int) or m < 1 for m in counts):
            raise ValueError(
                f"BatchShares.microbatches must list an int >= 1 per replica (every replica needs at least "
                f"one micro-batch), got {self.microbatches!r}"
            )
        object.__setattr__(self, "microbatches", counts)
        if self.samples is not None:
            samples = tuple(self.samples)
            if len(samples) != len(counts) or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 1 or m != -(-n // self.micro_batch_size)
                for n, m in zip(samples, counts)
            ):
                raise ValueError(
                    f"BatchShares.samples must list an int >= 1 per replica with microbatches[d] = "
                    f"ceil(samples[d] / micro_batch_size={self.micro_batch_size}), got samples={self.samples!r} "
                    f"for microbatches={counts!r}; build them with BatchShares.in_samples"
                )
            object.__setattr__(self, "samples", samples)
        if self.throughputs is not None:
            rates = tuple(float(t) for t in self.throughputs)
            if len(rates) != len(counts) or any(not t > 0 or math.isinf(t) for t in rates):
                raise ValueError(
                    f"BatchShares.throughputs must list a finite number > 0 per replica ({len(counts)}), "
                    f"got {self.throughputs!r}"
                )
            object.__setattr__(self, "throughputs", rates)

    @classmethod
    def in_samples(
        cls,
        micro_batch_size: int,
        samples: Sequence[int],
        throughputs: Sequence[float] | None = None,
        bubble: int = 0,
    ) -> "BatchShares":
        """Shares of ``samples[d]`` samples per replica, in micro-batches of ``micro_batch_size``
        (the last one partial where it does not divide)."""
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"BatchShares.micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
        counts = tuple(-(-n // micro_batch_size) if isinstance(n, int) and n > 0 else 0 for n in samples)
        return cls(
            micro_batch_size, counts, None if throughputs is None else tuple(throughputs), tuple(samples), bubble
        )

    @property
    def num_replicas(self) -> int:
        return len(self.microbatches)

    @property
    def sample_counts(self) -> tuple[int, ...]:
        """Samples of every global batch per replica."""
        if self.samples is not None:
            return self.samples
        return tuple(m * self.micro_batch_size for m in self.microbatches)

    @property
    def partial(self) -> bool:
        """Whether some replica's last micro-batch is smaller than ``micro_batch_size``."""
        return any(n % self.micro_batch_size for n in self.sample_counts)

    @property
    def total_microbatches(self) -> int:
        """Micro-batches of one global batch, over all replicas."""
        return sum(self.microbatches)

    @property
    def global_batch_size(self) -> int:
        return sum(self.sample_counts)

    def _replica(self, replica: int | None) -> int:
        replica = _this_replica() if replica is None else replica
        if not 0 <= replica < self.num_replicas:
            raise ValueError(
                f"replica {replica} is out of range: these shares are for {self.num_replicas} replicas "
                f"(0..{self.num_replicas - 1}); build them for the job's data-parallel size"
            )
        return replica

    def num_microbatches(self, replica: int | None = None) -> int:
        """The ``num_microbatches`` to pass to Megatron's forward-backward function."""
        return self.microbatches[self._replica(replica)]

    def num_samples(self, replica: int | None = None) -> int:
        """Samples of every global batch that ``replica`` processes."""
        return self.sample_counts[self._replica(replica)]

    def micro_batch_sizes(self, replica: int | None = None) -> list[int]:
        """The size of each of ``replica``'s micro-batches, in order (all ``micro_batch_size``
        but a partial last one)."""
        n = self.num_samples(replica)
        full, rest = divmod(n, self.micro_batch_size)
        return [self.micro_batch_size] * full + ([rest] if rest else [])

    def gradient_weight(self, replica: int | None = None) -> float:
        """Weight of ``replica``'s gradient in the global mean:
        ``num_samples(replica) / global_batch_size``.

        Megatron's forward-backward function divides each micro-batch loss by
        the replica's own ``num_microbatches``, so a replica's gradient is the
        mean over its micro-batches; weighting it by its share of the global
        batch gives the mean over all samples of the global batch, as
        Megatron's ``1 / data_parallel_size`` does for equal shares -- exactly
        where every micro-batch is full. With a partial micro-batch the mean
        over micro-batches weighs its samples more, so such shares need
        ``calculate_per_token_loss`` (the DDP refuses them otherwise), where the
        weights are 1 and ``finalize_model_grads`` divides by the global token count."""
        return self.num_samples(replica) / self.global_batch_size

    def micro_batch_offsets(self, replica: int | None = None) -> list[int]:
        """Offsets (within a global batch) of the first sample of each of
        ``replica``'s micro-batches, in the order it processes them.

        Micro-batches are dealt round-robin over the replicas that still have
        some left, so with equal shares replica ``d`` gets exactly what
        Megatron's ``MegatronPretrainingSampler`` gives data-parallel rank ``d``."""
        replica = self._replica(replica)
        sizes = [self.micro_batch_sizes(d) for d in range(self.num_replicas)]
        offsets, pos = [], 0
        for k in range(max(self.microbatches)):
            for d, mine in enumerate(sizes):
                if k < len(mine):
                    if d == replica:
                        offsets.append(pos)
                    pos += mine[k]
        return offsets

    @property
    def efficiency(self) -> float | None:
        """Ideal step time over the predicted one (1.0: perfectly balanced): the
        slowest replica needs ``max((n_d + b) / t_d)`` for ``n_d`` samples at
        throughput ``t_d`` with a pipeline bubble of ``b`` samples (:attr:`bubble`); the ideal, where
        every replica finishes at once, is ``(global_batch_size + replicas * b) / sum(t_d)``."""
        if self.throughputs is None:
            return None
        counts, b = self.sample_counts, self.bubble
        slowest = max((n + b) / t for n, t in zip(counts, self.throughputs))
        return (sum(counts) + len(counts) * b) / sum(self.throughputs) / slowest

    def describe(self) -> str:
        """One line for a start-up log."""
        text = (
            f"batch shares: {list(self.microbatches)} micro-batches of {self.micro_batch_size} per replica "
            f"(global batch {self.global_batch_size})"
        )
        if self.samples is not None:
            text = (
                f"batch shares: {list(self.samples)} samples per replica in {list(self.microbatches)} micro-batches "
                f"of up to {self.micro_batch_size} (global batch {self.global_batch_size})"
            )
        if self.throughputs is not None:
            rates = [int(t) if t == int(t) else round(t, 3) for t in self.throughputs]
            text += f" for throughputs {rates}; predicted step at {self.efficiency:.1%} of the balanced ideal"
        return text


def equal_batch_shares(num_replicas: int, global_batch_size: int, micro_batch_size: int) -> BatchShares:
    """Megatron's split: ``global_batch_size / (micro_batch_size * num_replicas)``
    micro-batches per replica (refused, with the sizes that work, when it does not divide)."""
    _check_sizes(global_batch_size, micro_batch_size, num_replicas)
    unit = micro_batch_size * num_replicas
    if global_batch_size % unit:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size * data-parallel "
            f"replicas = {micro_batch_size} * {num_replicas} = {unit}, so the replicas cannot get equal shares: "
            f"use a multiple of {unit} (e.g. {_multiples(unit, global_batch_size)}), or unequal shares "
            "(--ntp-balance tp)"
        )
    return BatchShares(micro_batch_size, (global_batch_size // unit,) * num_replicas)


def balanced_batch_shares(
    throughputs: Sequence[float],
    global_batch_size: int,
    micro_batch_size: int,
    *,
    what: str = "throughputs",
    require_gain: bool = True,
    unit: str = "microbatch",
    pipeline_stages: int = 1,
) -> BatchShares:
    """Micro-batch counts proportional to ``throughputs`` (one positive number per
    replica, e.g. its TP degree or its measured micro-batches per second).

    ``pipeline_stages`` P > 1: every replica runs a 1F1B pipeline, whose step takes as long as
    ``m_d + P - 1`` micro-batches (the fill and the drain), so the counts minimise
    ``max_d((m_d + P - 1) / throughputs[d])``: a slower replica gets fewer than its share of the
    throughputs (the bubble costs it more).

    ``unit="sample"`` (``--ntp-share-unit sample``): the same in samples, so the split is
    not rounded to whole micro-batches (:meth:`BatchShares.in_samples`; a replica's last
    micro-batch may be partial, and ``global_batch_size`` need not be a multiple of
    ``micro_batch_size``).

    The counts minimise the predicted step time ``max_d(m_d / throughputs[d])``
    subject to ``sum(m_d) = global_batch_size / micro_batch_size`` and
    ``m_d >= 1`` (each further micro-batch goes to the replica that would finish
    it first), so they are exactly proportional whenever that is possible.

    Refused with a ValueError saying what to change: ``global_batch_size`` not a
    multiple of ``micro_batch_size``, fewer micro-batches than replicas, and
    -- when the throughputs differ -- too few micro-batches to make the slowest
    replica any faster than with equal shares (``require_gain=False`` returns the
    best split then, as :class:`MeasuredBalance` does: its throughputs are
    measured, never configured). ``what`` names the throughputs in the messages
    (e.g. "TP degrees (--ntp-balance tp)")."""
    rates = [Fraction(t) for t in throughputs]
    if not rates or any(t <= 0 for t in rates):
        raise ValueError(f"{what} must be one number > 0 per replica, got {list(throughputs)}")
    replicas = len(rates)
    _check_sizes(global_batch_size, micro_batch_size, replicas)
    if not isinstance(pipeline_stages, int) or isinstance(pipeline_stages, bool) or pipeline_stages < 1:
        raise ValueError(f"pipeline_stages must be an int >= 1, got {pipeline_stages!r}")
    if unit not in SHARE_UNITS:
        raise ValueError(f"unit must be one of {SHARE_UNITS}, got {unit!r}")
    if unit == "sample":
        if global_batch_size < replicas:
            raise ValueError(
                f"global_batch_size={global_batch_size} samples are fewer than the {replicas} data-parallel replicas "
                f"(each needs at least one): use global_batch_size >= {replicas}"
            )
        bubble = (pipeline_stages - 1) * micro_batch_size  # in samples
        counts = _proportional(rates, global_batch_size, bubble)
        if require_gain and len(set(rates)) > 1:
            slowest = max((n + bubble) / t for n, t in zip(counts, rates))
            if slowest >= (Fraction(global_batch_size, replicas) + bubble) / min(rates):
                raise ValueError(
                    f"global_batch_size={global_batch_size} samples are too few to split in proportion to the "
                    f"replicas' {what} {[float(t) for t in rates]}: the best split {counts} is no faster than equal "
                    "shares. Use a larger global_batch_size, or equal shares (--ntp-balance none)."
                )
        return BatchShares.in_samples(micro_batch_size, counts, tuple(float(t) for t in rates), bubble)
    if global_batch_size % micro_batch_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size={micro_batch_size}: "
            f"use a multiple of {micro_batch_size} (e.g. {_multiples(micro_batch_size, global_batch_size)})"
        )
    total = global_batch_size // micro_batch_size
    if total < replicas:
        raise ValueError(
            f"global_batch_size={global_batch_size} / micro_batch_size={micro_batch_size} = {total} micro-batches, "
            f"fewer than the {replicas} data-parallel replicas (each needs at least one): use global_batch_size "
            f">= {replicas * micro_batch_size} or a smaller micro_batch_size"
        )
    bubble = pipeline_stages - 1  # in micro-batches
    counts = _proportional(rates, total, bubble)
    if require_gain and len(set(rates)) > 1:
        slowest = max((m + bubble) / t for m, t in zip(counts, rates))
        unbalanced = (Fraction(total, replicas) + bubble) / min(rates)
        if slowest >= unbalanced:
            raise ValueError(_no_gain_message(rates, counts, total, global_batch_size, micro_batch_size, what))
    return BatchShares(
        micro_batch_size, tuple(counts), tuple(float(t) for t in rates), bubble=bubble * micro_batch_size
    )


def shrunk_batch_shares(
    throughputs: Sequence[float],
    global_batch_size: int,
    micro_batch_size: int,
    max_shrink: float,
    *,
    unit: str = "microbatch",
    overheads: Sequence[float] | None = None,
) -> BatchShares:
    """Shares that keep every replica's per-step work (``--ntp-balance shrink``): the fastest
    replicas their equal share ``m = global_batch_size / (micro_batch_size * replicas)``, each
    slower one what it computes in the same time, ``max(1, floor(m * t_d / t_max))``. The global
    batch shrinks by the slower replicas' shortfall, at most ``max_shrink`` of it: beyond that
    they get micro-batches back one at a time (to the one that finishes its next soonest), and
    the step grows instead. The step then takes a healthy replica's uniform step wherever the
    bound allows, with no straggler and no granularity loss; the gradient is the exact mean
    over the samples processed (:meth:`BatchShares.gradient_weight`), and
    ``shares.global_batch_size`` is the smaller batch the sampler and the learning-rate
    schedule count. ``unit="sample"``: the same in samples (the equal share
    ``global_batch_size / replicas`` samples; a degraded replica's last micro-batch may be
    partial).

    ``overheads[d]``: time replica ``d`` spends besides its share each step, as a fraction of
    a fastest replica's time for the equal share (a partner's and its satellite's transfers,
    e.g. :data:`~megatron_ext.nonuniform_tp.policy.TRANSFER_FRACTION`). Where giving
    those replicas fewer units to absorb it keeps more throughput (samples per predicted step)
    than letting the step grow, they get fewer: at scale one unit of one replica costs far less
    than every replica waiting for the pair."""
    if unit not in SHARE_UNITS:
        raise ValueError(f"unit must be one of {SHARE_UNITS}, got {unit!r}")
    rates = [Fraction(t) for t in throughputs]
    if not rates or any(t <= 0 for t in rates):
        raise ValueError(f"throughputs must be one number > 0 per replica, got {list(throughputs)}")
    if isinstance(max_shrink, bool) or not isinstance(max_shrink, (int, float)) or not 0 <= max_shrink < 1:
        raise ValueError(f"max_shrink must be a number in [0, 1) (a fraction of the global batch), got {max_shrink!r}")
    fractions = [Fraction(0)] * len(rates) if overheads is None else [Fraction(o) for o in overheads]
    if len(fractions) != len(rates) or any(o < 0 for o in fractions):
        raise ValueError(f"overheads must be one number >= 0 per replica, got {overheads}")
    if unit == "sample":
        _check_sizes(global_batch_size, micro_batch_size, len(rates))
        if global_batch_size % len(rates):
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of the {len(rates)} data-parallel "
                f"replicas, so the healthy ones cannot keep equal shares: use a multiple of {len(rates)} (e.g. "
                f"{_multiples(len(rates), global_batch_size)})"
            )
        base = global_batch_size // len(rates)
    else:
        base = equal_batch_shares(len(rates), global_batch_size, micro_batch_size).microbatches[0]
    top = max(rates)
    total = base * len(rates)
    allowed = math.floor(Fraction(max_shrink) * total)
    extra = [o * base for o in fractions]  # in units of a fastest replica's time per unit
    # time in units of a fastest replica's unit: t_d = top / rates[d] per unit, plus the overhead
    finish = lambda d, n, o: n * top / rates[d] + o[d]  # noqa: E731

    def shares(absorb: bool) -> list[int]:
        o = extra if absorb else [Fraction(0)] * len(rates)
        counts = [max(1, math.floor((base - o[d]) * rates[d] / top)) for d in range(len(rates))]
        while total - sum(counts) > allowed:
            cut = [d for d in range(len(rates)) if counts[d] < base]
            d = min(cut, key=lambda d: (finish(d, counts[d] + 1, extra), d))
            counts[d] += 1
        return counts

    def throughput(counts: list[int]) -> Fraction:
        return sum(counts) / max(finish(d, n, extra) for d, n in enumerate(counts))

    counts = max((shares(False), shares(True)), key=throughput)  # ties: the larger batch (False first)
    if unit == "sample":
        return BatchShares.in_samples(micro_batch_size, counts, tuple(float(t) for t in rates))
    return BatchShares(micro_batch_size, tuple(counts), tuple(float(t) for t in rates))


def _proportional(rates: list[Fraction], total: int, bubble: int = 0) -> list[int]:
    """``total`` units over the replicas, at least one each, minimising ``max((n_d + bubble) / rates[d])``:
    each further unit goes to the replica that would finish it first (ties: the lower index)."""
    counts = [1] * len(rates)
    heap = [(Fraction(2 + bubble) / t, d) for d, t in enumerate(rates)]
    heapq.heapify(heap)
    for _ in range(total - len(rates)):
        _, d = heapq.heappop(heap)
        counts[d] += 1
        heapq.heappush(heap, ((counts[d] + 1 + bubble) / rates[d], d))
    return counts


def _check_sizes(global_batch_size, micro_batch_size, replicas):
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("number of replicas", replicas),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _multiples(unit: int, near: int, count: int = 3) -> str:
    first = max(1, -(-near // unit))
    return ", ".join(str(unit * k) for k in range(first, first + count))


def _no_gain_message(rates, counts, total, global_batch_size, micro_batch_size, what) -> str:
    shown = [int(t) if t.denominator == 1 else float(t) for t in rates]
    text = (
        f"global_batch_size={global_batch_size} / micro_batch_size={micro_batch_size} = {total} micro-batches "
        f"are too few to split in proportion to the replicas' {what} {shown}: the best split {counts} is no "
        "faster than equal shares. "
    )
    if all(t.denominator == 1 for t in rates):
        ints = [int(t) for t in rates]
        unit = sum(ints) // math.gcd(*ints)  # micro-batches per exactly proportional global batch
        text += (
            f"Exactly proportional shares need a multiple of {unit} micro-batches: use global_batch_size "
            f"{_multiples(unit * micro_batch_size, global_batch_size)} (multiples of micro_batch_size * "
            f"{unit} = {unit * micro_batch_size}), a smaller micro_batch_size"
        )
    else:
        text += "Use a larger global_batch_size or a smaller micro_batch_size"
    return text + ", or equal shares (--ntp-balance none)."


class BalancedPretrainingSampler:
    """Megatron's ``MegatronPretrainingSampler`` for (possibly unequal) batch shares.

    A ``batch_sampler`` for ``torch.utils.data.DataLoader``: iterating it yields
    this replica's micro-batches (lists of ``shares.micro_batch_sizes()`` sample
    indices), ``shares.num_microbatches(replica)`` per global batch. Global
    batch ``k`` covers samples ``consumed_samples + k * G ... + G - 1``
    (``G = shares.global_batch_size``); over all replicas each of them is
    yielded exactly once (see :meth:`BatchShares.micro_batch_offsets` for which
    replica gets which; equal shares give Megatron's assignment). An incomplete
    last global batch is dropped.

    Args:
        total_samples: dataset length.
        consumed_samples: samples of the run consumed before (a multiple of the
            global batch size; Megatron's ``args.consumed_train_samples``).
        shares: the job's :class:`BatchShares` (the same on every rank).
        data_parallel_rank: this rank's replica; default
            ``parallel_state.get_data_parallel_rank()`` (the replica under NTP).
    """

    def __init__(
        self, total_samples: int, consumed_samples: int, shares: BatchShares, data_parallel_rank: int | None = None
    ):
        if not isinstance(total_samples, int) or total_samples < 1:
            raise ValueError(f"total_samples must be an int >= 1, got {total_samples!r}")
        size = shares.global_batch_size
        if not isinstance(consumed_samples, int) or consumed_samples < 0 or consumed_samples % size:
            raise ValueError(
                f"consumed_samples={consumed_samples!r} must be a multiple of the global batch size {size} "
                "(training resumes at a global-batch boundary)"
            )
        if consumed_samples + size > total_samples:
            raise ValueError(
                f"no complete global batch of {size} samples left: consumed_samples={consumed_samples}, "
                f"total_samples={total_samples}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.shares = shares
        self.data_parallel_rank = shares._replica(data_parallel_rank)
        self.micro_batch_size = shares.micro_batch_size
        self._offsets = shares.micro_batch_offsets(self.data_parallel_rank)
        self._sizes = shares.micro_batch_sizes(self.data_parallel_rank)

    def switch(self, shares: BatchShares, consumed_samples: int) -> "BalancedPretrainingSampler":
        """The sampler that goes on from ``consumed_samples`` (the samples the training has
        consumed: a global-batch boundary) with new ``shares`` of the same global batch size.

        Global batch ``k`` is the same samples under any shares, so switching between
        steps neither drops nor repeats a sample. Build a new ``DataLoader`` over it and
        drop the old iterator (with workers it has read ahead under the old shares)."""
        if shares.global_batch_size != self.shares.global_batch_size:
            raise ValueError(
                f"the new shares split global batches of {shares.global_batch_size} samples, this sampler's "
                f"{self.shares.global_batch_size}: a switch keeps the global batch size"
            )
        if not isinstance(consumed_samples, int) or consumed_samples < self.consumed_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples!r} is before this sampler's start {self.consumed_samples}: "
                "pass the samples the training has consumed so far"
            )
        return BalancedPretrainingSampler(self.total_samples, consumed_samples, shares, self.data_parallel_rank)

    def __len__(self) -> int:
        """Micro-batches this replica yields."""
        return (self.total_samples - self.consumed_samples) // self.shares.global_batch_size * len(self._offsets)

    def __iter__(self) -> Iterator[list[int]]:
        size = self.shares.global_batch_size
        for start in range(self.consumed_samples, self.total_samples - size + 1, size):
            for offset, n in zip(self._offsets, self._sizes):
                yield list(range(start + offset, start + offset + n))


def _synchronized_clock() -> float:
    """``time.perf_counter()`` once the work queued on this rank's current CUDA stream (the
    compute; not the data-parallel collectives, which run on their own streams) has run."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()


class MeasuredBalance:
    """``--ntp-balance measured``: batch shares from the replicas' measured throughputs.

    Starts with the shares by TP degree (:attr:`shares`, what ``--ntp-balance tp`` gives).
    Over the first ``measure_steps`` steps each rank times its *compute*: from
    :meth:`step_started` to :meth:`compute_finished`, which the wrapper from
    :meth:`timed` calls when Megatron's forward-backward function enters
    ``finalize_model_grads`` -- before the gradient sync, where every replica waits for
    the slowest and all would measure the same time. At the end of the last of those
    steps :meth:`step_finished` agrees on one time per replica with an all-reduce over
    all active ranks (collective: call it on every rank after every step), and from
    then on :attr:`shares` are ``balanced_batch_shares(throughputs, ...)`` with
    ``throughputs[d] = num_samples(d) / seconds[d]`` (samples per second
    under the warm-up shares).

    ``seconds[d]`` is the median of the per-step times of each of replica ``d``'s
    ranks, then the largest over its TP ranks (they compute in lockstep; the slowest
    sets the replica's pace). The median, not the mean: the first steps carry one-off
    costs (allocator growth, kernel autotuning, communicator set-up, a checkpoint or
    garbage-collector pause) that would skew a mean of a few steps; the median ignores
    up to half the steps being outliers. Every rank reduces the same numbers and
    computes the shares from them in the same way, so the shares are identical on
    every rank.

    Usage (Megatron training loop; ``consumed`` the samples consumed so far)::

        balance = MeasuredBalance(ntp_config, global_batch_size, micro_batch_size)
        ddp = NonuniformTPDistributedDataParallel(..., batch_shares=balance.shares)
        config.finalize_model_grads_func = balance.timed(finalize_model_grads)
        sampler = BalancedPretrainingSampler(len(train_ds), consumed, balance.shares)
        data = iter(DataLoader(train_ds, batch_sampler=sampler))
        while ...:
            balance.step_started()
            forward_backward(..., data_iterator=data, num_microbatches=balance.shares.num_microbatches())
            optimizer.step()
            consumed += global_batch_size
            new = balance.step_finished()   # collective; new shares once, at the end of the warm-up
            if new is not None:
                ddp.set_batch_shares(new)
                sampler = sampler.switch(new, consumed)
                data = iter(DataLoader(train_ds, batch_sampler=sampler))

    Args:
        ntp_config: the job's :class:`NonuniformTPConfig` (``balance="measured"``).
        global_batch_size, micro_batch_size: Megatron's sizes (kept by every switch).
        num_replicas: default as :meth:`NonuniformTPConfig.batch_shares`.
        measure_steps: steps timed before the shares change; default
            ``ntp_config.balance_measure_steps`` (``--ntp-balance-measure-steps``).
        clock: seconds as a float; default ``time.perf_counter`` after synchronising
            the current CUDA stream (tests inject their own).
        group: the group the times are agreed over; default all active ranks of the
            NTP job (the world when no NTP groups are installed).
        replica: this rank's replica; default ``parallel_state.get_data_parallel_rank()``.
    """

    def __init__(
        self,
        ntp_config,
        global_batch_size: int,
        micro_batch_size: int,
        *,
        num_replicas: int | None = None,
        measure_steps: int | None = None,
        clock: Callable[[], float] | None = None,
        group=None,
        replica: int | None = None,
    ):
        if ntp_config.balance != "measured":
            raise ValueError(
                f"MeasuredBalance needs NonuniformTPConfig.balance='measured' (--ntp-balance measured), got "
                f"{ntp_config.balance!r}; use ntp_config.batch_shares(...) for the other modes"
            )
        measure_steps = ntp_config.balance_measure_steps if measure_steps is None else measure_steps
        if not isinstance(measure_steps, int) or isinstance(measure_steps, bool) or measure_steps < 1:
            raise ValueError(
                "MeasuredBalance.measure_steps (--ntp-balance-measure-steps) must be an int >= 1, got "
                f"{measure_steps!r}"
            )
        self.shares = ntp_config.batch_shares(global_batch_size, micro_batch_size, num_replicas)
        self.measure_steps = measure_steps
        self.clock = clock or _synchronized_clock
        self.group = group
        self.replica = self.shares._replica(replica)
        self.times: list[float] = []  # this rank's compute seconds per warm-up step
        self.seconds: tuple[float, ...] | None = None  # agreed per-replica seconds, once measured
        self._started = self._finished = None

    @property
    def measuring(self) -> bool:
        """True during the warm-up steps (their compute is timed)."""
        return self.seconds is None

    def step_started(self) -> None:
        """Call right before the step's forward-backward function."""
        if self.measuring:
            self._started, self._finished = self.clock(), None

    def compute_finished(self) -> None:
        """This step's compute is done (the first call of a step counts); :meth:`timed` calls it."""
        if self.measuring and self._started is not None and self._finished is None:
            self._finished = self.clock()

    def timed(self, finalize_model_grads: Callable) -> Callable:
        """``finalize_model_grads`` calling :meth:`compute_finished` first: set it as the
        ``TransformerConfig.finalize_model_grads_func`` that Megatron's forward-backward
        function calls after the last backward."""

        def finalize(*args, **kwargs):
            self.compute_finished()
            return finalize_model_grads(*args, **kwargs)

        return finalize

    def step_finished(self, seconds: float | None = None) -> BatchShares | None:
        """Call after every step on every rank. ``seconds``: this step's compute time
        measured by the caller (default: :meth:`step_started` to :meth:`compute_finished`,
        or to now where that was not called, which includes the wait in the gradient sync).

        At the end of the ``measure_steps``-th step (collective over :attr:`group`) the
        shares by measured throughput replace :attr:`shares`; returns them when their
        micro-batch counts differ from the warm-up shares, else ``None``."""
        if not self.measuring:
            return None
        if seconds is None:
            if self._started is None:
                raise RuntimeError("MeasuredBalance.step_finished(): call step_started() before each step's compute")
            seconds = (self._finished if self._finished is not None else self.clock()) - self._started
        self.times.append(float(seconds))
        self._started = self._finished = None
        if len(self.times) < self.measure_steps:
            return None
        return self._agree()

    def _agree(self) -> BatchShares | None:
        import torch
        import torch.distributed as dist

        group = self.group  # None: the default group, in an NTP job every active rank (simulate mode rebuilds it)
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        per_replica = torch.zeros(self.shares.num_replicas, dtype=torch.float64, device=device)
        per_replica[self.replica] = statistics.median(self.times)
        dist.all_reduce(per_replica, op=dist.ReduceOp.MAX, group=group)
        self.seconds = tuple(per_replica.tolist())
        if not all(s > 0 and math.isfinite(s) for s in self.seconds):
            raise RuntimeError(
                f"--ntp-balance measured: the median compute seconds per replica are {list(self.seconds)}; every "
                "replica needs a time > 0 (check the clock, and that step_started() and step_finished() run on "
                "every rank)"
            )
        old = self.shares
        # a pipelined replica's step covers its samples and the bubble: its rate in samples per second
        rates = [(n + old.bubble) / s for n, s in zip(old.sample_counts, self.seconds)]
        stages = old.bubble // old.micro_batch_size + 1
        self.shares = balanced_batch_shares(
            rates,
            old.global_batch_size,
            old.micro_batch_size,
            what="measured throughputs (--ntp-balance measured)",
            require_gain=False,
            unit="microbatch" if old.samples is None else "sample",
            pipeline_stages=stages,
        )
        logger.info(
            "nonuniform TP (--ntp-balance measured): median compute seconds per replica %s over %d steps under "
            "%s; now %s",
            [round(s, 6) for s in self.seconds],
            len(self.times),
            list(old.microbatches),
            self.shares.describe(),
        )
        return self.shares if self.shares.sample_counts != old.sample_counts else None


def reduce_loss_over_replicas(local_mean_loss, shares: BatchShares, group=None):
    """The mean loss of the global batch on every rank, from this replica's mean
    over its own micro-batches (what Megatron's loss function reports, averaged
    over the micro-batches of one step). Collective over all active ranks of an
    NTP job (``group``: default the default group, which in an NTP job holds exactly the
    active ranks: simulate mode rebuilds it without the leavers): each rank of a last
    pipeline stage adds ``gradient_weight * loss / tp_size``, so every replica counts once
    (the other stages have no loss: what they pass is not read).

    ``local_mean_loss`` is a tensor on this rank's device; the result is a new
    tensor. (Per-token losses need no weighting: sum the per-token loss and token
    count over the data-parallel group, as Megatron's training loop does.)"""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    value = local_mean_loss.detach().to(torch.float64) * (shares.gradient_weight() / tp_size)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        value.zero_()
    dist.all_reduce(value, group=group)
    return value.to(local_mean_loss.dtype)
