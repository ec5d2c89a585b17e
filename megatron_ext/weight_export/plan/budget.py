"""A reshard refit's staging within a memory budget: each pair's bucket size, from the ranks' slot sizes.

Without a budget every pair of ranks cuts its transfers into buckets of ``bucket_bytes``, and a rank
stages ``max_inflight`` buckets per peer for sending and as many for receiving, so its staging grows
with its number of peers. With ``budget_bytes`` each rank's share is split evenly over its staging
slots (``max_inflight`` per peer it sends to and per peer it receives from, :func:`slot_bytes`), and a
pair's bucket is the smaller of its two ranks' slot sizes (at most ``bucket_bytes``, a multiple of
:data:`~.wire.ALIGN`). Each rank reports its slot size before the first refit (a rank plans only its
own pairs), so sender and receiver cut a pair alike, and a rank whose budget cannot hold its pairs'
buckets refuses at that agreement, so every rank refuses at once, before a byte moves.

An atomic receiver that keeps the version on the device holds every round it receives until the
last arrives, so its staging is its whole share of the version, not a slot per peer: with a budget
given it is refused unless that fits (stage on the host instead, or stream); under the ``auto``
budget (``strict=False``) it keeps that copy on top. Staged on the host it
receives through the same slots as a streaming receiver.

**Small pairs.** A pair that stages little in all (the norms a TP rank takes from the other TP ranks of a
layout cut alike: 28 transfers, 0.16 MiB, next to 3.4 GiB from its own TP rank) would halve the slot of its
ranks' other pairs, and NCCL moves one peer's ops of 128 MiB at 257 GB/s, of 256 MiB at 354 (4xH200,
``benchmarks/p2p_rounds.py``). So in one phase a pair whose bucket would hold all it stages in at most
:data:`SMALL_PAIR_BYTES` (:func:`whole_nbytes`, the same on both ends) goes in one bucket of that size, taken
off the budget before it is split over the other pairs' slots, when every rank of the job can afford it (its
small pairs take at most :data:`SMALL_SHARE` of its budget and its other slots grow: :func:`small_pairs`).

**Phases.** A budget split over many peers makes small buckets (512 MiB over 128 peers, 2 in flight:
2 MiB), and NCCL moves small ops far below the link (4xH200: 16 ops of 1 MiB per round reached 41 GB/s,
of 16 MiB 313 GB/s; ``benchmarks/p2p_rounds.py``). So a rank's pairs can be split into ``phases``: pair
``(src, dst)`` is in phase :func:`pair_phase`, and its ``j``-th round is posted in round
``1 + j * phases + phase`` of both ranks (round 0 carries a header-only bucket of every pair, which
vouches for all its transfers, so that a streaming receiver checks every source's version before it
writes anything). A round then holds the pairs of one phase only, and a rank stages ``max_inflight``
buffers per *lane* (:func:`peer_lanes`: its peers of one phase, sending and receiving counted apart)
instead of per peer. Both ends of a pair post each of its rounds in the same round index, so ranks that
post their rounds in order never wait on each other in a cycle. :func:`choose_phases` picks the number
of phases from every rank's slot size under each candidate (:data:`PHASES`): the fewest that bring the
smallest slot of the job to :data:`MIN_OP_BYTES` or as near as they can.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

from .direct import DirectRound, direct_rounds, split_direct, staged_nbytes
from .reshard_plan import Transfer, pair_summary
from .wire import ALIGN, HEADER_BYTES, PAYLOAD_OFFSET, align, bucketize

__all__ = [
    "ATOMIC_STAGING",
    "MIN_OP_BYTES",
    "NO_WORDS",
    "PHASES",
    "SMALL_PAIR_BYTES",
    "SMALL_SHARE",
    "DEVICE_SLAB_BYTES",
    "BudgetError",
    "StagingPlan",
    "buffer_sizes",
    "choose_phases",
    "device_slabs",
    "host_slabs",
    "job_slots",
    "keeps_every_round",
    "pair_phase",
    "pair_rounds",
    "peer_lanes",
    "phase_rounds",
    "phase_slots",
    "phase_words",
    "plan_in_phases",
    "plan_staging",
    "rank_words",
    "slot",
    "slot_bytes",
    "small_pairs",
    "whole_nbytes",
]

ATOMIC_STAGING = ("device", "host")  # where an atomic receiver keeps the version until it applies it
MIB = 1 << 20
PHASES = (1, 2, 4, 8, 16, 32, 64)  # the numbers of phases a job may split its pairs into
# The op size a job splits its pairs into phases to reach (4xH200, benchmarks/p2p_rounds.py: rounds of 16
# ops per receiver moved 313 GB/s at 16 MiB per op, 286 at 8, 162 at 4, 82 at 2, 41 at 1)
MIN_OP_BYTES = 16 * MIB
# A pair that stages at most this many bytes in all goes in one bucket of its own (module docstring), ...
SMALL_PAIR_BYTES = 1 * MIB
SMALL_SHARE = 0.25  # ... when a rank's small pairs take at most this share of its budget


class BudgetError(ValueError):
    """The memory budget cannot hold the plan's staging (the message names the flag and the minimum)."""


