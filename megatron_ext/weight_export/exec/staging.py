"""A reshard rank's staging: its buffers and every copy of a refit, built once.

A rank sends each peer its buckets (:func:`~..plan.wire.bucketize`) from send buffers
and receives theirs into receive buffers, one buffer per ``(send|recv, peer,
slot)`` (:func:`slot`): ``max_inflight`` slots per peer, except that an atomic
receiver keeps every round (nothing is written before the last one arrives).
:class:`Staging` allocates them and builds every copy of a refit as
``(dst, src)`` views over the fixed buffers and tensors: packing a round (each
bucket's header row and pieces), unpacking it, and the rank's local copies. A
refit then issues batched copies (:class:`~megatron_ext.copies.CopyBatch`)
without rebuilding hundreds of views, so the tensors must be updated in place.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from ...copies import CopyBatch
from ..plan.reshard_plan import Run, Transfer
from ..plan.wire import HEADER_BYTES, bucket_nbytes

__all__ = ["Staging", "buffer_sizes", "slot"]

Table = dict[int, list[list[tuple[Transfer, int]]]]  # peer -> buckets of (transfer, byte offset)


def slot(kind: str, peer: int, k: int, *, atomic: bool, max_inflight: int) -> tuple[str, int, int]:
    """The staging buffer of round ``k`` with ``peer``: atomic receivers keep every round."""
    return kind, peer, k if (kind == "recv" and atomic) else k % max_inflight


def buffer_sizes(send: Table, recv: Table, *, atomic: bool, max_inflight: int) -> dict[tuple[str, int, int], int]:
    """Bytes of each staging buffer, by ``(send|recv, peer, slot)``."""
    sizes: dict[tuple[str, int, int], int] = {}
    for kind, table in (("send", send), ("recv", recv)):
        for peer, buckets in table.items():
            for k, bucket in enumerate(buckets):
                key = slot(kind, peer, k, atomic=atomic, max_inflight=max_inflight)
                sizes[key] = max(sizes.get(key, 0), bucket_nbytes(bucket))
    return sizes


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two run views of one box in the same shape, still views (never a copy: the copies are
    built once and must see later in-place updates). A strided run is ``(rows, length)``; a
    contiguous one ``(1, n)`` takes the other's shape."""
    if a.shape == b.shape:
        return a, b
    if a.shape[0] == 1:
        return a.view(b.shape), b
    if b.shape[0] == 1:
        return a, b.view(a.shape)
    raise ValueError(f"runs of one box with shapes {tuple(a.shape)} and {tuple(b.shape)}")


class Staging:
    """The buffers and copies of one rank's refits.

    ``send`` / ``recv``: this rank's buckets per peer; ``local``: the transfers it
    copies to itself; ``view(run)``: a run's view of this rank's tensors;
    ``headers``: the send buckets ``(peer, k)`` in the order of
    :attr:`header_rows` (one int64 x 4 row each, written by the executor before a
    refit and packed in front of its bucket).

    Copies per round: :attr:`pack` (every peer's header and pieces of round
    ``k``); on atomic receivers :attr:`apply` (every round and the local copies,
    after the last round is checked); on streaming ones :attr:`unpack` per round,
    which also keeps each bucket's header in :attr:`seen` (its buffer is reused
    ``max_inflight`` rounds later, its header checked after the last round), and
    :attr:`local`.
    """

    def __init__(
        self,
        send: Table,
        recv: Table,
        local: list[Transfer],
        view: Callable[[Run], torch.Tensor],
        headers: list[tuple[int, int]],
        *,
        atomic: bool,
        max_inflight: int,
        device: torch.device,
    ):
        self.atomic, self.max_inflight = atomic, max_inflight
        sizes = buffer_sizes(send, recv, atomic=atomic, max_inflight=max_inflight)
        self.bufs = {key: torch.empty(n, dtype=torch.uint8, device=device) for key, n in sizes.items()}
        self.header_rows = torch.zeros((len(headers), 4), dtype=torch.int64, device=device)
        row = {key: i for i, key in enumerate(headers)}
        pack: dict[int, list] = defaultdict(list)
        for peer, buckets in send.items():
            for k, bucket in enumerate(buckets):
                buf = self.buf("send", peer, k)
                pack[k].append((buf[:HEADER_BYTES].view(torch.int64), self.header_rows[row[(peer, k)]]))
                for t, off in bucket:
                    src = view(t.src_run)
                    pack[k].append((buf[off : off + t.nbytes].view(src.dtype).view(src.shape), src))
        self.pack = {k: CopyBatch(pairs) for k, pairs in pack.items()}
        keys = [(peer, k) for peer, buckets in recv.items() for k in range(len(buckets))]
        self._seen_rows = torch.zeros((len(keys), 4), dtype=torch.int64, device=device)
        self.seen = {key: self._seen_rows[i] for i, key in enumerate(keys)}
        unpack: dict[int, list] = defaultdict(list)
        for peer, buckets in recv.items():
            for k, bucket in enumerate(buckets):
                buf = self.buf("recv", peer, k)
                if not atomic:
                    unpack[k].append((self.seen[(peer, k)], buf[:HEADER_BYTES].view(torch.int64)))
                for t, off in bucket:
                    dst = view(t.dst_run)
                    unpack[k].append((dst, buf[off : off + t.nbytes].view(dst.dtype).view(dst.shape)))
        local_pairs = [_same_shape(view(t.dst_run), view(t.src_run)) for t in local]
        self.local = CopyBatch(local_pairs)
        if atomic:  # the whole version at once, after the last round's headers are checked
            self.apply = CopyBatch([pair for k in sorted(unpack) for pair in unpack[k]] + local_pairs)
        else:
            self.unpack = {k: CopyBatch(pairs) for k, pairs in unpack.items()}

    def buf(self, kind: str, peer: int, k: int) -> torch.Tensor:
        """The buffer of round ``k`` of ``kind`` (send|recv) with ``peer``."""
        return self.bufs[slot(kind, peer, k, atomic=self.atomic, max_inflight=self.max_inflight)]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs.values())
