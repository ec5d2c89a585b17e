"""The ``ipc-direct`` transport (CUDA, TP=PP=EP=1 trainers): no export buffers; the engine maps
the trainer's parameter storage and copies each HF tensor straight out of it. That copy is the one
read of the version, so the NaN/Inf check runs in it, on the engine (:class:`DirectCopies`): a
non-finite version is found after it was written in place, and the engine then reports that it
holds no complete version."""

from __future__ import annotations

import torch

from ...copies import CopyBatch
from ..plan.export_plan import ExportPlan
from ..plan.reshard_plan import run_view
from .ipc import _storage_bytes, share
from .remote import _RemoteSender

__all__ = ["DirectCopies", "IpcDirectSender", "direct_copies", "direct_entries"]


class IpcDirectSender(_RemoteSender):
    """Colocated refit without export buffers: the engine maps the trainer's
    parameter storage once and copies every HF tensor straight out of it."""

    direct = True

    def __init__(self, addresses: list[str], *, timeout_s: float = 120.0, authkey: bytes | None = None):
        super().__init__(addresses, timeout_s=timeout_s, authkey=authkey)
        self._info = None
        self._device = None
        self.check_finite = True  # the engine checks as it copies (the exporter sets its config's)

    def prepare(self, transfers, tensors: dict[str, torch.Tensor]) -> None:
        """Share the parameter storage (once) and describe every piece of every HF tensor in it."""
        if any(not t.is_cuda for t in tensors.values()):
            raise ValueError("transport='ipc-direct' needs the model on a CUDA device; use transport='ipc'")
        self._device = next(iter(tensors.values())).device if tensors else None
        self._bases, entries = direct_entries(transfers, tensors)  # keeps the shared storage alive
        self._info = {"kind": "ipc-direct", "handles": [share(b) for b in self._bases], "entries": entries}
        self._fingerprint = None  # new handles: send the plan again

    def _transport_info(self, buffers) -> dict:
        if self._info is None:
            raise RuntimeError("IpcDirectSender.prepare() must run before start()")
        return self._info

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if self._device is not None:
            torch.cuda.current_stream(self._device).synchronize()  # the weights are final
        super().start(plan, buffers, version)

    def _begin_fields(self) -> dict:
        return {"check": self.check_finite}

    def send(self, bucket, buf):
        raise RuntimeError("IpcDirectSender has no buckets to send")


def direct_entries(transfers, tensors: dict[str, torch.Tensor]):
    """Each piece of the plan's HF tensors (one trainer rank, TP=1) as a strided view of
    a parameter storage.

    Returns the storages (uint8 tensors spanning each one) and, per piece,
    ``(hf_name, box ranges, storage index, dtype, shape, stride, offset)``.
    """
    storages: dict[int, tuple[int, torch.Tensor]] = {}
    entries = []
    for t in transfers:
        p = tensors[t.src_run.local]
        storage = p.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = (len(storages), _storage_bytes(p))
        src = run_view(p, t.src_run).view(t.box.shape)
        entries.append(
            (
                t.name,
                [list(r) for r in t.box.ranges],
                storages[storage.data_ptr()][0],
                p.dtype,
                tuple(src.shape),
                tuple(src.stride()),
                src.storage_offset(),
            )
        )
    bases = [b for _, b in sorted(storages.values(), key=lambda x: x[0])]
    return bases, entries


class DirectCopies:
    """The engine's copies of a direct plan: ``pairs`` (destination box, source view) and the HF
    name of each; :meth:`run` issues them as one :class:`~...copies.CopyBatch` (built once per
    ``check``) and, with ``check``, returns its NaN/Inf flags."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], names: list[str]):
        self.pairs, self.names = pairs, names
        self._batches: dict[bool, CopyBatch] = {}

    def __len__(self) -> int:
        return len(self.pairs)

    def run(self, check: bool = False) -> torch.Tensor | None:
        batch = self._batches.get(check)
        if batch is None:
            batch = self._batches[check] = CopyBatch(self.pairs, check=check)
        return batch.run()


def direct_copies(bases, entries, consumer):
    """The receiver's copies for a direct plan, built once per plan: :class:`DirectCopies` of
    ``(destination box, source view)`` pairs, and, for consumers without ``target(name)``,
    ``(name, [(box slices, source view)])`` per tensor (assembled whole before ``load_weights``)."""
    target = getattr(consumer, "target", None)
    pairs, names, loads = [], [], {}
    for name, ranges, index, dtype, shape, stride, offset in entries:
        src = bases[index].view(dtype).as_strided(shape, stride, offset)
        box = tuple(slice(a, b) for a, b in ranges)
        if target is not None:
            pairs.append((target(name)[box], src))
            names.append(name)
        else:
            loads.setdefault(name, []).append((box, src))
    return DirectCopies(pairs, names), list(loads.items())
