"""The ``ipc-push`` transport (CUDA): the engine shares its weights' storage and the trainer's
gather writes into them."""

from __future__ import annotations

import torch

from ..plan.export_plan import ExportPlan
from .ipc import _storage_bytes, open_shared, share
from .remote import _RemoteSender

__all__ = ["IpcPushSender"]


class IpcPushSender(_RemoteSender):
    """Colocated refit straight into the engine's weights: the engine shares its
    tensors' storage once (with the plan check), and the trainer's gather writes
    every HF tensor into them, so each byte is copied once and the trainer holds
    no export buffers (pipeline stages other than the first still need two, to
    receive). One engine on this GPU whose consumer has ``target(name)``; the
    engine must not run forward passes while a version is being written."""

    push = True

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        if len(addresses) != 1:
            raise ValueError(
                f"transport='ipc-push' writes into one engine's weights; got {len(addresses)} "
                "targets (use transport='ipc' or 'broadcast' for several engines)"
            )
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self.views: dict[str, torch.Tensor] | None = None
        self._bases: list[torch.Tensor] = []

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self._send_all("plan", "sending the plan", plan=plan.to_wire(), info={"kind": "ipc-push"})
            ready = self._expect(0, "ready", "checking the plan")
            self._bases = [open_shared(h) for h in ready["handles"]]
            self.views = {
                name: self._bases[i].view(dtype).as_strided(shape, stride, offset)
                for name, (i, dtype, shape, stride, offset) in ready["entries"].items()
            }
            self._fingerprint = plan.fingerprint
        self._send_all("begin", f"starting version {version}", version=version)

    def send(self, bucket, buf):
        raise RuntimeError("IpcPushSender writes in place; it has no buckets to send")

    def finish(self, version: int) -> list[int]:
        if self._bases:
            torch.cuda.current_stream(self._bases[0].device).synchronize()  # every write has landed
        return super().finish(version)


def _share_targets(views: dict[str, torch.Tensor]):
    """CUDA IPC handles of the storages behind ``views`` and, per name,
    ``[storage index, dtype, shape, stride, offset]`` to rebuild each view."""
    storages: dict[int, int] = {}
    handles, entries = [], {}
    for name, v in views.items():
        storage = v.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = len(handles)
            handles.append(share(_storage_bytes(v)))
        entries[name] = (storages[storage.data_ptr()], v.dtype, tuple(v.shape), tuple(v.stride()), v.storage_offset())
    return handles, entries
