"""Count the collectives a rank issues (test support): every ``c10d`` op that reaches
the dispatcher, with the size of the group it ran over and the bytes this rank put
in. Used to show that an NTP bystander issues exactly a uniform job's collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveLog"]

# which positional argument holds this rank's input tensors, per c10d op (the rest: args[0])
_INPUT_ARG = {
    "_reduce_scatter_base_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "reduce_scatter_": 1,
    "allgather_": 1,
    "_allgather_base_": 1,
    "allgather_into_tensor_coalesced_": 1,
    "alltoall_base_": 1,
    "alltoall_": 1,
}


def _tensors(value):
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _group_size(args) -> int | None:
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().name().endswith("ProcessGroup"):
            return dist.ProcessGroup.unbox(a).size()
    return None


class CollectiveLog(TorchDispatchMode):
    """``with CollectiveLog() as log: ...``; ``log.calls``: ``(op, group, bytes)`` per
    collective, ``group`` the size of its process group (``"world"`` where it spans
    every rank), ``bytes`` this rank's input."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, object, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            op = name.split(".")[1]
            tensors = _tensors(args[_INPUT_ARG.get(op, 0)]) if args else []
            size = _group_size(args)
            group = "world" if size is not None and size == dist.get_world_size() and size > 1 else size
            self.calls.append((op, group, sum(t.numel() * t.element_size() for t in tensors)))
        return func(*args, **(kwargs or {}))
