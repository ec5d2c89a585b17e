"""Allocation in PyTorch's NCCL symmetric-memory pool, and window registration.

Every tensor used as a send or receive buffer of a symmetric collective is
allocated from the pool and registered (``rendezvous``) right after it is
allocated, never before each collective. Registration is per pool allocation:
PyTorch keeps the NCCL window with the allocation, and the pool keeps freed
allocations cached for reuse, so a buffer that is released and reallocated at
the same size gets its registered allocation back and registering it again is a
no-op lookup. :class:`SymmetricMemory` also skips that lookup when a buffer comes
back at the address it had.
"""

from __future__ import annotations

import torch

__all__ = ["SymmetricMemory", "move_storage"]

_POOLS: dict = {}


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

    def allocating(self):
        """Context in which this thread's allocations on the device come from the pool."""
        return torch.cuda.use_mem_pool(self.pool, device=self.device)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new registered 1-D pool tensor."""
        with self.allocating():
            t = torch.empty(numel, dtype=dtype, device=self.device)
        self.register(t)
        return t

    def register(self, tensor: torch.Tensor) -> None:
        """Register ``tensor``'s allocation for the group (collective on first use
        of an allocation; every rank allocates the same buffers in the same order)."""
        if tensor.numel() == 0:
            return
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in self.registered_ptrs:
            return
        self._symm_mem.rendezvous(tensor, group=self.group_name)
        self.rendezvous_calls += 1
        self.registered_ptrs.add(ptr)

    @property
    def windows(self) -> int:
        """Distinct allocations registered so far (constant in steady state)."""
        return len(self.registered_ptrs)


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
