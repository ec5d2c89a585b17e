"""Symmetric-memory staging of Megatron DDP's param/grad buffer buckets.

Megatron allocates each :class:`_ParamAndGradBuffer` as one flat grad tensor (and,
with the distributed optimizer, one flat param tensor) and hands out bucket and
parameter views of it. Staging re-homes those tensors bucket by bucket: runs of
consecutive buckets that the policy puts on symmetric memory get one allocation
from the NCCL symmetric pool, registered once right after it is allocated; the
other runs get plain allocations. Every view (``bucket.grad_data``,
``bucket.param_data``, ``param.main_grad``, ``param.data``) is re-pointed into
the new allocation with its values, and the buffer becomes a
:class:`SymmParamAndGradBuffer`, whose buffer-wide operations (zeroing, scaling,
offload) walk the segments.

Buckets are staged after Megatron's DDP has built them, so the same code serves
any DDP subclass (such as the NTP DDP): mix :class:`SymmMemDDPMixin` in front of
it, or call :func:`stage_ddp_buffers` on a built instance.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

from .capability import probe
from .config import SymmMemConfig
from .memory import SymmetricMemory, SymmetricPlacementMismatch, quiesce, release_storage
from .policy import REPORTER, Decision, decide
from .probe import resolve_config

__all__ = [
    "SymmMemDDPMixin",
    "SymmMemDistributedDataParallel",
    "SymmBufferMixin",
    "SymmParamAndGradBuffer",
    "release_ddp_buffers",
    "stage_ddp_buffers",
]


@dataclasses.dataclass
class BucketRun:
    """A run of consecutive buckets ``[start, end)`` of a buffer in one allocation."""

    start: int
    end: int
    tensor: torch.Tensor
    symmetric: bool
    memory: object | None = None  # SymmetricMemory for symmetric segments
    buckets: list = dataclasses.field(default_factory=list)
    nbytes: int = 0  # storage size while offloaded
    cpu_copy: torch.Tensor | None = None
    fallback: str | None = None  # why a segment meant to be symmetric is plain


class SymmBufferMixin:
    """Buffer-wide operations over the segments made by :func:`stage_ddp_buffers`.

    Mixed in front of ``_ParamAndGradBuffer`` or any subclass of it.
    """

    grad_segments: list[BucketRun]
    param_segments: list[BucketRun]

    def reset(self):
        """Zero the gradient segments."""
        for seg in self.grad_segments:
            seg.tensor.zero_()
        for grad in self.extra_main_grads:
            grad.zero_()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Scale the gradient segments by ``scaling_factor``."""
        for seg in self.grad_segments:
            seg.tensor.mul_(scaling_factor)
        for grad in self.extra_main_grads:
            grad.mul_(scaling_factor)

    def offload_to_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        """Free the segments' device memory (params are kept on CPU first)."""
        if move_grads:
            for seg in self.grad_segments:
                _release(seg)
        if move_params:
            for seg in self.param_segments:
                if seg.tensor.untyped_storage().nbytes() > 0:
                    seg.cpu_copy = (
                        seg.tensor.cpu().pin_memory() if torch.cuda.is_available() else seg.tensor.cpu().clone()
                    )
                    _release(seg)

    def reload_from_cpu(self, move_params: bool = True, move_grads: bool = True):
        """Reallocate offloaded segments (in the same pool) and restore params."""
        if move_params:
            for seg in self.param_segments:
                if _reallocate(seg):
                    seg.tensor.copy_(seg.cpu_copy, non_blocking=True)
        if move_grads:
            for seg in self.grad_segments:
                if _reallocate(seg):
                    seg.tensor.zero_()


class SymmParamAndGradBuffer(SymmBufferMixin, _ParamAndGradBuffer):
    """Megatron's param/grad buffer, bucket runs staged in symmetric or plain memory."""


