"""Allocation in PyTorch's NCCL symmetric-memory pool, and window registration.

Every tensor used as a send or receive buffer of a symmetric collective is
allocated from the pool and registered (``rendezvous``) right after it is
allocated, never before each collective. PyTorch registers the whole pool
allocation (segment) as one NCCL window per process group and keeps it with the
allocation; the pool caches freed blocks, so a buffer released and allocated
again comes back inside a registered segment and registering it again is a
no-op lookup. :class:`SymmetricMemory` skips that lookup when a buffer comes
back at the address it had.

Windows are never deregistered: torch 2.10-2.11's NCCL backend frees the memory
of a released segment (``ncclMemFree``) but never calls
``ncclCommWindowDeregister``, so the window keeps its share of the
communicator's symmetric address space (``NCCL_WIN_STRIDE``, by default the
GPU's memory rounded up to 4 GiB) and NCCL keeps the memory mapped. The pool
keeps its segments for the life of the process (PyTorch's ``empty_cache`` does
not release an active private pool), so segments are reused, not leaked; the
number of windows grows only when the pool needs a new segment.

Registration is collective and symmetric kernels address a peer's buffer at the
local buffer's offset in the matching window, so every rank must get its
buffer at the same offset of the same segment. The pool hands out blocks by
its own history, which diverges when ranks free blocks at different times (a
dropped model collected by Python's cyclic GC at different moments, say).
:meth:`SymmetricMemory.register` with ``check=True`` (used at construction)
compares the placement across ranks first and raises
:class:`SymmetricPlacementMismatch` on every rank instead of registering
mismatched buffers; :func:`release_storage` frees staged buffers on every rank
at the same point, which keeps the pools in step.
"""

from __future__ import annotations

import gc

import torch

__all__ = [
    "SymmetricMemory",
    "SymmetricPlacementMismatch",
    "SymmetricRegistrationError",
    "move_storage",
    "quiesce",
    "release_storage",
    "window_stats",
]

_POOLS: dict = {}
# (device, group name) -> {segment base address: (registration index, bytes)}:
# the pool segments registered as NCCL windows for that group, process-wide.
_WINDOWS: dict[tuple[str, str], dict[int, tuple[int, int]]] = {}


class SymmetricRegistrationError(RuntimeError):
    """NCCL window registration of a symmetric buffer failed."""


class SymmetricPlacementMismatch(SymmetricRegistrationError):
    """Ranks got a symmetric buffer at different places of their pools."""


def window_stats(device, group_name: str) -> dict:
    """Windows (pool segments) registered for ``group_name`` on ``device``: count, bytes."""
    wins = _WINDOWS.get((str(torch.device(device)), group_name), {})
    return {"windows": len(wins), "bytes": sum(size for _, size in wins.values())}


