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

``auto`` deciding by the step (:mod:`.step_ab`): the segments are cut so that no
arm of the A/B (plain, bands, on) splits one, the buffer is built plain (or in
the cached arm), and the mixin's ``zero_grad_buffer`` marks the steps; a switch
moves segment storages between plain memory and the pool, keeping every tensor
object, so the views above (and the optimizer's) stay valid.
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
from .memory import SymmetricMemory, SymmetricPlacementMismatch, move_storage, quiesce, release_storage
from .policy import ARMS, REPORTER, Decision, arm_decisions, decide
from .probe import resolve_config
from .step_ab import StepAB, ab_cache_key, layout_signature, lookup_choice

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
    key: tuple = ()  # symmetric or not in each arm (the step A/B's, or the one decision)
    arms: dict = dataclasses.field(default_factory=dict)  # arm -> symmetric


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


def stage_ddp_buffers(
    ddp: DistributedDataParallel, config: SymmMemConfig, *, step_ab: bool = False
) -> list[tuple[str, Decision]]:
    """Stage the buckets of a built Megatron DDP as ``config``'s policy decides.

    Collective over each data-parallel group (all ranks call it, in the same
    order). Returns ``(bucket name, decision)`` for every collective buffer.

    ``auto`` mode with ``decide_by="step"``: with ``step_ab`` (what
    :class:`SymmMemDDPMixin` passes: its ``zero_grad_buffer`` marks the steps) the
    buffers are laid out for every arm of the step A/B and staged in the cached
    arm, or plain while the A/B runs (``ddp.symm_mem_ab``, a
    :class:`~megatron_ext.fsdp_symm.step_ab.StepAB`); without it nothing marks
    the steps, so the bands decide (noted in the report).
    """
    rows: list[tuple[str, Decision]] = []
    if config.mode != "off":
        # Blocks of models dropped earlier go back to the pool now, on every
        # rank, so all ranks' pools are in the same state when staging allocates.
        quiesce()
    pairs = [(b, ddp.bucket_groups) for b in ddp.buffers] + [
        (b, ddp.expert_parallel_bucket_groups) for b in ddp.expert_parallel_buffers
    ]
    step = config.mode == "auto" and config.decide_by == "step"
    plans = []
    for index, (buffer, groups) in enumerate(pairs):
        prefix = f"{'expert-' if buffer in ddp.expert_parallel_buffers else ''}buffer{index}"
        plans.append(_plan_buffer(ddp, buffer, groups, config, prefix, step))
    arms = _distinct_arms(plans) if step else ("config",)
    ab = None
    if step and len(arms) > 1 and step_ab:
        group = _agreement_group(ddp, plans)
        device = plans[0].buffer.grad_data.device
        signature = layout_signature([row for plan in plans for row in plan.signature_rows()])
        key = ab_cache_key("ddp", signature, dist.get_world_size(group), device)
        cached = lookup_choice(key, arms, group, config.probe_cache)
        for plan in plans:
            _stage_planned(ddp, plan, arms)
        ab = StepAB.from_config(
            config,
            label="DDP",
            arms=arms,
            apply=lambda arm: _apply_arm(ddp, plans, arm),
            group=group,
            device=device,
            key=key,
            cached=cached,
            on_decided=lambda ab: _report_arm(ddp, plans, ab, config),
        )
        rows = _arm_rows(plans, ab.arm)
        REPORTER.note(ab.note())
    else:
        arm = arms[0] if not step else ("bands" if "bands" in arms else arms[0])
        if step and len(arms) > 1:
            REPORTER.note(
                "auto decided by the bands: the step A/B needs SymmMemDDPMixin (its zero_grad_buffer marks "
                "the steps); this DDP was staged by stage_ddp_buffers alone"
            )
        for plan in plans:
            rows += _stage_planned(ddp, plan, (arm,))
    ddp.symm_mem_ab = ab
    if rows and config.mode != "off":
        for name, decision in rows:
            REPORTER.add(name, decision)
        REPORTER.flush(enabled=config.report)
    return rows


@dataclasses.dataclass
class _BufferPlan:
    """One buffer's buckets: their collective groups and, per arm, their decisions."""

    buffer: object
    bucket_groups: list
    prefix: str
    owner: dict
    groups: dict  # id(bucket) -> the group its collectives run on
    grad: list  # per bucket: {arm: Decision}
    param: list  # per bucket: {arm: Decision} or None
    dtypes: list  # per bucket: (grad dtype, param dtype)

    def signature_rows(self):
        """Per buffer (collective, dtype, bytes, symmetric in each arm), for the A/B's cache key."""
        for (gdt, pdt), grad, param in zip(self.dtypes, self.grad, self.param):
            for dec, dtype in ((grad, gdt), (param, pdt)):
                if dec is not None:
                    d = dec[ARMS[0]]
                    yield (d.collective, str(dtype), d.nbytes, *(dec[a].symmetric for a in ARMS))


def _plan_buffer(ddp, buffer, bucket_groups, config, prefix, step):
    cfg = ddp.ddp_config
    owner = {id(b): g for g in bucket_groups for b in g.buckets}
    grad_op = "reduce_scatter" if cfg.use_distributed_optimizer else "all_reduce"
    grads, params, groups, dtypes = [], [], {}, []
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

        def decisions(collective, nbytes, dtype):
            if step:
                return arm_decisions(collective, nbytes, used, reason, dtype)
            return {"config": decide(collective, nbytes, used, reason, dtype)}

        grad_bytes = bucket.grad_data.numel() * bucket.grad_data.element_size()
        grads.append(decisions(grad_op, grad_bytes, bucket.grad_data.dtype))
        if bucket.param_data is not None and cfg.use_distributed_optimizer:
            nbytes = bucket.param_data.numel() * bucket.param_data.element_size()
            params.append(decisions("all_gather", nbytes, bucket.param_data.dtype))
        else:
            params.append(None)
        groups[id(bucket)] = group
        dtypes.append((bucket.grad_data.dtype, None if bucket.param_data is None else bucket.param_data.dtype))
    return _BufferPlan(buffer, bucket_groups, prefix, owner, groups, grads, params, dtypes)


def _distinct_arms(plans) -> tuple[str, ...]:
    """The arms of :data:`ARMS` that stage a different set of buffers than every arm before them."""
    seen, out = set(), []
    for arm in ARMS:
        flags = tuple(
            d[arm].symmetric for plan in plans for d in [*plan.grad, *(p for p in plan.param if p is not None)]
        )
        if flags not in seen:
            seen.add(flags)
            out.append(arm)
    return tuple(out)


def _agreement_group(ddp, plans):
    """The ranks the step A/B agrees over: the DDP's data-parallel group (with
    context parallelism) when it holds every collective group of the buffers,
    else the world."""
    base = getattr(ddp, "dp_cp_group", None)
    if base is None:
        return dist.group.WORLD
    members = set(dist.get_process_group_ranks(base))
    for plan in plans:
        for group in plan.groups.values():
            if not set(dist.get_process_group_ranks(group)) <= members:
                return dist.group.WORLD
    return base


def _stage_planned(ddp, plan, arms) -> list[tuple[str, Decision]]:
    """Lay ``plan``'s buffer out in segments: one per run of buckets staged alike
    in every arm of ``arms``, each segment allocated as ``arms[0]`` says (plain
    when the first arm is the A/B's plain); returns the rows of ``arms[0]``."""
    buffer, first = plan.buffer, arms[0]

    def key(dec):
        return tuple(bool(dec and dec[a].symmetric) for a in arms)

    grad_keys = [key(d) for d in plan.grad]
    param_keys = [key(d) for d in plan.param]
    if not any(any(k) for k in grad_keys + param_keys):
        return _rows(buffer, plan.prefix, [d[first] for d in plan.grad], [d and d[first] for d in plan.param])

    device = buffer.grad_data.device
    cache: dict = {}

    def memory_for(bucket):
        group = plan.groups[id(bucket)]
        if id(group) not in cache:
            cache[id(group)] = SymmetricMemory(device, group)
        return cache[id(group)]

    buffer.grad_segments = _restage(buffer, "grad_data", grad_keys, memory_for, arms)
    buffer.param_segments = []
    if buffer.param_data is not None:
        buffer.param_segments = _restage(buffer, "param_data", param_keys, memory_for, arms)
    base = type(buffer)
    if not isinstance(buffer, SymmBufferMixin):
        buffer.__class__ = (
            SymmParamAndGradBuffer
            if base is _ParamAndGradBuffer
            else type(f"Symm{base.__name__}", (SymmBufferMixin, base), {})
        )

    # AVG semantics with SUM collectives: pre-scale by 1/group size instead (for a
    # group with a bucket symmetric in any arm: the same sums, whichever arm runs).
    staged = [any(k) and not _fell_back(buffer, b) for b, k in zip(buffer.buckets, grad_keys)]
    for group in plan.bucket_groups:
        symm = any(staged[i] for i, b in enumerate(buffer.buckets) if plan.owner[id(b)] is group)
        group.cached_grad_buffer_shard_list = [None] * len(group.buckets)
        group.cached_param_buffer_shard_list = [None] * len(group.buckets)
        if symm and group.ddp_config.average_in_collective:
            size = dist.get_world_size(_collective_group(ddp, group))
            group.ddp_config = copy.copy(group.ddp_config)
            group.ddp_config.average_in_collective = False
            for b in group.buckets:
                b.gradient_scaling_factor = b.gradient_scaling_factor / size
    return _plan_rows(plan, first)


def _fell_back(buffer, bucket) -> bool:
    return any(seg.fallback and any(b is bucket for b in seg.buckets) for seg in buffer.grad_segments)


def _plan_rows(plan, arm) -> list[tuple[str, Decision]]:
    """``plan``'s rows in ``arm``, with the buckets whose segment fell back to plain marked so."""
    buffer = plan.buffer
    grads = [d[arm] for d in plan.grad]
    params = [d and d[arm] for d in plan.param]
    if getattr(buffer, "grad_segments", None) is not None:
        grads = _staged(buffer, buffer.grad_segments, grads)
    if getattr(buffer, "param_segments", None):
        params = _staged(buffer, buffer.param_segments, params)
    return _rows(buffer, plan.prefix, grads, params)


def _arm_rows(plans, arm) -> list[tuple[str, Decision]]:
    return [row for plan in plans for row in _plan_rows(plan, arm)]


def _apply_arm(ddp, plans, arm: str) -> None:
    """Stage every buffer of ``plans`` as ``arm`` says: segments move between plain
    memory and the symmetric pool, keeping their tensors (every view stays valid).
    Collective over the segments' groups (placement checks); every rank, same step."""
    # A parameter all-gather dispatched ahead (overlap_param_gather_with_optimizer_step)
    # writes the param segments: the moves below must come after it on the stream.
    for group in list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups):
        handle = getattr(group, "param_gather_handle", None)
        if handle is not None:
            handle.wait()
    for plan in plans:
        buffer = plan.buffer
        for seg in getattr(buffer, "grad_segments", []) + getattr(buffer, "param_segments", []):
            want = seg.arms.get(arm, False) and seg.fallback is None
            if want == seg.symmetric:
                continue
            if want:
                move_storage(seg.tensor, seg.memory.allocating)
                try:
                    seg.memory.register(seg.tensor, check=True)
                except SymmetricPlacementMismatch as exc:
                    warnings.warn(
                        f"{exc} Staging this segment ({seg.end - seg.start} elements) in plain memory from now on.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    move_storage(seg.tensor, contextlib.nullcontext)
                    seg.fallback = "plain: symmetric buffer placement differed across ranks"
                    continue
            else:
                move_storage(seg.tensor, contextlib.nullcontext)
            seg.symmetric = want
    ddp.symm_mem_decisions = _arm_rows(plans, arm)


def _report_arm(ddp, plans, ab, config) -> None:
    """The start-up report again once the A/B has decided (rank 0 logs it)."""
    ddp.symm_mem_decisions = _arm_rows(plans, ab.arm)
    for name, decision in ddp.symm_mem_decisions:
        REPORTER.add(name, decision)
    REPORTER.note(ab.note())
    REPORTER.flush(enabled=config.report)


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


def _restage(buffer, attr: str, keys: list, memory_for, arms=("config",)) -> list[BucketRun]:
    """Move ``buffer.<attr>`` into per-run allocations; re-point every view.

    ``keys``: per bucket (in ``buffer.buckets`` order) whether it is symmetric in
    each arm of ``arms`` (a tuple of bools, or one bool for one arm). A segment is
    a run of consecutive buckets with the same key; it is allocated symmetric
    when the first arm says so, and gets the pool of its group when any arm does.
    Without any symmetric bucket the flat tensor stays as it is (one plain
    segment)."""
    keys = [k if isinstance(k, tuple) else (bool(k),) for k in keys]
    old = getattr(buffer, attr)
    if not any(any(k) for k in keys):
        return [BucketRun(0, old.numel(), old, False, buckets=list(buffer.buckets))]
    field = "grad_data" if attr == "grad_data" else "param_data"
    buckets = sorted(buffer.buckets, key=lambda b: b.offset)
    by_id = {id(b): k for b, k in zip(buffer.buckets, keys)}
    segments: list[BucketRun] = []
    for bucket in buckets:
        view = getattr(bucket, field)
        start = view.storage_offset() - old.storage_offset()
        end = start + view.numel()
        key = by_id[id(bucket)]
        if segments and segments[-1].key == key and segments[-1].end == start:
            segments[-1].end = end
            segments[-1].buckets.append(bucket)
        else:
            segments.append(BucketRun(start, end, None, key[0], buckets=[bucket], key=key))
    if segments:
        segments[0].start = 0
        segments[-1].end = old.numel()
    for seg in segments:
        n = seg.end - seg.start
        seg.arms = dict(zip(arms, seg.key))
        if any(seg.key):
            seg.memory = memory_for(seg.buckets[0])
        if seg.symmetric:
            try:
                # check=True: the same place of the pool on every rank, or a
                # SymmetricPlacementMismatch on every rank (then plain for all).
                seg.tensor = seg.memory.empty(n, old.dtype, check=True)
            except SymmetricPlacementMismatch as exc:
                warnings.warn(
                    f"{exc} Staging this {attr} segment ({n} elements) in plain memory.", RuntimeWarning, stacklevel=2
                )
                seg.symmetric = False
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
        self.symm_mem_ab = None
        self.symm_mem_decisions = stage_ddp_buffers(self, self.symm_mem_config, step_ab=True)

    def zero_grad_buffer(self):
        """Megatron's, called at the start of every training step; with ``auto``
        deciding by the step, it also marks the steps of the A/B (which may switch
        arms here, between steps)."""
        super().zero_grad_buffer()
        ab = getattr(self, "symm_mem_ab", None)
        if ab is not None:
            ab.boundary()

    def release_symmetric_memory(self) -> int:
        """See :func:`release_ddp_buffers`."""
        return release_ddp_buffers(self)


class SymmMemDistributedDataParallel(SymmMemDDPMixin, DistributedDataParallel):
    """Megatron DDP whose bucket collectives run on symmetric buffers where the
    policy of ``symm_mem_config`` (default: ``SymmMemConfig()``, mode auto) says so."""
