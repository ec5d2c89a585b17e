"""Stand-ins for :class:`megatron_ext.fsdp_symm.memory.SymmetricMemory` that let
CPU tests run the symmetric staging layout without NCCL."""

from __future__ import annotations

import contextlib

import torch


class PlainStandIn:
    """Plain allocations; registration is a no-op."""

    def __init__(self, device, group):
        self.device = torch.device(device)
        self.rendezvous_calls = 0

    def allocating(self):
        return contextlib.nullcontext()

    def empty(self, numel, dtype, check=False):
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self.register(t, check)
        return t

    def register(self, tensor, check=False):
        pass


class MismatchStandIn(PlainStandIn):
    """The first checked registration reports a placement mismatch, as a real
    pool does when the ranks' pools diverged (every rank raises, so every rank
    falls back)."""

    raised = False

    def register(self, tensor, check=False):
        from megatron_ext.fsdp_symm import SymmetricPlacementMismatch

        if check and not MismatchStandIn.raised:
            MismatchStandIn.raised = True
            raise SymmetricPlacementMismatch("stand-in: placements differ.")
