"""A reshard rank's staging: its buffers and every copy of a refit, built once.

A rank sends each peer its buckets (:func:`~..plan.wire.bucketize`) from send buffers
and receives theirs into receive buffers, one buffer per ``(send|recv, peer,
slot)`` (:func:`slot`): ``max_inflight`` slots per peer (per lane, with the pairs in phases), except that an atomic
receiver staging on the device keeps every round (nothing is written before the
last one arrives). An atomic receiver staging on the host (``host=True``) receives
through ``max_inflight`` slots per peer like a streaming one and copies each bucket
to its own pinned host buffer; applying the version copies each back through the
slots and unpacks it.
:class:`Staging` allocates them and builds every copy of a refit as
``(dst, src)`` pairs over the fixed buffers and tensors (:class:`~megatron_ext.copies.Span` s: integers, no
torch views where the copy-check kernel takes them): packing a round (each
bucket's header row and pieces), unpacking it, and the rank's local copies. A
refit then issues batched copies (:class:`~megatron_ext.copies.CopyBatch`, built in chunks
of rounds by :meth:`~megatron_ext.copies.CopyBatch.many`, the first refit building a chunk
while the rounds before it are in flight) without rebuilding them, so the
tensors must be updated in place.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

import torch

from ...copies import CopyBatch, FiniteCheck, Span, finite_groups
from ...copy_check import span_views
from ..plan.budget import Table, buffer_sizes, device_slabs, host_slabs, keeps_every_round, slot
from ..plan.direct import DirectRound, staged_nbytes
from ..plan.reshard_plan import Run, Transfer, run_continues
from ..plan.wire import ALIGN, HEADER_BYTES, HEADER_WORDS, NONFINITE_WORD

# The zero-copy sources a sender checks for NaN/Inf at once, after posting the first round of a chunk: each
# check costs the host some launches (a check per 64 MiB round kept a sender of TP2 -> TP2 on 4xH200 from
# posting its rounds back to back), and a chunk's read (about 0.1 ms per 256 MiB on an H200) runs next to the
# round in flight.
CHECK_CHUNK_BYTES = 256 << 20

__all__ = ["Staging"]


def _joined(a: Run, b: Run) -> Run:
    n = a.length + b.length
    return Run(a.local, a.offset, n, n, 1)


def _coalesced(items) -> list[tuple[tuple[Transfer, ...], Run, Run]]:
    """``(transfer, run, run)`` copies, in order, as ``(transfers, run, run)``: consecutive items whose runs both
    continue the last one's are one copy (the q, k, v rows of each query group of a fused QKV weight held alike on
    both sides are one range: 24 pieces, one copy; TP1 -> TP1 of the 3.6B preset in 512 MiB buckets: 843 pieces,
    173 copies)."""
    out: list[tuple[tuple[Transfer, ...], Run, Run]] = []
    for t, a, b in items:
        if out:
            group, x, y = out[-1]
            if group[-1].itemsize == t.itemsize and run_continues(x, a) and run_continues(y, b):
                out[-1] = (group + (t,), _joined(x, a), _joined(y, b))
                continue
        out.append(((t,), a, b))
    return out


def _in_bucket(bucket, src: bool) -> list[tuple[tuple[Transfer, ...], Run, int]]:
    """A bucket's ``(transfer, byte offset)`` pieces as copies ``(transfers, run, byte offset in the bucket)``, the
    run on the source side (``src``) or the destination side: what :func:`_coalesced` makes of each piece's run
    and its bytes' range in the bucket (consecutive pieces of one itemsize that continue each other on both sides
    are one copy), worked out on integers (a colocated rank's staging coalesces a thousand pieces)."""
    out: list[tuple[tuple[Transfer, ...], Run, int]] = []
    group: list[Transfer] = []
    first = None
    local, start, end, size, at, upto = "", 0, 0, 0, 0, 0  # the open copy: its range, itemsize, bucket bytes

    def close() -> None:
        out.append((tuple(group), first if len(group) == 1 else Run(local, start, end - start, end - start, 1), at))

    for t, off in bucket:
        run = t.src_run if src else t.dst_run
        if (
            group
            and t.itemsize == size
            and off == upto
            and run.count == 1 == first.count
            and run.local == local
            and run.offset == end
        ):
            group.append(t)
            end += run.length
            upto += run.length * size
            continue
        if group:
            close()
        group, first, size, at = [t], run, t.itemsize, off
        local, start, end = run.local, run.offset, run.offset + run.length
        upto = off + t.nbytes
    if group:
        close()
    return out


class Staging:
    """The buffers and copies of one rank's refits.

    ``send`` / ``recv``: this rank's buckets per peer; ``local``: the transfers it
    copies to itself; ``span(run)``: a run of this rank's tensors as a :class:`~megatron_ext.copies.Span`;
    ``headers``: the send buckets ``(peer, k)`` in the order of
    :attr:`header_rows` (one int64 x :data:`~..plan.wire.HEADER_WORDS` row each, written by
    the executor before a refit and packed in front of its bucket).

    Consecutive pieces of a bucket that are one range of a local tensor (and of the bucket) are one copy, and so
    are consecutive local transfers that are one range on both sides (:func:`_coalesced`: a fused QKV weight held
    alike on both sides is one copy, not one per query group and projection).

    ``check``: the copies look for NaN / Inf as they go (:class:`~megatron_ext.copies.CopyBatch`
    ``check=True``): a round's packing raises the non-finite word of each bucket's header
    whose pieces hold one (so the flag travels with the bucket) and keeps one flag per copy
    (:attr:`packed`: the transfers of each, to name them); the local copies of a streaming rank
    keep theirs too (:attr:`local_groups`: the transfers of each). An atomic rank's local copies run only at
    :meth:`apply`, so their sources are listed in :attr:`local_sources` for a check before it
    (:attr:`local_check`).

    Zero-copy rounds (:class:`~..plan.direct.DirectRound`) have no buffer on their sender
    (:attr:`direct_send`: views of its tensors) nor on a streaming receiver (:attr:`direct_recv`: views
    of its tensors, written in place; :meth:`scratch` drains a refused round); an atomic receiver
    stages them like buckets. :attr:`direct_sources` are the sender's zero-copy transfers, checked in chunks
    of rounds (:attr:`direct_slices` by the chunk's first round, :meth:`direct_check` each chunk's
    :class:`~megatron_ext.copies.FiniteCheck`; :attr:`direct_checked`: which transfer each is), whose flags
    raise the header of each pair's last bucket (:attr:`trailer_rows`, packed in :attr:`trailer_rounds`;
    :attr:`direct_pairs`: each source's index there, on the device).

    Copies per round: :attr:`pack` (every peer's header and pieces of round
    ``k``); on atomic receivers :attr:`apply` (every round and the local copies,
    after the last round is checked); on streaming ones :attr:`unpack` per round,
    which also keeps each bucket's header in :attr:`seen` (its buffer is reused
    ``max_inflight`` rounds later, its header checked after the last round), and
    :attr:`local`. With ``host=True`` (atomic only) :meth:`keep` copies a received
    round to the host (:attr:`held`, one pinned buffer per bucket, whose header the
    executor reads there) and :meth:`apply` brings every round back through the slots.

    ``lanes`` (:func:`~..plan.budget.peer_lanes`, the job's pairs in phases): the buffers of a round after
    round 0 belong to a lane, which the peers of other phases share, instead of a peer; a pair's rounds
    then hold None where it posts nothing.
    """

    def __init__(
        self,
        send: Table,
        recv: Table,
        local: list[Transfer],
        span: Callable[[Run], Span],
        headers: list[tuple[int, int]],
        *,
        atomic: bool,
        max_inflight: int,
        device: torch.device,
        host: bool = False,
        check: bool = False,
        lanes: dict | None = None,
    ):
        if host and not atomic:
            raise ValueError("host staging is for atomic receivers (a streaming one writes each round as it arrives)")
        self.atomic, self.max_inflight, self.host, self.lanes = atomic, max_inflight, host, lanes
        self.keep_all = keeps_every_round(atomic, "host" if host else "device")
        sizes = buffer_sizes(
            send, recv, keep_all=self.keep_all, max_inflight=max_inflight, stage_direct=atomic, lanes=lanes
        )
        # a few allocations, not one per buffer; the whole ALIGN units first, so every buffer starts aligned
        order = sorted(sizes, key=lambda key: sizes[key] % ALIGN != 0)
        slabs, at = device_slabs([sizes[key] for key in order])
        self._device_slabs = [torch.empty(n, dtype=torch.uint8, device=device) for n in slabs]
        self.bufs = {key: self._device_slabs[s][off : off + sizes[key]] for key, (s, off) in zip(order, at)}
        pin = device.type == "cuda"
        # host: one buffer per received round, the whole version, in pinned slabs of power-of-two sizes
        kept = (
            [(p, k, staged_nbytes(b)) for p, bs in recv.items() for k, b in enumerate(bs) if b is not None]
            if host
            else []
        )
        slabs, where = host_slabs([n for *_, n in kept])
        self._slabs = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in slabs]
        self.held = {(peer, k): self._slabs[s][off : off + n] for (peer, k, n), (s, off) in zip(kept, where)}
        self.direct_send: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)  # round -> (peer, view)
        self.direct_recv: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self.direct_sources: list[torch.Tensor] = []  # the zero-copy transfers this rank sends, checked
        self.direct_checked: list[Transfer] = []  # ... and which transfer each is
        direct_pair: list[int] = []  # ... and the index of its pair's trailer in trailer_rows
        direct_round: list[int] = []  # ... and the round that first sends it
        trailers: list[int] = []  # header row of each send peer's last bucket, where zero-copy flags go
        self.trailer_rounds: set[int] = set()  # the rounds that pack those buckets
        self._scratch: torch.Tensor | None = None
        self._device = device
        self._views: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}  # (buffer, dtype) -> view
        self.header_rows = torch.zeros((len(headers), HEADER_WORDS), dtype=torch.int64, device=device)
        row = {key: i for i, key in enumerate(headers)}
        pack: dict[int, list] = defaultdict(list)
        also: dict[int, list] = defaultdict(list)  # the header word each packed piece's flag raises
        # round -> each pack pair's transfers (None: the header's copy)
        self.packed: dict[int, list[tuple[Transfer, ...] | None]] = defaultdict(list)
        for peer, buckets in send.items():
            first = {}  # each zero-copy transfer of this peer -> the round of its first op
            for k, b in enumerate(buckets):
                if isinstance(b, DirectRound):
                    first.update((t, k) for op in b.ops for t in op.transfers if t not in first)
            if first:
                trailers.append(row[(peer, len(buckets) - 1)])
                self.trailer_rounds.add(len(buckets) - 1)
                for t, k in first.items():
                    self.direct_sources.append(span(t.src_run).view())
                    self.direct_checked.append(t)
                    direct_pair.append(len(trailers) - 1)
                    direct_round.append(k)
            for k, bucket in enumerate(buckets):
                if bucket is None:
                    continue
                if isinstance(bucket, DirectRound):
                    self.direct_send[k] += [(peer, span(op.src_run).view()) for op in bucket.ops]
                    continue
                buf = self.buf("send", peer, k)
                pack[k].append((buf[:HEADER_BYTES].view(torch.int64), self.header_rows[row[(peer, k)]]))
                also[k].append(None)
                self.packed[k].append(None)
                word = buf[:HEADER_BYTES].view(torch.int32)[2 * NONFINITE_WORD]  # little-endian: the low half
                for ts, run, at in _in_bucket(bucket, True):
                    src = span(run)
                    pack[k].append((self._piece(buf, at, src), src))
                    also[k].append(word)
                    self.packed[k].append(ts)
        self.trailer_rows = torch.tensor(trailers, dtype=torch.int64, device=device)
        # the checked sources (of checked dtypes, grouped by dtype) in chunks of consecutive rounds (at least
        # CHECK_CHUNK_BYTES each, but the last): the chunks' flags, concatenated, are in this order
        order: list[int] = []
        self.direct_slices: dict[int, tuple[int, int]] = {}  # a chunk's first round -> its [start, end) in order
        by_round: dict[int, list[int]] = defaultdict(list)
        for i, k in enumerate(direct_round):
            by_round[k].append(i)
        chunk: list[int] = []
        held = 0  # bytes of the chunk
        rounds = sorted(by_round)
        for n, k in enumerate(rounds):
            chunk += by_round[k]
            held += sum(self.direct_sources[i].nbytes for i in by_round[k])
            if n + 1 < len(rounds) and held < CHECK_CHUNK_BYTES:
                continue
            start = len(order)
            order += [chunk[j] for idx in finite_groups([self.direct_sources[i] for i in chunk]) for j in idx]
            if len(order) > start:  # (a chunk of no checked dtype has nothing to check)
                self.direct_slices[direct_round[chunk[0]]] = (start, len(order))
            chunk, held = [], 0
        self.direct_sources = [self.direct_sources[i] for i in order]
        self.direct_checked = [self.direct_checked[i] for i in order]
        self.direct_pairs = torch.tensor([direct_pair[i] for i in order], dtype=torch.int64, device=device)
        self._direct_checks: dict[int, FiniteCheck] = {}  # a chunk's first round -> its check (direct_check)
        keys = [(peer, k) for peer, buckets in recv.items() for k, b in enumerate(buckets) if isinstance(b, list)]
        # (None: a round in which the pair, in another phase, posts nothing)
        self._seen_rows = torch.zeros((len(keys), HEADER_WORDS), dtype=torch.int64, device=device)
        self.seen = {key: self._seen_rows[i] for i, key in enumerate(keys)}
        unpack: dict[int, list] = defaultdict(list)
        for peer, buckets in recv.items():
            for k, bucket in enumerate(buckets):
                if bucket is None:
                    continue
                if isinstance(bucket, DirectRound):
                    if not atomic:  # in place
                        self.direct_recv[k] += [(peer, span(op.dst_run).view()) for op in bucket.ops]
                        continue
                    buf = self.buf("recv", peer, k)  # staged until the version is applied
                    for op, off in zip(bucket.ops, bucket.offsets):
                        dst = span(op.dst_run)
                        here = self._piece(buf, off, dst)
                        self.direct_recv[k].append((peer, span_views(here, dst)[0]))  # (received in dst's shape)
                        unpack[k].append((dst, here))
                    continue
                buf = self.buf("recv", peer, k)
                if not atomic:
                    unpack[k].append((self.seen[(peer, k)], buf[:HEADER_BYTES].view(torch.int64)))
                for _, run, at in _in_bucket(bucket, False):
                    dst = span(run)
                    unpack[k].append((dst, self._piece(buf, at, dst)))
        coalesced = _coalesced([(t, t.src_run, t.dst_run) for t in local])
        self.local_groups = [ts for ts, _, _ in coalesced]  # the transfers of each local copy, in order
        local_pairs = [(span(dst), span(src)) for _, src, dst in coalesced]
        self.local_sources = [src.view() for _, src in local_pairs] if check and atomic else []
        # each round's copies, built in chunks of rounds (prepare): 0 with the local copies now, then 1, 2-3, 4-7, ...
        # each when the first refit reaches it, while the rounds before it are in flight. Built one round at a time
        # (a table pass and a flag buffer each), a first refit was bound by the host (colocated TP2xPP2 -> TP1xDP4
        # on 4xH200: 104 batches built in 32-74 ms of the transfer, where a round takes 0.45 ms); built all at once,
        # before the agreement, nothing ran next to them. Their pairs are made here: made with each chunk instead
        # (as torch views then), they added more host time to the first transfer than they saved here (colocated
        # TP2xPP2 -> TP1xDP4 on 4xH200, one rank: chunk builds 20 -> 34 ms, staging 21-26 -> 9-15 ms)
        specs: dict[tuple[str, int], tuple[list, dict]] = {
            ("pack", k): (pairs, dict(check=check, also_flag=also[k])) for k, pairs in pack.items()
        }
        if atomic and not host:  # the whole version at once, after the last round's headers are checked
            self._version_pairs = [pair for k in sorted(unpack) for pair in unpack[k]] + local_pairs
        else:
            specs.update({("unpack", k): (pairs, dict(kernel=True)) for k, pairs in unpack.items()})
            specs[("local", 0)] = (local_pairs, dict(check=check and not atomic, kernel=True))
        self.pack: dict[int, CopyBatch] = {}
        self.unpack: dict[int, CopyBatch] = {}
        self.local: CopyBatch | None = None  # (None: an atomic receiver's are in its apply)
        self._chunks: dict[int, list] = defaultdict(list)  # chunk -> its rounds' (kind, round, spec)
        for (kind, k), spec in specs.items():
            self._chunks[k.bit_length()].append((kind, k, spec))
        self.prepare(0)

    def prepare(self, k: int) -> None:
        """Build the copies of round ``k``'s chunk of rounds (:attr:`pack`, :attr:`unpack`: rounds 1, 2-3, 4-7,
        ...; round 0 and :attr:`local` are built with the staging) if not yet built, in one
        :meth:`~megatron_ext.copies.CopyBatch.many`: the executor calls it before it posts round ``k``."""
        chunk = self._chunks.pop(k.bit_length(), None)
        if not chunk:
            return
        for (kind, j, _), batch in zip(chunk, CopyBatch.many([spec for _, _, spec in chunk])):
            if kind == "local":
                self.local = batch
            else:
                (self.pack if kind == "pack" else self.unpack)[j] = batch

    @functools.cached_property
    def _apply(self) -> CopyBatch:
        """An atomic receiver's copies of the whole version (staged on the device), built by :meth:`prepare_apply`
        or at the first apply."""
        return CopyBatch(self._version_pairs, kernel=True)

    def prepare_apply(self) -> None:
        """Build an atomic receiver's copies of the whole version (staged on the device) if not yet built: the
        executor calls it once its rounds are posted, so the host builds them while the rounds are in flight (it
        would wait on them anyway), not after the last one arrived (4-9 ms of a first refit on 4xH200)."""
        if self.atomic and not self.host:
            _ = self._apply

    def direct_check(self, k: int) -> FiniteCheck:
        """The check of the chunk of zero-copy sources that starts at round ``k`` (:attr:`direct_slices`): a
        :class:`~megatron_ext.copies.FiniteCheck` (the copy-check kernel without its stores where it runs),
        one flag per source in the chunk's order, built at its first use."""
        if k not in self._direct_checks:
            start, end = self.direct_slices[k]
            self._direct_checks[k] = FiniteCheck(self.direct_sources[start:end])
        return self._direct_checks[k]

    @functools.cached_property
    def local_check(self) -> FiniteCheck:
        """An atomic rank's check of :attr:`local_sources` (before its apply), built at its first use."""
        return FiniteCheck(self.local_sources)

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """Where a streaming receiver that refused the version drains a zero-copy receive shaped ``like``
        (one buffer, as large as its largest zero-copy op, allocated at the first refusal, then kept)."""
        if self._scratch is None:
            most = max(t.numel() * t.element_size() for ts in self.direct_recv.values() for _, t in ts)
            self._scratch = torch.empty(most, dtype=torch.uint8, device=self._device)
        return self._typed(self._scratch, like.dtype)[: like.numel()].view(like.shape)

    def _piece(self, buf: torch.Tensor, off: int, like: Span) -> Span:
        """The bytes ``off..`` of ``buf`` (a byte buffer) as a contiguous span of ``like``'s dtype and elements
        (no view: a refit's first copies take thousands of pieces). ``off`` is a multiple of the dtype's size
        (pieces start at ``ALIGN``)."""
        whole = self._typed(buf, like.tensor.dtype)
        return Span(whole, off // like.tensor.element_size(), 1, like.numel, like.numel)

    def _typed(self, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Byte buffer ``buf`` viewed in ``dtype`` (its whole elements), once per buffer and dtype."""
        typed = self._views.get((id(buf), dtype))
        if typed is None:
            size = dtype.itemsize
            whole = buf[: buf.numel() // size * size].view(dtype)
            typed = self._views[(id(buf), dtype)] = (buf, whole)  # (the buffer kept: its id stays its own)
        return typed[1]

    def buf(self, kind: str, peer: int, k: int) -> torch.Tensor:
        """The device buffer of round ``k`` of ``kind`` (send|recv) with ``peer``."""
        return self.bufs[slot(kind, peer, k, keep_all=self.keep_all, max_inflight=self.max_inflight, lanes=self.lanes)]

    def keep(self, k: int, peer: int) -> torch.Tensor:
        """Host staging: copy round ``k``'s bucket from ``peer`` to its host buffer (queued on the current
        stream, before the slot is reused) and return the host buffer."""
        held = self.held[(peer, k)]
        held.copy_(self.buf("recv", peer, k)[: held.numel()], non_blocking=True)
        return held

    def apply(self) -> None:
        """Atomic: write the whole version (every round, then the local copies)."""
        if not self.host:
            self._apply.run()
            return
        for k in sorted(self.unpack):  # through the receive slots, as a streaming receiver unpacks
            for (peer, j), held in self.held.items():
                if j == k:
                    self.buf("recv", peer, k)[: held.numel()].copy_(held, non_blocking=True)
            self.unpack[k].run()
        self.local.run()

    @property
    def nbytes(self) -> int:
        """Bytes of staging on the device (a refused streaming receiver's scratch included)."""
        return sum(b.numel() for b in self.bufs.values()) + (0 if self._scratch is None else self._scratch.numel())

    @property
    def host_nbytes(self) -> int:
        """Bytes of staging on the host (atomic receivers with ``host=True``): its pinned slabs."""
        return sum(b.numel() for b in self._slabs)
