"""The ``inprocess`` transport: buckets handed to a :class:`~..engines.receiver.WeightReceiver` in
this process, or written straight into a consumer's tensors (:func:`push_targets`, also what
``ipc-push`` writes into)."""

from __future__ import annotations

import torch

from ..engines.receiver import WeightReceiver
from ..plan.export_plan import BucketMeta, ExportPlan

__all__ = ["InProcessSender", "push_targets"]


class _Done:
    def wait(self):
        pass


class InProcessSender:
    """Hands buckets to a receiver in this process. A consumer with
    ``target(name)`` (:class:`HFModelConsumer`) is written in place unless
    ``in_place=False`` (an FP8 export: the bucket holds what the consumer does not):
    the gather writes straight into its tensors (``push``), with no export buffers."""

    def __init__(self, receiver: WeightReceiver, *, in_place: bool = True):
        self.receiver = receiver
        self.push = in_place and callable(getattr(receiver.consumer, "target", None))
        self.views: dict[str, torch.Tensor] | None = None
        self._fingerprint = None

    def allocate(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def start(self, plan: ExportPlan, buffers, version: int) -> None:
        if plan.fingerprint != self._fingerprint:
            self.receiver.set_plan(plan, in_place=self.push)
            if self.push:
                self.views = push_targets(plan, self.receiver.consumer, need_cuda=False)
            self._fingerprint = plan.fingerprint
        self.receiver.begin(version, in_place=self.push)

    def send(self, bucket: BucketMeta, buf: torch.Tensor):
        self.receiver.load_bucket(bucket, buf)
        return _Done()

    def finish(self, version: int) -> list[int]:
        if self.push:
            self.receiver.pushed()
        return [self.receiver.finish(version)]

    def abort(self, version: int) -> None:
        self.receiver.abort()

    def close(self) -> None:
        pass


def push_targets(plan: ExportPlan, consumer, *, need_cuda: bool = True) -> dict[str, torch.Tensor]:
    """The consumer's tensor (or view) for every tensor of ``plan``, to be written in
    place; raises ValueError saying why a consumer cannot take pushed weights."""
    target = getattr(consumer, "target", None)
    if not callable(target):
        raise ValueError(
            f"{type(consumer).__name__} has no target(name) to write into; transport='ipc-push' "
            "needs an engine that exposes its weights (HFModelConsumer); use transport='ipc'"
        )
    views = {}
    for t in plan.tensors():
        dst = target(t.name)
        if tuple(dst.shape) != tuple(t.shape) or dst.dtype != t.dtype:
            raise ValueError(
                f"{t.name}: engine tensor is {tuple(dst.shape)} {dst.dtype}, the plan sends {tuple(t.shape)} {t.dtype}"
            )
        if need_cuda and not dst.is_cuda:
            raise ValueError(
                f"{t.name} is on {dst.device}; transport='ipc-push' needs the engine's weights on "
                "the trainer's GPU (use transport='ipc' or 'broadcast')"
            )
        views[t.name] = dst
    return views
