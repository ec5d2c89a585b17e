"""Zero-copy transfers of a reshard refit: bytes sent from the source's tensor straight into the destination's.

A transfer whose bytes lie back to back on both sides (a :class:`~.reshard_plan.Run` of one run
at each end) needs no staging: the sender posts a view of its tensor and a streaming receiver
receives into a view of its own, so neither packs, unpacks nor holds a bucket for it. Within one
pair of ranks, consecutive such transfers that continue each other on both sides (the query
groups of a fused QKV tensor that two layouts cut alike, the rows of an embedding) merge into one
:class:`Direct` op; ops of at least ``min_bytes`` go direct, smaller ones stay in the buckets
(one message each would cost more than their copies). Every op is cut to at most ``max_bytes``
(the pair's bucket size) and :func:`direct_rounds` groups them into :class:`DirectRound` s of at
most that many bytes, so a receiver that does stage them (atomic: nothing is written before the
last round) needs no more than for a bucket, and a streaming receiver that refused the version
drains a round into one scratch buffer of that size.

Which transfers go direct depends only on the plan, the pair's bucket size and ``min_bytes``, so
sender and receiver cut a pair alike (the wire id carries ``min_bytes``); how the receiver takes
them (in place, or staged) is its own choice.
"""

from __future__ import annotations

import dataclasses

from .reshard_plan import Run, Transfer, run_continues
from .wire import ALIGN, align, bucket_nbytes

__all__ = [
    "ZERO_COPY_MIN_BYTES",
    "Direct",
    "DirectRound",
    "direct_rounds",
    "round_nbytes",
    "split_direct",
    "staged_nbytes",
]

# The least bytes a zero-copy op carries. Below it a message of its own costs more than the two copies
# it saves (NCCL's per-message cost is some microseconds; a 1 MiB copy on an H100 well under one).
ZERO_COPY_MIN_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Direct:
    """``nbytes`` bytes from byte ``src_offset`` of local tensor ``src_local`` (the sender's) to byte
    ``dst_offset`` of ``dst_local`` (the receiver's); ``transfers``: the plan's transfers it carries (one
    op may carry several whole ones, or a part of one)."""

    transfers: tuple[Transfer, ...]
    src_local: str
    src_offset: int
    dst_local: str
    dst_offset: int
    nbytes: int
    itemsize: int

    @property
    def src_run(self) -> Run:
        """The op's bytes in the sender's tensor, as one run (:func:`~.reshard_plan.run_view`: a ``(1, n)`` view)."""
        n = self.nbytes // self.itemsize
        return Run(self.src_local, self.src_offset // self.itemsize, n, n, 1)

    @property
    def dst_run(self) -> Run:
        """The op's bytes in the receiver's tensor, as one run."""
        n = self.nbytes // self.itemsize
        return Run(self.dst_local, self.dst_offset // self.itemsize, n, n, 1)


@dataclasses.dataclass(frozen=True)
class DirectRound:
    """One round of a pair made of zero-copy ops (no header: the pair's staged buckets before and after it
    carry the version and the NaN/Inf flag of these bytes)."""

    ops: tuple[Direct, ...]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return sum(op.nbytes for op in self.ops)

    @property
    def offsets(self) -> list[int]:
        """Where each op sits in a receiver's staging buffer (atomic receivers stage the round): at
        :data:`~.wire.ALIGN` offsets from 0."""
        out, at = [], 0
        for op in self.ops:
            out.append(at)
            at = align(at + op.nbytes)
        return out

    @property
    def staged_nbytes(self) -> int:
        """Bytes of a receiver's staging buffer that holds the round."""
        return self.offsets[-1] + self.ops[-1].nbytes

    @property
    def transfers(self) -> list[Transfer]:
        return list(dict.fromkeys(t for op in self.ops for t in op.transfers))


def _contiguous(t: Transfer) -> bool:
    return t.src_run.count == 1 and t.dst_run.count == 1


def _continues(a: Transfer, b: Transfer) -> bool:
    """``b`` starts where ``a`` ends on both sides, both contiguous (same local tensors and item size)."""
    return a.itemsize == b.itemsize and run_continues(a.src_run, b.src_run) and run_continues(a.dst_run, b.dst_run)


def split_direct(transfers: list[Transfer], *, min_bytes: int, max_bytes: int) -> tuple[list[Transfer], list[Direct]]:
    """One pair's transfers (plan order) as ``(staged, direct)``: runs of consecutive contiguous transfers
    that continue each other, merged, go direct when they carry at least ``min_bytes`` (cut into ops of at
    most ``max_bytes``, whole items); the rest stay staged, in plan order."""
    staged: list[Transfer] = []
    direct: list[Direct] = []
    groups: list[list[Transfer]] = []
    for t in transfers:
        if not _contiguous(t):
            groups.append([t])
        elif groups and _continues(groups[-1][-1], t):
            groups[-1].append(t)
        else:
            groups.append([t])
    for group in groups:
        total = sum(t.nbytes for t in group)
        if not _contiguous(group[0]) or total < min_bytes:
            staged.extend(group)
            continue
        first, isz = group[0], group[0].itemsize
        step = max(ALIGN, max_bytes // ALIGN * ALIGN)  # whole items: ALIGN is a multiple of every item size
        ends, at = [], 0  # each transfer's byte range within the group
        for t in group:
            ends.append((at, at + t.nbytes, t))
            at += t.nbytes
        for lo in range(0, total, step):
            hi = min(total, lo + step)
            carried = tuple(t for a, b, t in ends if a < hi and b > lo)
            direct.append(
                Direct(
                    carried,
                    first.src_run.local,
                    first.src_run.offset * isz + lo,
                    first.dst_run.local,
                    first.dst_run.offset * isz + lo,
                    hi - lo,
                    isz,
                )
            )
    return staged, direct


def direct_rounds(ops: list[Direct], max_bytes: int) -> list[DirectRound]:
    """``ops`` in order, grouped into rounds whose staged layout (:attr:`DirectRound.staged_nbytes`) is at
    most ``max_bytes``."""
    rounds: list[list[Direct]] = []
    used = 0
    for op in ops:
        if not rounds or used + op.nbytes > max_bytes:
            rounds.append([])
            used = 0
        rounds[-1].append(op)
        used = align(used + op.nbytes)
    return [DirectRound(tuple(r)) for r in rounds]


def round_nbytes(r) -> int:
    """Bytes one round of a pair puts on the wire: a staged bucket's (header included) or a direct round's."""
    return r.nbytes if isinstance(r, DirectRound) else bucket_nbytes(r)


def staged_nbytes(r) -> int:
    """Bytes of the buffer a receiver stages one round of a pair in."""
    return r.staged_nbytes if isinstance(r, DirectRound) else bucket_nbytes(r)
