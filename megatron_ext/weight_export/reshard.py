"""Executes a :class:`~.reshard_plan.ReshardPlan` with batched point-to-point transfers.

Every rank of the plan (trainer and engine ranks in one process group) builds a
:class:`ReshardExecutor` once and calls :meth:`~ReshardExecutor.refit` for each
weight version. Transfers between one pair of ranks are packed, in plan order,
into buckets of at most ``bucket_bytes``; round ``k`` moves the ``k``-th bucket
of every pair at once (one ``batch_isend_irecv``), so all peers' buckets are in
flight together and staging memory is bounded by ``bucket_bytes`` per peer.
Staging buffers are allocated on the first refit and reused. A receiver writes
into its local tensors only after every bucket of the version has arrived
(staged whole when ``atomic``), so a failed refit leaves the previous version.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from .hf_mapping import _global_layer_names, unwrap
from .reshard_plan import ReshardPlan, Transfer, fanout_plans, run_view

__all__ = ["FanoutRefit", "RefitStats", "ReshardExecutor", "megatron_tensors"]

_ALIGN = 16


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def megatron_tensors(model) -> dict[str, torch.Tensor]:
    """A Megatron model's parameters under global names (pipeline-stage layer offsets applied)."""
    model = unwrap(model)
    prefixes = _global_layer_names(model)
    out = {}
    for name, p in model.named_parameters():
        for lp, gp in prefixes.items():
            if name.startswith(lp):
                name = gp + name[len(lp):]
                break
        out[name] = p.detach()
    return out


@dataclasses.dataclass
class RefitStats:
    version: int
    seconds: float
    sent_bytes: int
    received_bytes: int
    local_bytes: int
    rounds: int


def _buckets(transfers: list[Transfer], bucket_bytes: int) -> list[list[tuple[Transfer, int]]]:
    """``(transfer, byte offset)`` per bucket; a transfer larger than a bucket fills one alone."""
    out, cur, used = [], [], 0
    for t in transfers:
        if cur and used + t.nbytes > bucket_bytes:
            out.append(cur)
            cur, used = [], 0
        cur.append((t, used))
        used = _align(used + t.nbytes)
    if cur:
        out.append(cur)
    return out


