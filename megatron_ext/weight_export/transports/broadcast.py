"""The ``broadcast`` transport: one ``broadcast`` per bucket over a process group that only the
trainer's export rank and the engine ranks join (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import secrets

import torch

from ..control.channel import ControlError
from ..control.refit_group import make_group
from ..control.store import host_store
from ..plan.errors import ReceiverError
from ..plan.export_plan import BucketMeta
from .remote import _RemoteSender

__all__ = ["BroadcastSender"]


class _Work:
    def __init__(self, work, sender, bucket):
        self.work, self.sender, self.bucket = work, sender, bucket

    def wait(self):
        try:
            self.work.wait()
        except Exception as exc:  # gloo: peer gone; NCCL: timeout/abort
            raise ReceiverError(f"broadcast of bucket {self.bucket} failed ({exc}); a receiver died or hung") from exc


class BroadcastSender(_RemoteSender):
    """Broadcasts each bucket to every receiver over a dedicated process group.

    The trainer's export rank is rank 0 of that group and hosts its store;
    engine ranks ``1..N`` join it when they receive the ``join`` message.
    """

    def __init__(
        self,
        addresses: list[str],
        *,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        store_host: str = "127.0.0.1",
        authkey: bytes | None = None,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        world = len(self.chans) + 1
        key = secrets.token_bytes(32)  # this group's own; it reaches the engines over their authenticated channels
        try:
            store = host_store(store_host, 0, key, timeout_s)
        except OSError as exc:
            raise ControlError(
                f"cannot host the broadcast group's store at {store_host} ({exc}); give store_host= an address "
                "of this machine that the engines reach"
            ) from exc
        for rank in range(1, world):
            self.chans[rank - 1].send(
                "join",
                address=store.address,
                key=key,
                rank=rank,
                world=world,
                backend=backend,
                timeout_s=timeout_s,
            )
        self.store = store
        self.pg = make_group(store, 0, world, backend, timeout_s)
        self.backend = backend

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        return _Work(self.pg.broadcast(buf[: bucket.nbytes], 0), self, bucket.index)

    def close(self) -> None:
        super().close()
        if getattr(self, "store", None) is not None:
            self.store.close()
            self.store = None