def quiesce() -> None:
    """Free pending garbage and wait for the device, so that blocks of dropped
    models go back to the pool now (at the same point on every rank)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class SymmetricMemory:
    """The symmetric pool of one device, registered for one process group."""

    def __init__(self, device: torch.device, group):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self.device = torch.device(device)
        self.group = group
        self.group_name = group.group_name
        if self.device not in _POOLS:
            # Must come before the first pool allocation; a no-op when already NCCL.
            symm_mem.set_backend("NCCL")
            _POOLS[self.device] = symm_mem.get_mem_pool(self.device)
        self.pool = _POOLS[self.device]
        self.registered_ptrs: set[int] = set()
        self.rendezvous_calls = 0

    @property
    def _windows(self) -> dict[int, tuple[int, int]]:
        return _WINDOWS.setdefault((str(self.device), self.group_name), {})

    def allocating(self):
        """Context in which this thread's allocations on the device come from the pool."""
        return torch.cuda.use_mem_pool(self.pool, device=self.device)

    def empty(self, numel: int, dtype: torch.dtype, check: bool = False) -> torch.Tensor:
        """A new registered 1-D pool tensor (``check``: see :meth:`register`)."""
        with self.allocating():
            t = torch.empty(numel, dtype=dtype, device=self.device)
        self.register(t, check=check)
        return t

    def placement(self, tensor: torch.Tensor) -> tuple[int, int, int, int]:
        """``(registration index or -1 if its segment is new, segment bytes,
        offset in the segment, storage bytes)`` of ``tensor``'s storage."""
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        base, size = _segment_of(self.pool, ptr) or (ptr, storage.nbytes())
        index, _ = self._windows.get(base, (-1, size))
        return index, size, ptr - base, storage.nbytes()

    def register(self, tensor: torch.Tensor, check: bool = False) -> None:
        """Register ``tensor``'s allocation for the group (collective on first use
        of an allocation; every rank allocates the same buffers in the same order).

        ``check=True`` (collective: every rank must call it at the same point)
        first compares the buffer's place in the pool across ranks and raises
        :class:`SymmetricPlacementMismatch` on every rank when they differ.
        """
        if tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.registered_ptrs and not check:
            return
        if check:
            self._check_placement(tensor)
        try:
            self._symm_mem.rendezvous(tensor, group=self.group_name)
        except Exception as exc:  # noqa: BLE001 - re-raised with what to do
            stats = window_stats(self.device, self.group_name)
            raise SymmetricRegistrationError(
                f"megatron_ext.fsdp_symm: registering a {storage.nbytes()}-byte symmetric buffer "
                f"as an NCCL window for group {self.group_name!r} failed ({exc}). This process "
                f"has {stats['windows']} windows ({stats['bytes'] / (1 << 20):.0f} MiB) on that "
                "group. Likely causes: the ranks allocated different symmetric buffers (a staged "
                "model dropped on some ranks only: call megatron_ext.fsdp_symm."
                "release_symmetric_memory(model) on every rank before building the next one); or "
                "the communicator's symmetric address space (NCCL_WIN_STRIDE, default: GPU "
                "memory) is used up, since torch <= 2.11 never deregisters windows. Use "
                "--symm-mem off (SymmMemConfig(mode='off')) to stage in plain memory."
            ) from exc
        self.rendezvous_calls += 1
        self.registered_ptrs.add(ptr)
        base, size = _segment_of(self.pool, ptr) or (ptr, storage.nbytes())
        windows = self._windows
        if base not in windows:
            windows[base] = (len(windows), size)

    def _check_placement(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        mine = self.placement(tensor)
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        if any(p != everyone[0] for p in everyone):
            raise SymmetricPlacementMismatch(
                "megatron_ext.fsdp_symm: the ranks got this symmetric buffer at different places "
                "of their symmetric pools (per rank: registered segment index or -1 if new, "
                f"segment bytes, offset, bytes = {everyone}); symmetric kernels need the same "
                "place on every rank. A staged model was probably freed on some ranks earlier "
                "than on others: call megatron_ext.fsdp_symm.release_symmetric_memory(model) on "
                "every rank before dropping it."
            )


def _segment_of(pool, ptr: int) -> tuple[int, int] | None:
    """``(base address, bytes)`` of the pool segment holding ``ptr``, or ``None``."""
    try:
        segments = pool.snapshot()
    except Exception:  # noqa: BLE001 - older torch: filter the device-wide snapshot
        try:
            segments = torch.cuda.memory_snapshot(pool.id)
        except Exception:  # noqa: BLE001 - no snapshot API: caller uses the storage
            return None
    for seg in segments:
        base = seg.get("address")
        if base is not None and base <= ptr < base + seg.get("total_size", 0):
            return base, seg["total_size"]
    return None


def move_storage(tensor: torch.Tensor, allocating) -> None:
    """Move ``tensor``'s storage into a new allocation made under ``allocating()``,
    keeping the Storage object (so every view of it stays valid) and its contents."""
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return
    saved = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
    saved.copy_(torch.tensor([], dtype=torch.uint8, device=tensor.device).set_(storage))
    storage.resize_(0)
    with allocating():
        storage.resize_(nbytes)
    torch.tensor([], dtype=torch.uint8, device=tensor.device).set_(storage).copy_(saved)


def release_storage(tensors) -> int:
    """Free the storages of ``tensors`` (every view of them becomes empty) after
    the device is idle; returns the bytes freed. Symmetric ones go back to the
    pool, still registered, for the next staged model to reuse."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    freed, seen = 0, set()
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        freed += storage.nbytes()
        storage.resize_(0)
    return freed