class ReshardExecutor:
    """This rank's part of a reshard plan: what it sends, receives and copies locally.

    ``tensors`` maps this rank's local tensor names (the plan's layout names) to
    its tensors: the trainer's parameters (:func:`megatron_tensors`) on source
    ranks, the engine's tensors on destination ranks. A tensor may have more
    rows than the layout keeps (Megatron's padded vocabulary).
    """

    def __init__(self, plan: ReshardPlan, rank: int, tensors: dict[str, torch.Tensor], *, group=None,
                 bucket_bytes: int = 64 << 20, atomic: bool = True):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.plan, self.rank, self.group = plan, rank, group
        self.tensors, self.atomic = tensors, atomic
        self._check_tensors()
        out, inc = defaultdict(list), defaultdict(list)
        self.local: list[Transfer] = []
        for t in plan.transfers:
            if t.src == rank and t.dst == rank:
                self.local.append(t)
            elif t.src == rank:
                out[t.dst].append(t)
            elif t.dst == rank:
                inc[t.src].append(t)
        self.send = {p: _buckets(ts, bucket_bytes) for p, ts in sorted(out.items())}
        self.recv = {p: _buckets(ts, bucket_bytes) for p, ts in sorted(inc.items())}
        self.rounds = max([len(b) for b in (*self.send.values(), *self.recv.values())], default=0)
        self.device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self._send_buf: dict[int, torch.Tensor] = {}
        self._recv_buf: dict[tuple[int, int], torch.Tensor] = {}
        self.version: int | None = None

    def _check_tensors(self) -> None:
        for layout in (self.plan.src, self.plan.dst):
            for name, lt in layout.tensors.get(self.rank, {}).items():
                t = self.tensors.get(name)
                if t is None:
                    raise KeyError(f"rank {self.rank}: the plan needs local tensor {name!r} "
                                   f"({layout.description}); pass it in `tensors`")
                if tuple(t.shape[1:]) != lt.shape[1:] or t.shape[0] < lt.shape[0] or t.dtype != lt.dtype:
                    raise ValueError(f"rank {self.rank}: {name} is {tuple(t.shape)} {t.dtype}, the layout "
                                     f"keeps {lt.shape} {lt.dtype}; build the layout from this model's config")
                if not t.is_contiguous():
                    raise ValueError(f"rank {self.rank}: {name} must be contiguous")

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() for b in self._send_buf.values()) + sum(b.numel() for b in self._recv_buf.values())

    def _buf(self, cache: dict, key, nbytes: int) -> torch.Tensor:
        buf = cache.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = cache[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def refit(self, version: int) -> RefitStats:
        """Move this rank's share of one weight version; every rank of ``group`` calls it."""
        if self.version is None and dist.is_initialized():
            # one collective before the first batch of P2P ops: NCCL then has the communicator on every
            # rank of the group (PyTorch asks all ranks to join the first batch_isend_irecv)
            dist.barrier(group=self.group)
        start = time.perf_counter()
        sent = received = 0
        staged: list[tuple[torch.Tensor, list[tuple[Transfer, int]]]] = []
        for k in range(self.rounds):
            ops = []
            for peer, buckets in self.send.items():
                if k < len(buckets):
                    bucket = buckets[k]
                    buf = self._buf(self._send_buf, peer, _bucket_nbytes(bucket))
                    for t, off in bucket:
                        view = buf[off:off + t.nbytes].view(self.tensors[t.src_run.local].dtype)
                        view.copy_(run_view(self.tensors[t.src_run.local], t.src_run).reshape(-1))
                    n = _bucket_nbytes(bucket)
                    ops.append(dist.P2POp(dist.isend, buf[:n], peer, group=self.group))
                    sent += n
            for peer, buckets in self.recv.items():
                if k < len(buckets):
                    bucket = buckets[k]
                    n = _bucket_nbytes(bucket)
                    key = (peer, k) if self.atomic else (peer, 0)
                    buf = self._buf(self._recv_buf, key, n)
                    ops.append(dist.P2POp(dist.irecv, buf[:n], peer, group=self.group))
                    staged.append((buf, bucket))
                    received += n
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            if not self.atomic:
                self._unpack(staged)
                staged = []
        # every bucket of this version is here: apply it (local copies too) in one go
        self._unpack(staged)
        local = 0
        for t in self.local:
            dst = run_view(self.tensors[t.dst_run.local], t.dst_run)
            dst.copy_(run_view(self.tensors[t.src_run.local], t.src_run).reshape(dst.shape))
            local += t.nbytes
        self.version = version
        return RefitStats(version, time.perf_counter() - start, sent, received, local, self.rounds)

    def _unpack(self, staged) -> None:
        for buf, bucket in staged:
            for t, off in bucket:
                dst = run_view(self.tensors[t.dst_run.local], t.dst_run)
                dst.copy_(buf[off:off + t.nbytes].view(dst.dtype).view(dst.shape))


def _bucket_nbytes(bucket: list[tuple[Transfer, int]]) -> int:
    t, off = bucket[-1]
    return off + t.nbytes


class FanoutRefit:
    """Updates engine replicas in waves (:func:`~.reshard_plan.fanout_plans`):
    replicas updated in one wave serve the next. Every rank of the job calls
    :meth:`refit`; a rank serves a wave only with the version it applied itself."""

    def __init__(self, src, dst, replicas: list[list[int]], rank: int, tensors: dict[str, torch.Tensor], *,
                 group=None, bucket_bytes: int = 64 << 20, first_wave: int = 1):
        self.plans = fanout_plans(src, dst, replicas, first_wave=first_wave)
        self.rank = rank
        self.trainer = rank in src.ranks
        self.waves = [ReshardExecutor(p, rank, tensors, group=group, bucket_bytes=bucket_bytes) for p in self.plans]
        self.version: int | None = None

    def refit(self, version: int) -> list[RefitStats]:
        stats = []
        for wave, ex in enumerate(self.waves):
            serves = any(t.src == self.rank and t.dst != self.rank for t in ex.plan.transfers)
            if wave and serves and not self.trainer and self.version != version:
                raise RuntimeError(f"rank {self.rank} would serve version {version} in wave {wave} but holds "
                                   f"{self.version}; run the waves in order on every rank")
            stats.append(ex.refit(version))
            if self.rank in ex.plan.dst.ranks:
                self.version = version
        return stats
