"""Can a process group run NCCL symmetric kernels? Probed once per group.

The probe is a collective over the group (every rank must call it, in the same
order): ranks exchange their local findings and host names, and all of them take
the same answer, so no rank ever rendezvouses alone (which would hang). The
exchange also runs a collective on the group's NCCL communicator, so the
communicator exists before the first symmetric-memory rendezvous: that
rendezvous hangs when it has to create the communicator itself.
"""

from __future__ import annotations

import dataclasses
import socket
import warnings

import torch
import torch.distributed as dist

__all__ = ["Capability", "MIN_NCCL", "probe", "local_reason"]

MIN_NCCL = (2, 27, 0)

_CACHE: dict[tuple, tuple] = {}
_WARNED = False


@dataclasses.dataclass(frozen=True)
class Capability:
    """The probe's answer for one process group."""

    available: bool
    reason: str  # why not, or a one-line description of what was found


def local_reason(group=None) -> str | None:
    """Why this rank cannot stage in symmetric memory (``None`` if it can).

    Local checks only: backend, NCCL version, torch APIs, device.
    """
    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialized"
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"process-group backend is {backend!r}, not 'nccl'"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        nccl = tuple(torch.cuda.nccl.version())
    except Exception as exc:  # noqa: BLE001 - any failure means no usable NCCL
        return f"cannot read the NCCL version ({exc})"
    if nccl < MIN_NCCL:
        return f"NCCL {'.'.join(map(str, nccl))} is older than {'.'.join(map(str, MIN_NCCL))} (no symmetric kernels)"
    missing = _missing_torch_apis()
    if missing:
        return f"torch {torch.__version__} lacks {', '.join(missing)}"
    try:
        import torch.distributed._symmetric_memory as symm_mem

        # Must precede the first pool allocation; raises when another backend
        # already allocated symmetric memory in this process.
        symm_mem.set_backend("NCCL")
    except Exception as exc:  # noqa: BLE001 - any refusal means no NCCL symmetric memory
        return f"cannot select the NCCL symmetric-memory backend ({exc})"
    return None


def _missing_torch_apis() -> list[str]:
    missing = []
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return ["torch.distributed._symmetric_memory"]
    for name in ("get_mem_pool", "set_backend", "rendezvous"):
        if not hasattr(symm_mem, name):
            missing.append(f"torch.distributed._symmetric_memory.{name}")
    for name in ("use_mem_pool", "MemPool"):
        if not hasattr(torch.cuda, name):
            missing.append(f"torch.cuda.{name}")
    return missing


def _peer_access_ok(devices: list[int]) -> bool:
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return False
    return True


def probe(group=None) -> Capability:
    """The capability of ``group`` (default: the world group); collective on first call."""
    if not dist.is_available() or not dist.is_initialized():
        return Capability(False, "torch.distributed is not initialized")
    group = group if group is not None else dist.group.WORLD
    # The group object is part of the key (and kept alive, so its id is not
    # reused): a re-created process group reuses names but needs its own probe.
    key = (group.group_name, id(group))
    if key in _CACHE:
        return _CACHE[key][1]
    reason = local_reason(group)
    if reason is not None and dist.get_backend(group) != "nccl":
        # Non-NCCL groups: every rank sees the same backend, no exchange needed.
        cap = Capability(False, reason)
    else:
        device = torch.cuda.current_device()
        mine = (socket.gethostname(), device, reason)
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        # One more collective on the group's own communicator, so it is created
        # before any rendezvous (all_gather_object may use a different path).
        ping = torch.ones(1, device=torch.device("cuda", device))
        dist.all_reduce(ping, group=group)
        torch.cuda.synchronize()
        cap = _combine(everyone)
    _CACHE[key] = (group, cap)
    if not cap.available:
        warn_fallback(cap.reason)
    return cap


def _combine(everyone: list) -> Capability:
    reasons = sorted({r for _, _, r in everyone if r is not None})
    if reasons:
        return Capability(False, "; ".join(reasons))
    hosts = {h for h, _, _ in everyone}
    if len(hosts) > 1:
        return Capability(False, f"the group spans {len(hosts)} hosts (symmetric kernels need all-P2P ranks)")
    devices = sorted({d for _, d, _ in everyone})
    visible = torch.cuda.device_count()
    if len(devices) < len(everyone):
        return Capability(False, "two ranks share one GPU")
    if all(d < visible for d in devices) and not _peer_access_ok(devices):
        return Capability(False, f"GPUs {devices} do not all have peer (P2P) access to each other")
    return Capability(
        True, f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {len(everyone)} ranks with P2P on one host"
    )


def warn_fallback(reason: str) -> None:
    """Warn, once per process, that buffers stay plain and why."""
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    warnings.warn(
        "megatron_ext.fsdp_symm: NCCL symmetric memory is unavailable "
        f"({reason}); all collective buffers use plain memory. To use symmetric kernels, "
        "run on NCCL >= 2.27 with torch >= 2.10 on GPUs with peer access; pass "
        "--symm-mem off (SymmMemConfig(mode='off')) to silence this warning.",
        RuntimeWarning,
        stacklevel=3,
    )