def _release(seg: BucketRun) -> None:
    storage = seg.tensor.untyped_storage()
    if storage.nbytes() > 0:
        seg.nbytes = storage.nbytes()
        if seg.symmetric:
            # The pool may hand back another allocation (e.g. after empty_cache):
            # register whatever comes back, torch returns the cached window if it is the same.
            seg.memory.registered_ptrs.discard(storage.data_ptr())
        storage.resize_(0)


def _reallocate(seg: BucketRun) -> bool:
    storage = seg.tensor.untyped_storage()
    if storage.nbytes() > 0 or not getattr(seg, "nbytes", 0):
        return False
    ctx = seg.memory.allocating() if seg.symmetric else contextlib.nullcontext()
    with ctx:
        storage.resize_(seg.nbytes)
    if seg.symmetric:
        seg.memory.register(seg.tensor)
    return True


def _unsupported(ddp: DistributedDataParallel, buffer) -> str | None:
    cfg = ddp.ddp_config
    if cfg.num_distributed_optimizer_instances > 1:
        return "num_distributed_optimizer_instances > 1 is not staged"
    if cfg.reduce_scatter_with_fp32_accumulation:
        return "reduce_scatter_with_fp32_accumulation is not staged"
    if getattr(buffer, "shared_buffer", None) is not None or buffer.has_nvfp4_params:
        return "quantized (MXFP8/NVFP4) buffers are not staged"
    if not cfg.use_distributed_optimizer and cfg.overlap_param_gather:
        return "layer-wise optimizer param gather is not staged"
    if buffer.grad_data.device.type != "cuda":
        return f"buffers are on {buffer.grad_data.device.type}, not CUDA"
    return None


def _collective_group(ddp, bucket_group):
    if ddp.ddp_config.use_distributed_optimizer:
        return bucket_group.intra_distributed_optimizer_instance_group
    return bucket_group.data_parallel_group


def stage_ddp_buffers(ddp: DistributedDataParallel, config: SymmMemConfig) -> list[tuple[str, Decision]]:
    """Stage the buckets of a built Megatron DDP as ``config``'s policy decides.

    Collective over each data-parallel group (all ranks call it, in the same
    order). Returns ``(bucket name, decision)`` for every collective buffer.
    """
    rows: list[tuple[str, Decision]] = []
    if config.mode != "off":
        # Blocks of models dropped earlier go back to the pool now, on every
        # rank, so all ranks' pools are in the same state when staging allocates.
        quiesce()
    pairs = [(b, ddp.bucket_groups) for b in ddp.buffers] + [
        (b, ddp.expert_parallel_bucket_groups) for b in ddp.expert_parallel_buffers
    ]
    for index, (buffer, groups) in enumerate(pairs):
        prefix = f"{'expert-' if buffer in ddp.expert_parallel_buffers else ''}buffer{index}"
        rows += _stage_buffer(ddp, buffer, groups, config, prefix)
    if rows and config.mode != "off":
        for name, decision in rows:
            REPORTER.add(name, decision)
        REPORTER.flush(enabled=config.report)
    return rows