@dataclasses.dataclass(frozen=True)
class StagingPlan:
    """``pair_bytes``: the bucket size of each ``(src, dst)`` pair that moves bytes; ``buckets``: the
    rounds of the pairs counted, in order (staged buckets, :func:`~.wire.bucketize`, and zero-copy
    :class:`~.direct.DirectRound` s, :func:`pair_rounds`); ``device_bytes``: each rank's staging on its
    device (``host_bytes`` on the host: atomic receivers staged there); ``direct_bytes``: the bytes each
    rank sends or receives zero-copy; ``budget_bytes``: None without a budget."""

    pair_bytes: dict[tuple[int, int], int]
    buckets: dict[tuple[int, int], list]
    device_bytes: dict[int, int]
    host_bytes: dict[int, int]
    budget_bytes: int | None
    strict: bool = True
    direct_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    phases: int = 1
    small: frozenset = frozenset()  # the pairs that stage all their bytes in one bucket of their own

    def line(self, rank: int) -> str:
        """What the planner chose for ``rank``, for the INFO log."""
        mine = sorted({b for (s, d), b in self.pair_bytes.items() if rank in (s, d)})
        sizes = ", ".join(f"{b / MIB:.2f}" for b in mine) or "none"
        text = f"staging {self.device_bytes.get(rank, 0) / MIB:.1f} MiB on the device"
        if self.host_bytes.get(rank):
            text += f" + {self.host_bytes[rank] / MIB:.1f} MiB on the host"
        if self.direct_bytes.get(rank):
            text += f", {self.direct_bytes[rank] / MIB:.1f} MiB zero-copy"
        limit = "no budget" if self.budget_bytes is None else f"budget {self.budget_bytes / MIB:.1f} MiB"
        if self.budget_bytes is not None and not self.strict:
            limit += " (auto: an atomic receiver's version on the device comes on top)"
        if self.phases > 1:
            limit += f"; the pairs in {self.phases} phases"
        small = sum(1 for p in self.small if rank in p)
        if small:
            limit += f"; {small} small pair{'s' if small > 1 else ''} in one bucket each"
        return f"{text} ({limit}; bucket MiB per pair: {sizes})"


Table = dict[int, list]  # peer -> its rounds: buckets of (transfer, byte offset), or DirectRound


