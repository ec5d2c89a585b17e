"""The engine side: check the plan, load buckets, report the applied version.

A :class:`WeightReceiver` wraps a *consumer*, anything with
``load_weights(iterable of (hf_name, tensor))`` and optionally
``expected_tensors() -> {name: (shape, dtype)}``: the shape of vLLM's and
SGLang's weight-update entry points. :class:`HFModelConsumer` is the consumer
for a ``transformers`` model.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .hf_moe import fused_expert_views
from .plan import BucketMeta, ExportPlan, PlanMismatch, check_plan, unpack

__all__ = ["HFModelConsumer", "LoadWeightsConsumer", "WeightReceiver"]


class HFModelConsumer:
    """Loads streamed weights into a Hugging Face ``transformers`` model in place.

    Names are the checkpoint's: fused 3-D expert parameters (``transformers`` 5
    MoE models) are addressed per expert, ``...mlp.experts.{e}.gate_proj.weight``
    etc., through views into them (:func:`~.hf_moe.fused_expert_views`).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        views, fused = fused_expert_views(model)
        # Tied weights appear once in named_parameters.
        self._targets = {n: p.detach() for n, p in model.named_parameters() if n not in fused}
        self._targets.update(views)

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (tuple(t.shape), t.dtype) for n, t in self._targets.items()}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        pairs = [(self._targets[name], tensor) for name, tensor in weights]
        if pairs:
            dsts, srcs = zip(*pairs)
            torch._foreach_copy_(list(dsts), list(srcs))  # one launch for the bucket

    def target(self, name: str) -> torch.Tensor:
        """The tensor (or view) that receives ``name`` (lets direct IPC copy straight into it)."""
        return self._targets[name]

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        device = next(self.model.parameters()).device
        with torch.no_grad():
            return self.model(input_ids=tokens.to(device)).logits.float().cpu()


class LoadWeightsConsumer:
    """Adapts a bare ``load_weights`` callable (e.g. vLLM's ``model.load_weights``).

    ``expected`` (name -> (shape, dtype)) enables the pre-transfer plan check;
    without it the engine's own loader validates names as they arrive.
    """

    def __init__(self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
                 expected: dict | None = None):
        self._load = load_weights
        self._expected = expected

    def expected_tensors(self):
        return self._expected

    def load_weights(self, weights):
        self._load(weights)


class WeightReceiver:
    """Checks a plan once, loads its buckets, and counts a version as applied
    only when every bucket of it arrived."""

    def __init__(self, consumer):
        self.consumer = consumer
        self.plan: ExportPlan | None = None
        self.applied_version: int | None = None
        self._version: int | None = None
        self._arrived: set[int] = set()
        self.plans_received = 0

    def set_plan(self, plan: ExportPlan) -> None:
        """Validate ``plan`` against the consumer before any byte is written."""
        expected = getattr(self.consumer, "expected_tensors", lambda: None)()
        if expected is not None:
            check_plan(plan, expected)
        self.plan = plan
        self.plans_received += 1

    def begin(self, version: int) -> None:
        if self.plan is None:
            raise PlanMismatch("no plan received before version begin")
        self._version, self._arrived = version, set()

    def load_bucket(self, bucket: BucketMeta, buf: torch.Tensor) -> None:
        if self._version is None:
            raise RuntimeError(f"bucket {bucket.index} arrived outside a version")
        self.consumer.load_weights(unpack(bucket, buf))
        self._arrived.add(bucket.index)

    def load_direct(self, pairs, loads) -> None:
        """Apply a whole version from mapped trainer storage (``ipc-direct``)."""
        if self._version is None:
            raise RuntimeError("direct load outside a version")
        if pairs:
            dsts, srcs = zip(*pairs)
            torch._foreach_copy_(list(dsts), list(srcs))
        if loads:
            shapes = {t.name: t.shape for t in self.plan.tensors()}
            self.consumer.load_weights((n, t.reshape(shapes[n])) for n, t in loads)
        self._arrived = {b.index for b in self.plan.buckets}

    def pushed(self) -> None:
        """The trainer wrote every bucket of this version in place (``ipc-push``, in-process push)."""
        if self._version is None:
            raise RuntimeError("pushed weights outside a version")
        self._arrived = {b.index for b in self.plan.buckets}

    def finish(self, version: int) -> int:
        if version != self._version:
            raise RuntimeError(f"finish({version}) does not match the version in progress {self._version}")
        missing = [b.index for b in self.plan.buckets if b.index not in self._arrived]
        if missing:
            raise RuntimeError(f"version {version} incomplete: buckets {missing[:5]} never arrived")
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        self.applied_version, self._version = version, None
        return version
