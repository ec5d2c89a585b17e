"""The engine side: check the plan, load buckets, report the applied version.

A :class:`WeightReceiver` wraps a *consumer*, anything with
``load_weights(iterable of (hf_name, tensor))`` and optionally
``expected_tensors() -> {name: (shape, dtype)}``: the shape of vLLM's and
SGLang's weight-update entry points. :class:`HFModelConsumer` is the consumer
for a ``transformers`` model.

An FP8 export (``RefitConfig.quantize="fp8-block"``) sends a quantized weight
as ``float8_e4m3fn`` values plus its ``weight_scale_inv``: a consumer that
expects the weight in FP8 (an FP8 engine) gets both as they are; one that
expects it in another dtype gets it dequantized (``values x scale`` per block,
in that dtype; straight into the consumer's tensor when it has ``target(name)``)
and no scale; one that states no expectations gets both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ...sharding.fp8 import FP8_DTYPE, scale_name, scale_shape
from ...sharding.moe import fused_expert_views
from ...copies import FlagsByName, copy_all, finite_flags
from ..plan.errors import NonFiniteWeights
from ..plan.export_plan import BucketMeta, ExportPlan, PlanMismatch, check_plan, unpack
from ..plan.fp8 import dequantize_blocks
from ..plan.wire import align

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
        copy_all([(self._targets[name], tensor) for name, tensor in weights])  # few launches for the bucket

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

    def __init__(
        self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object], expected: dict | None = None
    ):
        self._load = load_weights
        self._expected = expected

    def expected_tensors(self):
        return self._expected

    def load_weights(self, weights):
        self._load(weights)


class WeightReceiver:
    """Checks a plan once, loads its buckets, and counts a version as applied
    only when every bucket of it arrived.

    ``atomic=True``: buckets are staged in one buffer of the whole version (on
    ``device``) and reach the consumer only at :meth:`finish`, so an interrupted
    version (:meth:`abort`: the trainer died, hung or gave up) leaves the
    previous complete version in place, bit for bit. ``atomic=False`` writes
    each bucket as it arrives (no staging memory); an interrupted version then
    leaves the consumer's weights mixed, and the receiver says so:
    :attr:`applied_version` becomes None and :attr:`holds_complete_version`
    False until the next complete version. In-place transports (``ipc-push``,
    ``ipc-direct``) always write in place.
    """

    def __init__(self, consumer, *, atomic: bool = False, device: torch.device | str = "cpu"):
        self.consumer = consumer
        self.atomic, self.device = atomic, torch.device(device)
        self.plan: ExportPlan | None = None
        self.applied_version: int | None = None
        self._version: int | None = None
        self._arrived: set[int] = set()
        self._mixed = False  # some of a version was written but not all of it
        self._staging: torch.Tensor | None = None
        self._in_place = False  # the version in progress is written by the transport itself
        self._offsets: dict[int, int] = {}
        self._dequantize: dict[str, torch.dtype] = {}  # FP8 weight -> the dtype the consumer loads it in
        self._checks = FlagsByName()  # NaN/Inf flags the version's copies left
        self.plans_received = 0

    @property
    def holds_complete_version(self) -> bool:
        """False while (or after) a version was partly written in place."""
        return not self._mixed

    def set_plan(self, plan: ExportPlan, *, in_place: bool = False) -> None:
        """Validate ``plan`` against the consumer before any byte is written (and,
        when atomic, allocate the staging buffer for a whole version). ``in_place``:
        the transport writes the consumer's weights itself (``ipc-push``,
        ``ipc-direct``), so nothing is staged whatever ``atomic`` says."""
        expected = getattr(self.consumer, "expected_tensors", lambda: None)()
        self._dequantize = {}
        if expected is not None:
            expected = dict(expected)
            names = {t.name for t in plan.tensors()}
            for t in plan.tensors():
                want = expected.get(t.name)
                if t.dtype == FP8_DTYPE and scale_name(t.name) in names and want is not None and want[1] != FP8_DTYPE:
                    self._dequantize[t.name] = want[1]  # the consumer loads it dequantized, without the scale
                    expected[t.name] = (want[0], FP8_DTYPE)
                    expected.setdefault(scale_name(t.name), (scale_shape(want[0]), torch.float32))
            check_plan(plan, expected)
        self._staging, self._offsets = None, {}
        if self.atomic and not in_place:
            self._offsets, total = {}, 0
            for b in plan.buckets:
                self._offsets[b.index] = total
                total += align(b.nbytes)
            try:
                self._staging = torch.empty(total, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError as exc:
                raise PlanMismatch(
                    f"the engine has no memory to stage a whole version ({total / 2**30:.2f} GiB on "
                    f"{self.device}) for an atomic refit; serve with atomic=False (each bucket "
                    "written as it arrives; an interrupted refit then leaves no complete "
                    "version)"
                ) from exc
        self.plan = plan
        self.plans_received += 1

    def begin(self, version: int, *, in_place: bool = False) -> None:
        """A version starts; ``in_place``: the transport writes the weights directly."""
        if self.plan is None:
            raise PlanMismatch("no plan received before version begin")
        self._version, self._arrived, self._in_place, self._checks = version, set(), in_place, FlagsByName()
        if in_place:
            self._mixed = True

    def staging(self, bucket: BucketMeta) -> torch.Tensor | None:
        """Where an atomic receiver keeps ``bucket`` until :meth:`finish` (None when not atomic):
        a transport may receive into it directly and then call :meth:`arrived`."""
        if self._staging is None:
            return None
        off = self._offsets[bucket.index]
        return self._staging[off : off + bucket.nbytes]

    def arrived(self, bucket: BucketMeta) -> None:
        self._arrived.add(bucket.index)

    def load_bucket(self, bucket: BucketMeta, buf: torch.Tensor) -> None:
        if self._version is None:
            raise RuntimeError(f"bucket {bucket.index} arrived outside a version")
        stage = self.staging(bucket)
        if stage is not None:
            stage.copy_(buf[: bucket.nbytes])
        else:
            self._mixed = True
            self.consumer.load_weights(self._loadable(bucket, buf))
        self._arrived.add(bucket.index)

    def _loadable(self, bucket: BucketMeta, buf: torch.Tensor):
        """``bucket``'s tensors in ``buf`` as the consumer loads them (FP8 weights it expects in
        another dtype dequantized with their scales, which it then does not get). A consumer with
        ``target(name)`` on the bucket's device gets those weights dequantized straight into its tensors
        (no dequantized copy to load), the rest through ``load_weights``."""
        pairs = unpack(bucket, buf)
        if not self._dequantize:
            return pairs
        pairs = dict(pairs)
        scales = {scale_name(n) for n in self._dequantize}
        target = getattr(self.consumer, "target", None)
        loadable = []
        for n, t in pairs.items():
            if n in scales:
                continue
            if n in self._dequantize:
                dst = target(n) if callable(target) else None
                if dst is not None and dst.device == t.device:
                    dequantize_blocks(t, pairs[scale_name(n)], self._dequantize[n], out=dst)
                    continue
                t = dequantize_blocks(t, pairs[scale_name(n)], self._dequantize[n])
            loadable.append((n, t))
        return loadable

    def load_direct(self, copies, loads, *, check: bool = False) -> None:
        """Apply a whole version from mapped trainer storage (``ipc-direct``): ``copies`` and
        ``loads`` as :func:`~..transports.ipc_direct.direct_copies` returns them. ``check``: the
        copies look for NaN / Inf as they go (the pieces loaded whole are read once more), and
        :meth:`finish` refuses a version with any."""
        if self._version is None:
            raise RuntimeError("direct load outside a version")
        self._mixed = True
        bad = copies.run(check)
        if bad is not None:
            self._checks.add(copies.names, bad)
        if loads:
            if check:
                pieces = [(n, src) for n, ps in loads for _, src in ps]
                for idx, finite in finite_flags([src for _, src in pieces]):
                    self._checks.add([pieces[i][0] for i in idx], (~finite).to(torch.int32))
            metas = {t.name: t for t in self.plan.tensors()}
            self.consumer.load_weights((n, _assemble(metas[n], pieces)) for n, pieces in loads)
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
        bad, self._checks = self._checks.bad(), FlagsByName()  # one device-to-host read of the copies' flags
        if bad:
            raise NonFiniteWeights.found(version, bad)
        if self._staging is not None and not self._in_place:  # commit the staged version
            self._mixed = True
            for b in self.plan.buckets:
                self.consumer.load_weights(self._loadable(b, self.staging(b)))
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        self.applied_version, self._version, self._mixed = version, None, False
        return version

    def abort(self) -> int | None:
        """The version in progress will not complete: drop it. Returns the version the
        consumer still holds (None when part of this one was already written in place)."""
        self._version, self._arrived, self._checks = None, set(), FlagsByName()
        if self._mixed:
            self.applied_version = None
        return self.applied_version


def _assemble(meta, pieces) -> torch.Tensor:
    """A whole tensor from its ``(box slices, view)`` pieces (one piece covering it: the view itself)."""
    if len(pieces) == 1 and tuple(pieces[0][1].shape) == tuple(meta.shape):
        return pieces[0][1]
    out = torch.empty(meta.shape, dtype=meta.dtype, device=pieces[0][1].device)
    for box, src in pieces:
        out[box] = src
    return out
