"""Stand-ins for :class:`megatron_ext.fsdp_symm.memory.SymmetricMemory` that let
CPU tests run the symmetric staging layout without NCCL, and
:func:`standin_pool`, which puts one in place of the pool."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch


class PlainStandIn:
    """Plain allocations; registration is a no-op."""

    def __init__(self, device, group):
        self.device = torch.device(device)
        self.registered_ptrs: set[int] = set()
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


@contextlib.contextmanager
def standin_pool(memory_cls=PlainStandIn):
    """Within this context, DDP staging (``stage_ddp_buffers``) and our FSDP
    parameter groups see every process group as capable and every layout as
    supported (CPU buffers and gloo included), and take their "symmetric"
    buffers from ``memory_cls`` instead of the NCCL pool. Test-only patches of
    our own modules, undone on exit; staged buffers keep their stand-in."""
    from megatron_ext.fsdp_symm import ddp, fsdp
    from megatron_ext.fsdp_symm.capability import Capability

    def capable(group=None):
        return Capability(True, "stand-in")

    with contextlib.ExitStack() as stack:
        for module in (ddp, fsdp):
            stack.enter_context(mock.patch.object(module, "probe", capable))
            stack.enter_context(mock.patch.object(module, "SymmetricMemory", memory_cls))
        stack.enter_context(mock.patch.object(ddp, "_unsupported", lambda ddp, buffer: None))
        stack.enter_context(
            mock.patch.object(fsdp.SymmFsdpParameterGroup, "_unsupported_layout", lambda self, placements: None)
        )
        yield