def _stage_buffer(ddp, buffer, bucket_groups, config, prefix):
    cfg = ddp.ddp_config
    owner = {id(b): g for g in bucket_groups for b in g.buckets}
    grad_op = "reduce_scatter" if cfg.use_distributed_optimizer else "all_reduce"
    grad_decisions, param_decisions, memories = [], [], {}
    for bucket in buffer.buckets:
        group = _collective_group(ddp, owner[id(bucket)])
        reason = None
        if config.mode != "off":
            cap = probe(group)
            reason = None if cap.available else cap.reason
            reason = reason or _unsupported(ddp, buffer)
        n = len(owner[id(bucket)].buckets)
        if reason is None and n > 1:
            # Coalesced into one NCCL group; symmetric kernels run one collective per group.
            reason = f"its bucket group coalesces {n} collectives"
        # The group's bands (probed once per group with bands="probe").
        used = resolve_config(config, group, buffer.grad_data.device) if reason is None else config
        grad_bytes = bucket.grad_data.numel() * bucket.grad_data.element_size()
        grad_decisions.append(decide(grad_op, grad_bytes, used, reason, bucket.grad_data.dtype))
        if bucket.param_data is not None and cfg.use_distributed_optimizer:
            nbytes = bucket.param_data.numel() * bucket.param_data.element_size()
            param_decisions.append(decide("all_gather", nbytes, used, reason, bucket.param_data.dtype))
        else:
            param_decisions.append(None)
        memories[id(bucket)] = group
    if not any(d.symmetric for d in grad_decisions + [p for p in param_decisions if p]):
        return _rows(buffer, prefix, grad_decisions, param_decisions)

    device = buffer.grad_data.device
    cache: dict = {}

    def memory_for(bucket):
        group = memories[id(bucket)]
        if id(group) not in cache:
            cache[id(group)] = SymmetricMemory(device, group)
        return cache[id(group)]

    grad_flags = [d.symmetric for d in grad_decisions]
    buffer.grad_segments = _restage(buffer, "grad_data", grad_flags, memory_for)
    grad_decisions = _staged(buffer, buffer.grad_segments, grad_decisions)
    buffer.param_segments = []
    if buffer.param_data is not None:
        param_flags = [bool(d and d.symmetric) for d in param_decisions]
        buffer.param_segments = _restage(buffer, "param_data", param_flags, memory_for)
        param_decisions = _staged(buffer, buffer.param_segments, param_decisions)
    base = type(buffer)
    if not isinstance(buffer, SymmBufferMixin):
        buffer.__class__ = (
            SymmParamAndGradBuffer
            if base is _ParamAndGradBuffer
            else type(f"Symm{base.__name__}", (SymmBufferMixin, base), {})
        )

    # AVG semantics with SUM collectives: pre-scale by 1/group size instead.
    for group in bucket_groups:
        symm = any(grad_decisions[i].symmetric for i, b in enumerate(buffer.buckets) if owner[id(b)] is group)
        group.cached_grad_buffer_shard_list = [None] * len(group.buckets)
        group.cached_param_buffer_shard_list = [None] * len(group.buckets)
        if symm and group.ddp_config.average_in_collective:
            size = dist.get_world_size(_collective_group(ddp, group))
            group.ddp_config = copy.copy(group.ddp_config)
            group.ddp_config.average_in_collective = False
            for b in group.buckets:
                b.gradient_scaling_factor = b.gradient_scaling_factor / size
    return _rows(buffer, prefix, grad_decisions, param_decisions)


def _rows(buffer, prefix, grad_decisions, param_decisions):
    rows = []
    for bucket, gd, pd in zip(buffer.buckets, grad_decisions, param_decisions):
        rows.append((f"{prefix}/bucket{bucket.bucket_id} grads", gd))
        if pd is not None:
            rows.append((f"{prefix}/bucket{bucket.bucket_id} params", pd))
    return rows


def _staged(buffer, segments, decisions):
    """``decisions`` with the buckets of segments that ended up plain marked so."""
    plain = {id(b): seg.fallback for seg in segments if seg.fallback for b in seg.buckets}
    return [
        dataclasses.replace(d, symmetric=False, reason=plain[id(b)])
        if d is not None and d.symmetric and id(b) in plain
        else d
        for b, d in zip(buffer.buckets, decisions)
    ]


