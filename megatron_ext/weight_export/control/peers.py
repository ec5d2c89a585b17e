"""The ranks a reshard refit moves bytes between: one small interface, two implementations.

:class:`~..exec.reshard.ReshardExecutor` asks four things of its group, and nothing else:

- :meth:`Peers.post`: post a batch of ``("send" | "recv", tensor, peer)`` ops, get waitables;
- :meth:`Peers.gather_notes`: every rank's int and short note (the first-refit agreement,
  the NaN/Inf report), in rank order (:meth:`Peers.gather_words`: a few ints per rank, through it);
- :meth:`Peers.sum`: an int summed over the ranks (the NaN/Inf flag);
- :meth:`Peers.ranks` / :attr:`Peers.word`: how errors name the ranks.

Implementations: :class:`DistPeers`, a ``torch.distributed`` group of one job (the
default world when None; a lone process without ``torch.distributed``), and
:class:`~.refit_group.RefitGroup`, the refit ranks of a trainer job and a separate
engine job. :func:`as_peers` picks one for what the user passed as ``group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["NOTE_BYTES", "DistPeers", "Peers", "as_peers", "nccl_coalesced"]

NOTE_BYTES = 1016  # the longest reason a rank gives its peers at the first-refit agreement (utf-8, cut there)


def cut_note(note: str) -> str:
    return note.encode()[:NOTE_BYTES].decode(errors="ignore")


class Peers:
    """What a reshard executor needs of the ranks of its plan."""

    word = "rank"  # how errors name one of them

    def ranks(self, n: int) -> list[int]:
        """The plan ranks of the group's ``n`` members, in group order."""
        return list(range(n))

    def post(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        raise NotImplementedError

    def gather_notes(
        self, value: int, note: str, device: torch.device | None = None, *, what: str
    ) -> list[tuple[int, str]]:
        raise NotImplementedError

    def sum(self, value: torch.Tensor) -> int:
        raise NotImplementedError

    def gather_words(self, words: list[int], device: torch.device | None = None, *, what: str) -> list[list[int]]:
        """Every rank's ``words`` (a few ints, as many on every rank), in rank order: one :meth:`gather_notes`."""
        got = self.gather_notes(len(words), " ".join(str(int(w)) for w in words), device, what=what)
        return [[int(w) for w in note.split()] for _, note in got]

    def start(self) -> None:
        """Called once every rank has arrived, before the first batch of point-to-point ops."""


class DistPeers(Peers):
    """A ``torch.distributed`` group of this job (None: the default world); peers are global ranks."""

    def __init__(self, group=None):
        self.group = group
        self._backend: str | None = None
        self._ranks: dict[int, int] | None = None  # global rank -> group rank

    def ranks(self, n: int) -> list[int]:
        if self.group is None or not dist.is_initialized():
            return list(range(n))
        return dist.get_process_group_ranks(self.group)

    def post(self, ops):
        """NCCL: one group launch on the process group itself, as ``torch.distributed.batch_isend_irecv`` does, without
        its per-op Python checks (:func:`nccl_coalesced`; 4xH200, colocated TP2xPP2 -> TP1xDP4, 52 rounds: a rank's
        posts took 8.0 -> 6.5 ms of host time per refit); other backends through it."""
        if ops and ops[0][1].is_cuda and dist.is_initialized() and self._nccl():
            pg = self.group if self.group is not None else dist.group.WORLD
            return nccl_coalesced(pg, [(k, t, self._in_group(peer)) for k, t, peer in ops], ops[0][1].device)
        return dist.batch_isend_irecv(
            [dist.P2POp(dist.isend if k == "send" else dist.irecv, t, peer, group=self.group) for k, t, peer in ops]
        )

    def _nccl(self) -> bool:
        """Whether the group's CUDA tensors go through NCCL (``"nccl"``, or e.g. ``"cpu:gloo,cuda:nccl"``)."""
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group))
        return "nccl" in self._backend

    def _in_group(self, peer: int) -> int:
        """A global rank's rank in the group."""
        if self.group is None:
            return peer
        if self._ranks is None:
            self._ranks = {r: i for i, r in enumerate(dist.get_process_group_ranks(self.group))}
        return self._ranks[peer]

    def _device(self, device: torch.device) -> torch.device:
        if dist.get_backend(self.group) == "nccl" and device.type == "cpu":  # a rank with no tensors of the plan
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def gather_notes(self, value, note, device=None, *, what):
        """One all-gather of ``8 +`` :data:`NOTE_BYTES` bytes per rank (on ``device``: this rank's)."""
        if not dist.is_initialized():
            return [(value, cut_note(note))]
        raw = cut_note(note).encode()
        mine = torch.zeros(8 + NOTE_BYTES, dtype=torch.uint8)
        mine[:8].view(torch.int64)[0] = value
        if raw:
            mine[8 : 8 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        device, world = self._device(device or torch.device("cpu")), dist.get_world_size(self.group)
        out = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(out, mine.to(device), group=self.group)
        return [
            (int(row[:8].view(torch.int64)[0]), bytes(row[8:].tolist()).rstrip(b"\0").decode(errors="ignore"))
            for row in out.view(world, -1).cpu()
        ]

    def sum(self, value):
        if not dist.is_initialized():
            return int(value.item())
        t = value.to(self._device(value.device), copy=True)
        dist.all_reduce(t, group=self.group)
        return int(t.item())


def nccl_coalesced(pg, ops: list[tuple[str, torch.Tensor, int]], device: torch.device | None = None) -> list:
    """``("send" | "recv", tensor, peer)`` NCCL ops (peers: ranks of ``pg``) in one group launch; one work.

    ``torch.distributed.batch_isend_irecv`` does this for a registered group (``_coalescing_manager`` calls
    ``ProcessGroup._start_coalescing(device)``, issues each op, and ``_end_coalescing(device)`` returns one work;
    torch 2.10-2.14), after checks per op in Python. Here the same calls on ``pg``: a registered
    ``ProcessGroup`` (``device`` given) or a standalone NCCL backend object (``device`` None), whose own bindings
    the ``ProcessGroup`` ones forward to. They are private; this is the only place that uses them.
    """
    start, end = getattr(pg, "_start_coalescing", None), getattr(pg, "_end_coalescing", None)
    if start is None or end is None:
        raise RuntimeError(
            f"torch {torch.__version__}: the NCCL process group has no _start_coalescing/_end_coalescing; batched "
            "point-to-point needs torch 2.10-2.14 (or use backend='gloo')"
        )
    where = () if device is None else (device,)
    start(*where)
    try:
        for kind, t, peer in ops:
            (pg.send if kind == "send" else pg.recv)([t], peer, 0)
    finally:
        work = end(*where)
    return [work] if work is not None else []


def as_peers(group) -> Peers:
    """``group`` as the executor's :class:`Peers`: a :class:`~.refit_group.RefitGroup` (or any
    :class:`Peers`) as it is, a ``torch.distributed`` group or None (the default world) wrapped."""
    return group if isinstance(group, Peers) else DistPeers(group)