def slot_bytes(slots: int, *, bucket_bytes: int, max_inflight: int, budget_bytes: int | None) -> int:
    """The largest bucket of a rank with ``slots`` staging slots (peers it sends to + peers it receives from):
    ``bucket_bytes``, or with a budget the budget's share of each of its ``max_inflight`` buffers per slot
    (a multiple of :data:`~.wire.ALIGN`), if smaller."""
    if budget_bytes is None or slots == 0:
        return bucket_bytes
    return min(bucket_bytes, budget_bytes // (max_inflight * slots) // ALIGN * ALIGN)


def pair_phase(src: int, dst: int, phases: int) -> int:
    """The phase of pair ``(src, dst)`` among ``phases``: both ends compute it alike. It spreads alike the
    peers that are consecutive ranks and the peers ``phases`` ranks apart (one TP rank of each replica)."""
    return (src + dst + src // phases + dst // phases) % phases


def peer_lanes(rank: int, sends: Iterable[int], recvs: Iterable[int], phases: int) -> dict[tuple[str, int], int]:
    """Each peer's lane on ``rank`` (``("send"|"recv", peer)`` -> its index among the peers of its phase
    that ``rank`` sends to, or receives from): the staging buffers the peer's rounds use. Empty with one
    phase (each peer its own buffers)."""
    if phases == 1:
        return {}
    lanes: dict[tuple[str, int], int] = {}
    for kind, peers in (("send", sends), ("recv", recvs)):
        used: dict[int, int] = defaultdict(int)
        for p in sorted(peers):
            phase = pair_phase(*((rank, p) if kind == "send" else (p, rank)), phases)
            lanes[(kind, p)] = used[phase]
            used[phase] += 1
    return lanes


def phase_slots(rank: int, sends: Iterable[int], recvs: Iterable[int], phases: int) -> int:
    """The staging slots of ``rank`` with its pairs in ``phases`` (per buffer in flight): the most peers it
    sends to in one phase plus the most it receives from in one; with one phase, all its peers."""
    sends, recvs = list(sends), list(recvs)
    if phases == 1:
        return len(sends) + len(recvs)
    lanes = peer_lanes(rank, sends, recvs, phases)
    return sum(1 + max((n for (k, _), n in lanes.items() if k == kind), default=-1) for kind in ("send", "recv"))


def rank_slot(
    rank: int,
    sends: Iterable[int],
    recvs: Iterable[int],
    phases: int,
    *,
    bucket_bytes: int,
    max_inflight: int,
    budget_bytes: int | None,
) -> tuple[int, int]:
    """``rank``'s slot size (:func:`slot_bytes`) and slot count (:func:`phase_slots`) with its pairs in
    ``phases``; in more than one, the budget first keeps room for round 0's header-only buckets (one per peer)."""
    sends, recvs = list(sends), list(recvs)
    n = phase_slots(rank, sends, recvs, phases)
    if budget_bytes is not None and phases > 1:
        budget_bytes = max(0, budget_bytes - (len(sends) + len(recvs)) * HEADER_BYTES)
    return slot_bytes(n, bucket_bytes=bucket_bytes, max_inflight=max_inflight, budget_bytes=budget_bytes), n


NO_WORDS = (0,) + (0, 0) * len(PHASES) + (0,)  # a rank's words (:func:`rank_words`) before they are known


def whole_nbytes(transfers: list[Transfer], limit: int | None = None) -> int:
    """Bytes of one bucket that holds all of ``transfers`` (header, then each at an aligned offset): what a
    small pair stages (:func:`~.wire.bucketize` with this size cuts nothing). ``limit``: a count over it stops
    there (a pair of gigabytes is not small after its first transfers; a rank's words ask for every pair's)."""
    used = end = PAYLOAD_OFFSET
    for t in transfers:
        end = used + t.nbytes
        if limit is not None and end > limit:
            return end
        used = align(end)
    return end


def _small_slot(pairs: list[int], one_phase: int, *, bucket_bytes: int, max_inflight: int, budget_bytes) -> int:
    """A rank's slot size in one phase with its small pairs (``pairs``: each pair's :func:`whole_nbytes`) in a
    bucket of their own, off the budget; 0 where that is not allowed (no budget, no small pair, small pairs
    over :data:`SMALL_SHARE` of the budget) or gives its other slots nothing more than ``one_phase``."""
    small = [align(n) for n in pairs if n <= SMALL_PAIR_BYTES]  # each in a buffer of its own (buffer_sizes)
    if budget_bytes is None or not small or sum(small) > SMALL_SHARE * budget_bytes:
        return 0
    left = budget_bytes - sum(small)
    got = slot_bytes(len(pairs) - len(small), bucket_bytes=bucket_bytes, max_inflight=max_inflight, budget_bytes=left)
    return got if got > one_phase else 0


def rank_words(
    transfers: list[Transfer], ranks: Iterable[int], *, bucket_bytes: int, max_inflight: int, budget_bytes: int | None
) -> dict[int, tuple[int, ...]]:
    """The words of each of ``ranks`` over the pairs of ``transfers``, what a rank reports before the first
    refit: the digest of its pairs (:func:`~.reshard_plan.pair_summary`), then its slot size and slot count
    (:func:`rank_slot`) in each of :data:`PHASES` (:func:`phase_words` reads them), then its slot size in one
    phase with its small pairs whole (:func:`_small_slot`; 0: it cannot); :data:`NO_WORDS` for a rank without
    pairs."""
    summary = pair_summary(transfers)
    pairs = _pairs(transfers)
    out = {}
    for r in ranks:
        sends, recvs, digest = summary.get(r, (set(), set(), 0))
        words = [digest]
        for phases in PHASES:
            words += rank_slot(
                r, sends, recvs, phases, bucket_bytes=bucket_bytes, max_inflight=max_inflight, budget_bytes=budget_bytes
            )
        mine = [whole_nbytes(ts, SMALL_PAIR_BYTES) for p, ts in pairs.items() if r in p]
        size = dict(bucket_bytes=bucket_bytes, max_inflight=max_inflight, budget_bytes=budget_bytes)
        words.append(_small_slot(mine, words[1], **size))
        out[r] = tuple(words)
    return out


def phase_words(words: tuple[int, ...], i: int) -> tuple[int, int]:
    """A rank's slot size and slot count with the pairs in ``PHASES[i]`` phases, from its :func:`rank_words`."""
    return words[1 + 2 * i], words[2 + 2 * i]


def small_pairs(words: Iterable[tuple[int, ...]]) -> bool:
    """Whether the job's small pairs go in a bucket of their own in one phase: every rank with pairs can
    (its last word, :func:`rank_words`)."""
    words = [w for w in words if phase_words(w, 0)[1]]
    return bool(words) and all(w[-1] > 0 for w in words)


def job_slots(words: dict[int, tuple[int, ...]], i: int) -> dict[int, int]:
    """Each rank's slot size with the pairs in ``PHASES[i]`` phases, from every rank's words: in one phase, with
    the small pairs in their own buckets where :func:`small_pairs`."""
    small = i == 0 and small_pairs(words.values())
    return {r: w[-1] if small and phase_words(w, 0)[1] else phase_words(w, i)[0] for r, w in words.items()}


def choose_phases(words: Iterable[tuple[int, ...]], min_op_bytes: int | None = MIN_OP_BYTES) -> int:
    """The index in :data:`PHASES` of the fewest phases that bring the smallest of the job's slot sizes to
    ``min_op_bytes``, or nearest to it, within 1/64 (round 0's headers and small pairs take a little of each
    budget); 0 (one phase) when ``min_op_bytes`` is None or no rank stages anything; in one phase, with the
    small pairs apart where :func:`small_pairs`. ``words``: every rank's
    :func:`rank_words` (ranks without pairs count for nothing). When no number of phases leaves any slot at all
    (a budget too small for the job), the one with the fewest slots on the most crowded rank, so that the
    refusal names the least budget that works."""
    words = [w for w in words if phase_words(w, 0)[1]]
    if min_op_bytes is None or not words:
        return 0
    target = min_op_bytes - min_op_bytes // 64
    at = [[phase_words(w, i) for w in words] for i in range(len(PHASES))]
    if small_pairs(words):  # one phase, small pairs apart: larger slots
        at[0] = [(w[-1], n) for w, (_, n) in zip(words, at[0])]
    score = [min(min(b, target) for b, _ in ws) for ws in at]
    if max(score) == 0:
        crowded = [max(n for _, n in ws) for ws in at]
        return crowded.index(min(crowded))
    best = max(score)  # the fewest phases within 1/64 of the best (what headers or a small pair's bucket take)
    return next(i for i, v in enumerate(score) if v >= best - best // 64)


def phase_rounds(rounds: list, phase: int, phases: int) -> list:
    """One pair's rounds placed in the job's rounds: a header-only bucket in round 0, then its ``j``-th
    round in round ``1 + j * phases + phase`` (None in the rounds between, where the pair posts nothing);
    unchanged with one phase."""
    if phases == 1:
        return rounds
    out: list = [[]]
    for j, r in enumerate(rounds):
        out += [None] * (1 + j * phases + phase - len(out))
        out.append(r)
    return out


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def host_slabs(sizes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Pinned host slabs for buffers of ``sizes`` bytes, in order: each slab a power of two (PyTorch's pinned
    allocator rounds every allocation up to one: a buffer of its own would take up to twice its bytes), filled
    with consecutive buffers at :data:`~.wire.ALIGN` offsets; each slab the largest power of two within the
    bytes left, but at least the next buffer's; or a slab per buffer where that pins less (buffers of a power
    of two each). Returns the slab sizes and each buffer's ``(slab, offset)``."""
    alone = [_pow2_at_least(n) for n in sizes]
    slabs: list[int] = []
    where: list[tuple[int, int]] = []
    left = sum(align(n) for n in sizes)
    used = 0
    for n in sizes:
        if not slabs or used + n > slabs[-1]:
            size = max(1 << max(left.bit_length() - 1, 0), _pow2_at_least(n))
            slabs.append(size)
            used = 0
        where.append((len(slabs) - 1, used))
        used += align(n)
        left -= align(n)
    if sum(alone) <= sum(slabs):
        return alone, [(i, 0) for i in range(len(sizes))]
    return slabs, where


def keeps_every_round(atomic: bool, atomic_staging: str) -> bool:
    """Whether a receiver holds every round it receives on the device until the last arrives (atomic, staged on
    the device); the others receive through ``max_inflight`` slots per peer."""
    return atomic and atomic_staging == "device"


def slot(
    kind: str, peer: int, k: int, *, keep_all: bool, max_inflight: int, lanes: dict | None = None
) -> tuple[str, int, int]:
    """The staging buffer of round ``k`` with ``peer``: receivers that keep every round (atomic,
    staged on the device) have one per round, the rest ``max_inflight`` per peer, or with ``lanes``
    (:func:`peer_lanes`, pairs in phases) per lane, which the peers of other phases share (round 0, every
    pair's header-only bucket, has one per peer)."""
    if kind == "recv" and keep_all:
        return kind, peer, k
    if lanes and k > 0:
        return kind, -1 - lanes[(kind, peer)], k % max_inflight
    return kind, peer, k % max_inflight


def buffer_sizes(
    send: Table,
    recv: Table,
    *,
    keep_all: bool,
    max_inflight: int,
    stage_direct: bool = False,
    lanes: dict | None = None,
) -> dict[tuple[str, int, int], int]:
    """Bytes of each device staging buffer, by :func:`slot`: each as large as the largest round it
    carries (what :class:`~..exec.staging.Staging` allocates). Zero-copy rounds are never staged by
    their sender, and by their receiver only with ``stage_direct`` (atomic)."""
    sizes: dict[tuple[str, int, int], int] = {}
    for kind, table in (("send", send), ("recv", recv)):
        for peer, buckets in table.items():
            for k, bucket in enumerate(buckets):
                if bucket is None or (isinstance(bucket, DirectRound) and not (kind == "recv" and stage_direct)):
                    continue
                key = slot(kind, peer, k, keep_all=keep_all, max_inflight=max_inflight, lanes=lanes)
                n = staged_nbytes(bucket)  # a whole ALIGN unit, but a header-only bucket its 40 bytes
                sizes[key] = max(sizes.get(key, 0), n if n <= HEADER_BYTES else align(n))
    return sizes


DEVICE_SLAB_BYTES = 1 << 30  # the most bytes of device staging buffers carved from one allocation


def device_slabs(sizes: list[int], most: int = DEVICE_SLAB_BYTES) -> tuple[list[int], list[tuple[int, int]]]:
    """Device allocations for staging buffers of ``sizes`` bytes (:func:`buffer_sizes`: multiples of
    :data:`~.wire.ALIGN`, then header-only ones of 40 bytes, which need 8), in order: consecutive buffers share an
    allocation of at most ``most`` bytes (a larger buffer has one alone), as
    each allocation costs the first refit about a millisecond of host time (4xH200: 12 of 42 MiB 13.4 ms, one
    of 504 MiB 1.0 ms) while capping them keeps an atomic receiver's version from needing one contiguous block.
    Returns the allocations' sizes and each buffer's ``(allocation, offset)``."""
    slabs: list[int] = []
    where: list[tuple[int, int]] = []
    for n in sizes:
        if not slabs or (slabs[-1] and slabs[-1] + n > most):
            slabs.append(0)
        where.append((len(slabs) - 1, slabs[-1]))
        slabs[-1] += n
    return slabs, where


def pair_rounds(staged: list[Transfer], ops: list, size: int) -> list:
    """One pair's rounds from its :func:`~.direct.split_direct`: its staged buckets of ``size`` bytes; with
    zero-copy ``ops``, then their rounds and a last header-only bucket, which carries the NaN/Inf flag of the
    zero-copy bytes (the first bucket, a header alone if nothing else is staged, their version)."""
    rounds = bucketize(staged, size)
    return (rounds or [[]]) + direct_rounds(ops, size) + [[]] if ops else rounds


def _pairs(transfers: list[Transfer]) -> dict[tuple[int, int], list[Transfer]]:
    pairs: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        if t.src != t.dst:
            pairs[(t.src, t.dst)].append(t)
    return dict(pairs)


def _row(t: Transfer) -> int:
    """Bytes of one row of ``t``: the least a bucket must hold to carry it (buckets cut along dim 0)."""
    return t.nbytes // t.box.shape[0] if t.box.shape else t.nbytes


def plan_staging(
    transfers: list[Transfer],
    *,
    bucket_bytes: int,
    max_inflight: int,
    atomic: bool,
    atomic_staging: str = "device",
    budget_bytes: int | None = None,
    strict: bool = True,
    rank: int | None = None,
    flag: str = "--refit-memory-budget-mb",
    zero_copy_bytes: int | None = None,
    per_slot: dict[int, int] | None = None,
    slot_counts: dict[int, int] | None = None,
    peer_counts: dict[int, int] | None = None,
    phases: int = 1,
    small_bytes: int | None = None,
) -> StagingPlan:
    """Each pair's bucket size and each rank's staging for ``transfers`` (a plan's, in plan order).

    Raises :class:`BudgetError` when ``budget_bytes`` cannot hold one row of some transfer in every
    slot of a rank, or an atomic receiver's whole version staged on the device; the message names
    ``flag``, the tensor or rank, and the least budget that works. ``strict=False`` (the ``auto`` budget):
    the budget cuts the pairs' buckets alike, but an atomic receiver that keeps the version on the device
    holds it on top instead of being refused. ``rank``: count the staging of that rank only (without a
    budget nothing else needs it; with one every rank's is checked). ``zero_copy_bytes``: contiguous runs of
    at least this many bytes go zero-copy (:mod:`.direct`; None: every byte is staged); an atomic receiver
    stages them like buckets, a streaming one and every sender not at all. ``per_slot``: every rank's
    :func:`slot_bytes` as each computed it from its own slot count (``transfers`` then need only hold the pairs
    counted: a rank's plan, :class:`~..exec.reshard.ReshardExecutor` gathers them); None: from ``transfers``,
    a whole plan. A pair's bucket is the smaller of its two ranks' slot sizes. ``slot_counts``: every rank's
    number of slots, gathered with them (for what a refusal names; None: counted from ``transfers``).
    ``phases``: the pairs' phases (:func:`choose_phases`; the slots counted per lane, :func:`rank_slot`), and
    ``peer_counts`` every rank's number of peers, gathered (None: counted from ``transfers``). ``small_bytes``
    (one phase, :func:`small_pairs`): a pair whose :func:`whole_nbytes` is at most this goes in one bucket of
    that size, staged whole (no zero-copy ops), whatever the slot sizes."""
    if atomic_staging not in ATOMIC_STAGING:
        raise ValueError(f"atomic_staging must be one of {ATOMIC_STAGING}, got {atomic_staging!r}")
    pairs = _pairs(transfers)
    keep_all = keeps_every_round(atomic, atomic_staging)
    peers: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))  # rank -> (sends, recvs)
    for src, dst in pairs:
        peers[src][0].append(dst)
        peers[dst][1].append(src)
    size = dict(bucket_bytes=bucket_bytes, max_inflight=max_inflight, budget_bytes=budget_bytes)
    counted = {r: rank_slot(r, *ps, phases, **size) for r, ps in peers.items()}  # per rank: (slot bytes, slots)
    slots = {r: n for r, (_, n) in counted.items()}  # peers it sends to + receives from (in one phase)
    if slot_counts is not None:
        slots.update(slot_counts)
    if per_slot is None:
        per_slot = {r: b for r, (b, _) in counted.items()}
    missing = sorted({r for p in pairs for r in p} - per_slot.keys())
    if missing:
        raise ValueError(f"per_slot has no slot size for ranks {missing} of the transfers")
    if small_bytes is not None and phases != 1:
        raise ValueError(f"small pairs go in a bucket of their own in one phase only, got phases={phases}")
    small = {
        p: n
        for p, ts in pairs.items()
        if small_bytes is not None and (n := whole_nbytes(ts, small_bytes)) <= small_bytes
    }
    sizes = {p: small.get(p) or min(per_slot[p[0]], per_slot[p[1]]) for p in pairs}
    split: dict[tuple[int, int], tuple[list[Transfer], list]] = {}

    def cut(p: tuple[int, int]) -> tuple[list[Transfer], list]:
        """The pair's staged transfers and zero-copy ops, cut at its bucket size (once)."""
        if p not in split:
            ts = pairs[p]
            zero_copy = zero_copy_bytes and p not in small
            split[p] = split_direct(ts, min_bytes=zero_copy_bytes, max_bytes=sizes[p]) if zero_copy else (ts, [])
        return split[p]

    if budget_bytes is not None:
        # each slot must hold the header and one row of every transfer its pair stages (zero-copy ops are cut
        # to any size)
        staged = {p: cut(p)[0] for p in pairs}
        need = {p: PAYLOAD_OFFSET + (align(_row(max(ts, key=_row))) if ts else 0) for p, ts in staged.items()}
        short = [p for p in pairs if sizes[p] < need[p] and p not in small]
        if short:
            npeers = {r: len(ps[0]) + len(ps[1]) for r, ps in peers.items()} | (peer_counts or {})
            heads = {r: n * HEADER_BYTES if phases > 1 else 0 for r, n in npeers.items()}  # round 0's buffers
            least = max(need[p] * max_inflight * slots[r] + heads[r] for p in pairs for r in p)
            src, dst = max(short, key=lambda p: need[p] * max(slots[p[0]], slots[p[1]]))
            r = src if slots[src] >= slots[dst] else dst
            widest = max(staged[(src, dst)], key=_row)
            raise BudgetError(
                f"{flag} {budget_bytes / MIB:g} MiB cannot stage {widest.name}: a bucket of rank {src} -> {dst} "
                f"must hold one row of it ({need[(src, dst)]} bytes with the header), and rank {r} stages "
                f"{max_inflight} buckets (--refit-max-inflight) for each of its {slots[r]} peer slots (peers it "
                f"sends to and receives from{f' in one of {phases} phases' if phases > 1 else ''}); this plan "
                f"needs a budget of at least {least} bytes "
                f"({least / MIB:.4f} MiB): raise the budget or lower --refit-max-inflight"
            )
    buckets = {}
    tables: dict[int, tuple[Table, Table]] = defaultdict(lambda: ({}, {}))  # rank -> (send, recv)
    for src, dst in pairs:
        if rank is not None and rank not in (src, dst):
            continue
        rounds = phase_rounds(pair_rounds(*cut((src, dst)), sizes[(src, dst)]), pair_phase(src, dst, phases), phases)
        buckets[(src, dst)] = tables[src][0][dst] = tables[dst][1][src] = rounds
    device, host, direct = {}, {}, {}
    for r, (send, recv) in tables.items():
        if rank is not None and r != rank:
            continue
        lanes = peer_lanes(r, send, recv, phases)
        sizes_r = buffer_sizes(
            send, recv, keep_all=keep_all, max_inflight=max_inflight, stage_direct=atomic, lanes=lanes
        )
        device[r] = sum(sizes_r.values())
        if atomic and not keep_all:  # pinned slabs of the rounds it receives (exec/staging.py allocates them)
            host[r] = sum(host_slabs([staged_nbytes(b) for bs in recv.values() for b in bs if b is not None])[0])
        direct[r] = sum(b.nbytes for t in (send, recv) for bs in t.values() for b in bs if isinstance(b, DirectRound))
    if budget_bytes is not None and strict:
        over = {r: n for r, n in device.items() if n > budget_bytes}
        if over:
            r, n = max(over.items(), key=lambda kv: kv[1])
            raise BudgetError(
                f"{flag} {budget_bytes / MIB:g} MiB cannot hold rank {r}'s staging, {n / MIB:.1f} MiB at this "
                "budget: an atomic receiver that stages on the device keeps its whole share of the version until "
                "the last round; stage it on the host (--refit-atomic-staging host), stream (--no-refit-atomic), "
                "or raise the budget above it"
            )
    return StagingPlan(sizes, buckets, device, host, budget_bytes, strict, direct, phases, frozenset(small))


def plan_in_phases(transfers: list[Transfer], words: dict[int, tuple[int, ...]], i: int, **kwargs) -> StagingPlan:
    """:func:`plan_staging` with the pairs in ``PHASES[i]`` phases (:func:`choose_phases`), every rank's slot size
    (:func:`job_slots`: in one phase, with the small pairs in their own buckets where :func:`small_pairs`) and
    slot count, and its peers (its slots in one phase), read from its :func:`rank_words` (``words``: rank ->
    its words); ``kwargs`` go to :func:`plan_staging`."""
    small = i == 0 and small_pairs(words.values())
    return plan_staging(
        transfers,
        per_slot=job_slots(words, i),
        slot_counts={r: phase_words(w, i)[1] for r, w in words.items()},
        peer_counts={r: phase_words(w, 0)[1] for r, w in words.items()},  # one phase: every peer a slot
        phases=PHASES[i],
        small_bytes=SMALL_PAIR_BYTES if small else None,
        **kwargs,
    )