def _restage(buffer, attr: str, flags: list[bool], memory_for) -> list[BucketRun]:
    """Move ``buffer.<attr>`` into per-run allocations; re-point every view.
    Without a symmetric run the flat tensor stays as it is (one plain segment)."""
    old = getattr(buffer, attr)
    if not any(flags):
        return [BucketRun(0, old.numel(), old, False, buckets=list(buffer.buckets))]
    field = "grad_data" if attr == "grad_data" else "param_data"
    buckets = sorted(buffer.buckets, key=lambda b: b.offset)
    by_id = {id(b): f for b, f in zip(buffer.buckets, flags)}
    segments: list[BucketRun] = []
    for bucket in buckets:
        view = getattr(bucket, field)
        start = view.storage_offset() - old.storage_offset()
        end = start + view.numel()
        symmetric = by_id[id(bucket)]
        if segments and segments[-1].symmetric == symmetric and segments[-1].end == start:
            segments[-1].end = end
            segments[-1].buckets.append(bucket)
        else:
            segments.append(BucketRun(start, end, None, symmetric, buckets=[bucket]))
    if segments:
        segments[0].start = 0
        segments[-1].end = old.numel()
    for seg in segments:
        n = seg.end - seg.start
        if seg.symmetric:
            seg.memory = memory_for(seg.buckets[0])
            try:
                # check=True: the same place of the pool on every rank, or a
                # SymmetricPlacementMismatch on every rank (then plain for all).
                seg.tensor = seg.memory.empty(n, old.dtype, check=True)
            except SymmetricPlacementMismatch as exc:
                warnings.warn(
                    f"{exc} Staging this {attr} segment ({n} elements) in plain memory.", RuntimeWarning, stacklevel=2
                )
                seg.symmetric, seg.memory = False, None
                seg.fallback = "plain: symmetric buffer placement differed across ranks"
        if not seg.symmetric:
            seg.tensor = torch.empty(n, dtype=old.dtype, device=old.device)
        seg.tensor.copy_(old[seg.start : seg.end])

    def rebase(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.untyped_storage().data_ptr() != old.untyped_storage().data_ptr():
            return None
        offset = t.storage_offset() - old.storage_offset()
        for seg in segments:
            if seg.start <= offset and offset + t.numel() <= seg.end:
                return seg.tensor.as_strided(t.size(), t.stride(), seg.tensor.storage_offset() + offset - seg.start)
        raise RuntimeError(f"a view of {attr} crosses a staging segment boundary")

    for bucket in buffer.buckets:
        setattr(bucket, field, rebase(getattr(bucket, field)))
        for param in bucket.params_list:
            if attr == "grad_data":
                for name in ("main_grad", "main_grad_copy_in_grad_buffer"):
                    new = rebase(getattr(param, name, None))
                    if new is not None:
                        setattr(param, name, new)
            else:
                new = rebase(param.data)
                if new is not None:
                    param.data = new
    setattr(buffer, attr, segments[0].tensor if len(segments) == 1 else None)
    return segments


def release_ddp_buffers(ddp) -> int:
    """Free the staged segments of ``ddp``'s buffers (grads, and params with the
    distributed optimizer); returns the bytes freed. Collective in effect: call
    it on every rank at the same point, so the symmetric pools stay in step.
    The model is unusable afterwards; symmetric segments go back to the pool,
    still registered, and the next staged model reuses them without new windows."""
    buffers = list(ddp.buffers) + list(ddp.expert_parallel_buffers)
    segments = [s for b in buffers for s in getattr(b, "grad_segments", []) + getattr(b, "param_segments", [])]
    return release_storage([s.tensor for s in segments])


class SymmMemDDPMixin:
    """Mix in front of Megatron's ``DistributedDataParallel`` (or a subclass of it):
    its buckets are staged per ``symm_mem_config`` right after they are built."""

    def __init__(self, *args, symm_mem_config: SymmMemConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.symm_mem_config = symm_mem_config or SymmMemConfig()
        self.symm_mem_decisions = stage_ddp_buffers(self, self.symm_mem_config)

    def release_symmetric_memory(self) -> int:
        """See :func:`release_ddp_buffers`."""
        return release_ddp_buffers(self)


class SymmMemDistributedDataParallel(SymmMemDDPMixin, DistributedDataParallel):
    """Megatron DDP whose bucket collectives run on symmetric buffers where the
    policy of ``symm_mem_config`` (default: ``SymmMemConfig()``, mode auto) says so."""
