"""The ``ipc`` transport (CUDA): an engine on the same GPU maps the two export buffers through
CUDA IPC handles (:func:`share` / :func:`open_shared`, also ``ipc-push``'s and ``ipc-direct``'s)."""

from __future__ import annotations

import torch

from ..control import channel as control
from ..control.channel import ControlError
from ..plan.errors import ReceiverError
from ..plan.export_plan import BucketMeta
from .remote import _RemoteSender

__all__ = ["IpcSender", "open_shared", "share"]


def share(buf: torch.Tensor) -> dict:
    """A CUDA IPC handle of ``buf`` as plain data, for another process on this host
    (:func:`open_shared`)."""
    if not buf.is_cuda:
        raise ValueError(f"CUDA IPC shares CUDA tensors, got one on {buf.device}; on CPU use transport='broadcast'")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    if args[0] is not torch.Tensor or args[4] is not torch.storage.TypedStorage:
        raise ValueError(f"cannot share a {args[0].__name__} over {args[4].__name__} through CUDA IPC")
    return {"cuda": control.to_wire(list(args[1:4]) + list(args[5:]))}


def open_shared(handle: dict) -> torch.Tensor:
    """The tensor :func:`share` described (mapped, not copied). Only this fixed rebuild
    runs; the handle is data."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = control.from_wire(handle["cuda"]) if isinstance(handle, dict) and "cuda" in handle else None
    if not isinstance(args, list) or len(args) != 13:
        raise ControlError("malformed CUDA IPC handle from the trainer")
    size, stride, offset, *rest = args
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage, *rest)


class _Ack:
    def __init__(self, sender, index):
        self.sender, self.index = sender, index

    def wait(self):
        for i in range(len(self.sender.chans)):
            msg = self.sender._expect(i, "done", f"loading bucket {self.index}")
            if msg["index"] != self.index:
                raise ReceiverError(f"receiver acknowledged bucket {msg['index']}, expected {self.index}")


class IpcSender(_RemoteSender):
    """Shares the two export buffers (CUDA) with engines on this GPU (handles sent
    once per buffer); each bucket is a notice plus an acknowledgement before reuse."""

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self._slots: dict[int, int] = {}

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        if torch.device(device).type != "cuda":
            raise ValueError(
                f"transport='ipc' shares CUDA buffers with an engine on the same GPU; the model is on "
                f"{device}: use transport='broadcast' (gloo on CPU)"
            )
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _transport_info(self, buffers) -> dict:
        self._slots = {b.data_ptr(): i for i, b in enumerate(buffers)}
        return {"kind": "ipc", "handles": [share(b) for b in buffers]}

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        torch.cuda.current_stream(buf.device).synchronize()  # bytes visible to the engine
        self._send_all("bucket", f"sending bucket {bucket.index}", index=bucket.index, slot=self._slots[buf.data_ptr()])
        return _Ack(self, bucket.index)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor spanning ``t``'s whole storage (what a CUDA IPC handle shares)."""
    base = torch.empty(0, dtype=torch.uint8, device=t.device)
    return base.set_(t.untyped_storage())
