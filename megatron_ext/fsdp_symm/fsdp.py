"""Experimental Megatron-FSDP with symmetric-memory staging of both the send and
the receive buffer of every all-gather and reduce-scatter the policy selects.

megatron-core 0.19.2's ``use_symm_mem=True`` stages only one side of each
collective (the all-gather output and the reduce-scatter input); NCCL < 2.29.2
runs its symmetric kernels only when both sides are registered, so upstream never
engages them. Here, for a parameter group whose all-gather is symmetric, the
all-gather input (the sharded compute weight) moves into the pool at
construction and the unsharded weight is allocated there on every unshard; for a
group whose reduce-scatter is symmetric, the sharded gradient (the reduce-scatter
output) moves into the pool at construction and each packed full gradient is
allocated there. Each buffer is registered right after it is allocated.

``auto`` deciding by the step (:mod:`.step_ab`): groups are built plain; the first
root forward gathers every such group of the model into one A/B (or starts them
in the cached arm); the optimizer's post-step hook and the root's next forward
mark the steps, and a switch moves the all-gather input and the sharded gradient
between plain memory and the pool (same Storage objects).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import DeviceMesh

from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.dbuffer import DBuffer
from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.module import (
    FsdpModule,
    _axis_index,
    _collect_owned_parameters,
    _group_parameters,
)
from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.parameter_group import (
    FsdpParameterGroup,
)
from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.placement import (
    Flat,
    Partial,
    Placements,
)
from megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision import MixedPrecisionPolicy

from .capability import probe
from .config import SymmMemConfig
from .memory import SymmetricMemory, SymmetricPlacementMismatch, move_storage, release_storage
from .policy import ARMS, REPORTER, Decision, arm_decisions, decide
from .probe import resolve_config
from .step_ab import StepAB, ab_cache_key, layout_signature, lookup_choice

__all__ = ["SymmFsdpModule", "SymmFsdpParameterGroup", "fully_shard"]


_MODULE_COUNTER = itertools.count()


def _plain(collective: str, nbytes: int, reason: str) -> Decision:
    return Decision(collective, nbytes, False, reason)


class SymmFsdpParameterGroup(FsdpParameterGroup):
    """A parameter group whose all-gather and reduce-scatter buffers are staged in
    symmetric memory where ``symm_mem_config``'s policy selects it.

    Gradients keep AVG semantics: a symmetric reduce-scatter runs as SUM (NCCL's
    symmetric kernels reduce with SUM) and the result is divided by the group size.
    """

    def __init__(
        self,
        owning_module: nn.Module,
        parameters: dict[str, nn.Parameter],
        mesh: DeviceMesh,
        placements: Placements,
        mixed_precision_policy: MixedPrecisionPolicy,
        use_symm_mem: bool = False,
        *,
        symm_mem_config: SymmMemConfig | None = None,
        name: str = "",
    ) -> None:
        # Upstream's own staging stays off: it registers one side only.
        super().__init__(owning_module, parameters, mesh, placements, mixed_precision_policy, use_symm_mem=False)
        config = symm_mem_config or SymmMemConfig(mode="auto" if use_symm_mem else "off")
        self.name = name or ",".join(self.parameter_names)
        full_numel = self.model_weight.local_buffer.numel() * mesh.size()
        ag_bytes = full_numel * self.model_weight.dtype.itemsize
        rs_bytes = full_numel * self.dtype.itemsize
        why_not = None
        if config.mode != "off":
            cap = probe(mesh.get_group(0))
            why_not = None if cap.available else cap.reason
            why_not = why_not or self._unsupported_layout(placements)
            if why_not is None:  # the group's bands (probed once per group with bands="probe")
                config = resolve_config(config, mesh.get_group(0), self.main_weight.device)
        # auto by the step: every arm's decisions; built plain, the A/B (or its cached
        # choice) stages them once the root's first forward has gathered every group.
        self._arms: dict | None = None
        self._symm_ab = None
        if config.mode == "auto" and config.decide_by == "step":
            ag_arms = arm_decisions("all_gather", ag_bytes, config, why_not, self.model_weight.dtype)
            rs_arms = (
                arm_decisions("reduce_scatter", rs_bytes, config, why_not, self.dtype)
                if self.requires_grad
                else dict.fromkeys(ARMS, _plain("reduce_scatter", 0, "no gradients"))
            )
            self._arms = {arm: (ag_arms[arm], rs_arms[arm]) for arm in ARMS}
            self.all_gather_decision, self.reduce_scatter_decision = self._arms["plain"]
            self._ab_config = config
            _PENDING.append(weakref.ref(self))
        else:
            self.all_gather_decision = decide("all_gather", ag_bytes, config, why_not, self.model_weight.dtype)
            self.reduce_scatter_decision = (
                decide("reduce_scatter", rs_bytes, config, why_not, self.dtype)
                if self.requires_grad
                else _plain("reduce_scatter", 0, "no gradients")
            )
        self.symm: SymmetricMemory | None = None
        self._reduce_scratch: DBuffer | None = None
        self._fallbacks: dict[str, Decision] = {}  # collective -> its plain decision after a placement mismatch
        candidates = [self.all_gather_decision, self.reduce_scatter_decision]
        if self._arms is not None:
            candidates = [d for pair in self._arms.values() for d in pair]
        if any(d.symmetric for d in candidates):
            self.symm = SymmetricMemory(self.main_weight.device, mesh.get_group(0))
        if self.all_gather_decision.symmetric:
            # The all-gather input; may be the optimizer's main_weight (same dtype):
            # moving the storage keeps every view (the sharded parameters) valid.
            self.all_gather_decision = self._stage(self.model_weight.local_buffer, self.all_gather_decision)
        if self.reduce_scatter_decision.symmetric:
            self.reduce_scatter_decision = self._stage(self.main_grad.local_buffer, self.reduce_scatter_decision)
        if config.mode != "off":
            REPORTER.add(f"{self.name} (all-gather)", self.all_gather_decision)
            if self.requires_grad:
                REPORTER.add(f"{self.name} (reduce-scatter)", self.reduce_scatter_decision)
        self._report = config.report

    def _stage(self, buffer: torch.Tensor, decision: Decision) -> Decision:
        """Move ``buffer`` into the pool and register it, checking that every rank
        got the same place in its pool; if not, every rank keeps it plain."""
        move_storage(buffer, self.symm.allocating)
        try:
            self.symm.register(buffer, check=True)
        except SymmetricPlacementMismatch as exc:
            move_storage(buffer, contextlib.nullcontext)
            warnings.warn(
                f"{exc} Keeping the {decision.collective} buffers of {self.name} plain.", RuntimeWarning, stacklevel=3
            )
            return _plain(
                decision.collective, decision.nbytes, "plain: symmetric buffer placement differed across ranks"
            )
        return decision

    # -- the step A/B --------------------------------------------------------
    def sync_model_weight_from_main_weight(self) -> None:
        """Upstream's (the optimizer's post-step hook calls it); also tells the
        step A/B that an optimizer step happened."""
        super().sync_model_weight_from_main_weight()
        ab = getattr(self, "_symm_ab", None)
        if ab is not None:
            ab.optimizer_stepped()

    def set_symm_arm(self, arm: str) -> None:
        """Stage this group as the step A/B's ``arm`` says: the all-gather input
        and the sharded gradient move between plain memory and the pool (same
        Storage objects: every view stays valid); the per-step buffers follow at
        their next allocation. Between steps (parameters resharded), every rank
        at the same point: moving into the pool checks the placement across ranks."""
        ag, rs = self._arms[arm]
        ag = self._fallbacks.get("all_gather", ag)
        rs = self._fallbacks.get("reduce_scatter", rs)
        if ag.symmetric != self.all_gather_decision.symmetric:
            if ag.symmetric:
                ag = self._stage(self.model_weight.local_buffer, ag)
                if not ag.symmetric:
                    self._fallbacks["all_gather"] = ag
            else:
                move_storage(self.model_weight.local_buffer, contextlib.nullcontext)
        self.all_gather_decision = ag
        if rs.symmetric != self.reduce_scatter_decision.symmetric:
            if rs.symmetric:
                rs = self._stage(self.main_grad.local_buffer, rs)
                if not rs.symmetric:
                    self._fallbacks["reduce_scatter"] = rs
            else:
                move_storage(self.main_grad.local_buffer, contextlib.nullcontext)
                if self._reduce_scratch is not None:
                    release_storage([self._reduce_scratch.local_buffer])
                    self._reduce_scratch = None
        self.reduce_scatter_decision = rs

    def symm_release_tensors(self) -> list[torch.Tensor]:
        """The buffers this group allocated from the symmetric pool."""
        tensors = []
        if self.all_gather_decision.symmetric:
            tensors += [self.model_weight.local_buffer, self._unsharded_model_weight.local_buffer]
        if self.reduce_scatter_decision.symmetric:
            tensors.append(self.main_grad.local_buffer)
        if self._reduce_scratch is not None:
            tensors.append(self._reduce_scratch.local_buffer)
        return tensors

    def _unsupported_layout(self, placements: Placements) -> str | None:
        if self.mesh.ndim != 1:
            return "only 1-D (plain FSDP) meshes are staged; HSDP stays plain"
        if not (isinstance(placements.parameter[0], Flat) and isinstance(placements.gradient[0], Flat)):
            return "parameter and gradient placements must be Flat"
        if self.main_weight.device.type != "cuda":
            return f"buffers are on {self.main_weight.device.type}, not CUDA"
        return None

    # -- all-gather ---------------------------------------------------------
    def unshard_parameters(self) -> None:
        """Install full parameters; the unsharded buffer comes from the pool."""
        if not self.all_gather_decision.symmetric:
            return super().unshard_parameters()
        unsharded = self._unsharded_model_weight
        with self.symm.allocating():
            unsharded.reallocate_storage()
        self.symm.register(unsharded.local_buffer)
        # Same version-counter contract as upstream: autograd may hold views of it.
        with torch.autograd._unsafe_preserve_version_counter(unsharded.local_buffer):
            self.model_weight.redistribute(unsharded.placements, out=unsharded)
        self._switch_to_unsharded_parameters()

    # -- reduce-scatter -----------------------------------------------------
    def allocate_partial_grad_buffer(self) -> DBuffer:
        """The full-gradient reduce-scatter input, from the pool when symmetric."""
        if not self.reduce_scatter_decision.symmetric:
            return super().allocate_partial_grad_buffer()
        grads = []
        for name, parameter in zip(self.parameter_names, self.unsharded_parameters, strict=True):
            if parameter.grad is None:
                raise RuntimeError(f"Missing gradient for FSDP parameter {name!r}.")
            grads.append(parameter.grad)
        with self.symm.allocating():
            partial = DBuffer(
                mesh=self.mesh,
                placements=[Partial(dist.ReduceOp.SUM)],
                tensor_shapes=tuple(g.shape for g in grads),
                dtype=grads[0].dtype,
                device=grads[0].device,
            )
        self.symm.register(partial.local_buffer)
        return partial

    def reduce_partial_gradients(self, partial_grad: DBuffer, is_last_microbatch: bool = True) -> None:
        """SUM reduce-scatter into symmetric memory, then divide: AVG semantics."""
        if not self.reduce_scatter_decision.symmetric:
            return super().reduce_partial_gradients(partial_grad, is_last_microbatch)
        grads = [p.grad for p in self.sharded_parameters]
        has_sharded_grads = any(g is not None for g in grads)
        if has_sharded_grads and any(g is None for g in grads):
            raise RuntimeError("FSDP sharded gradients must be either all set or all None.")
        world = self.mesh.size(0)
        main = self.main_grad
        if not has_sharded_grads and partial_grad.dtype == main.dtype:
            partial_grad.redistribute(main.placements, out=main)
            main.local_buffer.div_(world)
        else:
            scratch = self._scratch(partial_grad.dtype)
            partial_grad.redistribute(main.placements, out=scratch)
            scratch.local_buffer.div_(world)
            if has_sharded_grads:
                main.local_buffer.add_(scratch.local_buffer)
            else:
                main.local_buffer.copy_(scratch.local_buffer)
        self._install_sharded_grads()

    def _scratch(self, dtype: torch.dtype) -> DBuffer:
        """A persistent registered reduce-scatter output for accumulation steps."""
        if self._reduce_scratch is None or self._reduce_scratch.dtype != dtype:
            with self.symm.allocating():
                self._reduce_scratch = DBuffer(
                    mesh=self.mesh,
                    placements=self.main_grad.placements,
                    tensor_shapes=self.main_grad.layout.tensor_shapes,
                    dtype=dtype,
                    device=self.main_grad.device,
                )
            self.symm.register(self._reduce_scratch.local_buffer)
        return self._reduce_scratch


class SymmFsdpModule(FsdpModule):
    """Experimental-FSDP module mixin whose parameter groups are
    :class:`SymmFsdpParameterGroup`."""

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Placements,
        mixed_precision_policy: MixedPrecisionPolicy,
        use_symm_mem: bool = False,
        symm_mem_config: SymmMemConfig | None = None,
    ) -> None:
        # Mirrors FsdpModule.__init__, building our parameter-group class.
        self._context = None
        self._name = None
        self._unshard_event = None
        owned = _collect_owned_parameters(self)
        axes = tuple(_axis_index(mesh, axis) for axis in placements.dp_axes)
        if axes != tuple(range(mesh.ndim)):
            raise ValueError("FSDP requires dp_axes to match every mesh axis in mesh order.")
        label = type(self).__name__.removeprefix("SymmFsdp")
        index = next(_MODULE_COUNTER)
        groups = []
        for i, group_parameters in enumerate(_group_parameters(owned)):
            groups.append(
                SymmFsdpParameterGroup(
                    owning_module=self,
                    parameters=group_parameters,
                    mesh=mesh,
                    placements=placements,
                    mixed_precision_policy=mixed_precision_policy,
                    use_symm_mem=use_symm_mem,
                    symm_mem_config=symm_mem_config,
                    name=f"{label}#{index}/group{i}",
                )
            )
        self._parameter_groups = tuple(groups)
        self._ready_grad_parameters = set()
        self._num_trainable_parameters = sum(
            len(g.sharded_parameters) for g in self._parameter_groups if g.requires_grad
        )
        self._register_hooks()

    def _lazy_init_context(self) -> None:
        first = self._context is None
        super()._lazy_init_context()
        if first:
            groups = [g for m in self.context.forward_order for g in m.parameter_groups]
            self._symm_ab_root = _step_ab_for(groups)
            report = any(getattr(g, "_report", False) for g in groups)
            REPORTER.flush(enabled=report)

    def pre_forward(self) -> None:
        """Upstream's; at the root, a forward that follows an optimizer step starts a
        step of the A/B (arms switch here: every parameter is resharded)."""
        self._lazy_init_context()
        ab = getattr(self, "_symm_ab_root", None)
        if ab is not None and self.is_root():
            ab.forward_boundary()
        super().pre_forward()

    def release_symmetric_memory(self) -> int:
        """Free this module's symmetric buffers (the module is unusable afterwards);
        returns the bytes freed. Call it on every rank at the same point, so the
        symmetric pools stay in step; the next staged model reuses the segments."""
        mine = {id(g) for g in self._parameter_groups}
        _PENDING[:] = [ref for ref in _PENDING if ref() is not None and id(ref()) not in mine]
        return release_storage([t for g in self._parameter_groups for t in g.symm_release_tensors()])

    def symm_decisions(self) -> list[tuple[SymmFsdpParameterGroup, Decision, Decision]]:
        """Each parameter group with its all-gather and reduce-scatter decisions."""
        return [(g, g.all_gather_decision, g.reduce_scatter_decision) for g in self._parameter_groups]


# Groups deciding by the step that no A/B has taken yet (weak references, in the order
# they were built: the same on every rank): the first root forward after they were
# built takes all of them (every root of the model: a model may have several).
_PENDING: list[weakref.ref] = []


def _step_ab_for(groups) -> StepAB | None:
    """The step A/B of ``groups`` (a root's subtree): the one that already took them,
    or a new one over every pending group (collective over their mesh group: the
    cache lookup; every rank runs its first forward alike)."""
    for g in groups:
        if getattr(g, "_symm_ab", None) is not None:
            return g._symm_ab
    pending = [g for g in (ref() for ref in _PENDING) if g is not None and g._symm_ab is None]
    _PENDING.clear()
    if not pending:
        return None
    names = {g.mesh.get_group(0).group_name for g in pending}
    config = pending[0]._ab_config

    def flags(arm):
        return tuple(d.symmetric for g in pending for d in g._arms[arm])

    arms: list[str] = []
    for arm in ARMS:  # arms that stage the same buffers as an earlier one are dropped
        if flags(arm) not in [flags(a) for a in arms]:
            arms.append(arm)
    if len(arms) == 1:
        return None
    if len(names) > 1:
        REPORTER.note(
            "auto decided by the bands: the step A/B needs every FSDP group on one mesh group; "
            f"these are on {len(names)}"
        )
        for g in pending:
            g.set_symm_arm("bands" if "bands" in arms else "plain")
        return None
    group = pending[0].mesh.get_group(0)
    device = pending[0].main_weight.device
    rows = [
        (d.collective, str(dtype), d.nbytes, *(g._arms[a][i].symmetric for a in ARMS))
        for g in pending
        for i, (d, dtype) in enumerate(((g._arms["plain"][0], g.model_weight.dtype), (g._arms["plain"][1], g.dtype)))
    ]
    key = ab_cache_key("fsdp", layout_signature(rows), dist.get_world_size(group), device)
    cached = lookup_choice(key, arms, group, config.probe_cache)

    def apply(arm):
        for g in pending:
            g.set_symm_arm(arm)

    def decided(ab):
        for g in pending:
            REPORTER.add(f"{g.name} (all-gather)", g.all_gather_decision)
            if g.requires_grad:
                REPORTER.add(f"{g.name} (reduce-scatter)", g.reduce_scatter_decision)
        REPORTER.note(ab.note())
        REPORTER.flush(enabled=config.report)

    ab = StepAB.from_config(
        config,
        label="FSDP",
        arms=arms,
        apply=apply,
        group=group,
        device=device,
        key=key,
        cached=cached,
        on_decided=decided,
    )
    for g in pending:
        g._symm_ab = ab
    REPORTER.note(ab.note())
    return ab


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    use_symm_mem: bool = False,
    *,
    symm_mem_config: SymmMemConfig | None = None,
) -> None:
    """megatron-core's experimental ``fully_shard`` with symmetric staging that engages.

    Same arguments as upstream, plus ``symm_mem_config``. ``use_symm_mem=True``
    without a config means ``SymmMemConfig(mode="auto")``; a given config decides
    by itself (its ``mode="off"`` gives upstream's plain behaviour).
    """
    if isinstance(module, FsdpModule):
        raise ValueError("This module is already managed by FSDP.")
    if symm_mem_config is None:
        symm_mem_config = SymmMemConfig(mode="auto" if use_symm_mem else "off")
    mixed_precision_policy = mixed_precision_policy or MixedPrecisionPolicy()
    original_cls = module.__class__
    module.__class__ = type(f"SymmFsdp{original_cls.__name__}", (SymmFsdpModule, original_cls), {})
    try:
        SymmFsdpModule.__init__(
            module,
            mesh=mesh,
            placements=placements,
            mixed_precision_policy=mixed_precision_policy,
            use_symm_mem=use_symm_mem,
            symm_mem_config=symm_mem_config,
        )
    except Exception:
        module.__class__ = original_cls
        raise
