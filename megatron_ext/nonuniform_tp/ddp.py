"""``NonuniformTPDistributedDataParallel``: Megatron's DDP for NTP jobs.

Degraded replicas (TP degree ``tp_reduced``) run plain Megatron DDP over the
NTP data-parallel groups: their rank ``i`` holds slice ``S_i`` of every
TP-sharded tensor, and that is the layout in which gradients are reduced and
the optimizer runs on every replica.

A healthy replica computes at ``tp_base``. Each of its core ranks also owns a
*training shadow* of the model in the ``tp_reduced`` layout: on core rank
``i`` (TP rank ``< tp_reduced``) it holds ``S_i`` -- the same tensors, sizes
and order as degraded rank ``i`` -- and Megatron's grad buffer, bucket groups
and optimizer (plain or distributed) are built over it, so the data-parallel
collectives line up element for element with the degraded replicas. Per
bucket group, just before its data-parallel collective, the compute
gradients are folded into the shadow with one all-to-all inside the TP group
(spare ranks send their slices to core ranks). After the optimizer step the
updated shadow parameters are unfolded back into the ``tp_base`` compute
parameters (one all-to-all per dtype), before the next forward.

Spare ranks hold no shadow: their DDP is Megatron's over an empty module (only
zero-gradient copies of the parameters ``finalize_model_grads`` all-reduces over
the TP group, such as q/k layer norms, so that they join that all-reduce), and
the optimizer built over it owns no parameters but still takes part in the
grad-norm and other gradient-statistics all-reduces of the core ranks. They send
their gradient pieces to the core ranks in each bucket group's fold (the core
ranks' bucket groups, broadcast from TP rank 0 at construction, tell them when)
and receive the updated parameters in the unfold.

Balanced batch shares (:mod:`.balance`): with ``batch_shares``, each bucket
scales its gradients by the replica's share of the global batch before the
data-parallel collective, in place of Megatron's ``1 / data_parallel_size``.

Memory: :meth:`NonuniformTPDistributedDataParallel.memory_report` (and
:func:`ddp_memory_report` for Megatron's own DDP) counts the bytes a rank holds
for parameters, gradients, the shadow and the optimizer, from the tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from . import reshard
from .balance import BatchShares
from .config import NonuniformTPConfig
from .process_groups import NTPProcessGroups, get_ntp_process_groups

__all__ = ["DDPMemoryReport", "NonuniformTPBucketGroup", "NonuniformTPDistributedDataParallel", "ddp_memory_report"]


@dataclasses.dataclass
class _HealthyState:
    """A healthy replica's compute parameters, their shadows and the unfold plan."""

    compute: list  # [(name, tp_base parameter)]
    shadows: list  # [tp_reduced shadow parameter, or None where a spare holds none], same order
    tp_rank: int
    tp_group: object
    unfold: list  # reshard.Piece, shadow (core ranks) -> compute (all ranks)
    schedule: _FoldSchedule  # when each bucket group's fold runs (the same on every rank of the TP group)
    scratch: object  # reshard.Scratch: the flat buffers every fold and unfold shares
    stale: bool = False  # shadow updated since the last unfold
    unfolds: list | None = None  # reshard.Exchange per dtype, built at the first unfold


@dataclasses.dataclass(frozen=True)
class DDPMemoryReport:
    """Bytes one rank holds for the model, by what holds them (``numel * element_size``
    of the tensors themselves, on any device; not allocator statistics).

    ``role``: ``"uniform"`` (Megatron's DDP, or NTP without a degraded replica),
    ``"degraded"``, ``"healthy core"`` or ``"healthy spare"``.

    - ``params``: the parameters ``forward`` runs (``tp_base`` layout on healthy
      replicas); Megatron's whole param buffer where the distributed optimizer
      allocated one (bucket padding included).
    - ``grads``: the ``main_grad`` tensors backward accumulates into: Megatron's
      grad buffer (padding included), or on healthy replicas the ``tp_base``
      compute gradients.
    - ``shadow_params``, ``shadow_grads``: healthy replicas only (else 0): the
      ``tp_reduced`` training shadow and its grad buffer, the one the
      data-parallel collective reduces. Core rank ``i`` holds what degraded rank
      ``i`` holds; a spare holds none (0), except zero-gradient copies of the
      parameters ``finalize_model_grads`` all-reduces over the TP group (q/k layer
      norms with ``qk_layernorm``).
    - ``optimizer_main_params``: the optimizer's own copies of the parameters
      (fp32 main params of a bf16/fp16 model; 0 when it steps the model's
      tensors in place), and ``optimizer_state``: its state tensors (Adam's
      moments and step counts). ``None`` when no optimizer was given.
    """

    role: str
    params: int
    grads: int
    shadow_params: int = 0
    shadow_grads: int = 0
    optimizer_main_params: int | None = None
    optimizer_state: int | None = None

    @property
    def shadow(self) -> int:
        """NTP's extra training state on this rank: shadow parameters and gradients."""
        return self.shadow_params + self.shadow_grads

    @property
    def optimizer(self) -> int:
        return (self.optimizer_main_params or 0) + (self.optimizer_state or 0)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.shadow + self.optimizer

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "shadow": self.shadow, "optimizer": self.optimizer, "total": self.total}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _param_bytes(params, buffers) -> int:
    """Megatron's param buffers where allocated (distributed optimizer), the other parameters' own bytes."""
    total, inside = 0, set()
    for b in buffers:
        if b.param_data is not None:
            total += _nbytes(b.param_data)
            inside.update(id(p) for p in b.params)
    return total + sum(_nbytes(p) for p in params if id(p) not in inside)


def _optimizer_bytes(optimizer, model_tensors) -> tuple[int, int]:
    """``(main params, state)`` bytes of a Megatron optimizer (chained or not): the
    parameters it steps that are not the model's own storage, and its state tensors."""
    model = {t.untyped_storage().data_ptr() for t in model_tensors if t.numel()}
    main = state = 0
    seen = set()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)  # the torch optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) not in seen and p.numel() and p.untyped_storage().data_ptr() not in model:
                    main += _nbytes(p)
                seen.add(id(p))
        for per_param in inner.state.values():
            state += sum(_nbytes(v) for v in per_param.values() if torch.is_tensor(v))
    return main, state


def ddp_memory_report(ddp, optimizer=None) -> DDPMemoryReport:
    """:class:`DDPMemoryReport` of this rank for megatron-core's ``DistributedDataParallel``
    or :class:`NonuniformTPDistributedDataParallel` (``optimizer``: the Megatron optimizer
    built over it, for the optimizer's share). Local: no communication."""
    buffers = list(ddp.buffers) + list(ddp.expert_parallel_buffers)
    grad_buffers = sum(_nbytes(b.grad_data) for b in buffers)
    ntp = getattr(ddp, "_ntp", None)
    if ntp is None:
        groups = getattr(ddp, "_ntp_groups", None)
        degraded = groups is not None and groups.ntp_active and groups.role.degraded
        params = list(ddp.module.parameters())
        report = DDPMemoryReport("degraded" if degraded else "uniform", _param_bytes(params, buffers), grad_buffers)
        model_tensors = params + [b.param_data for b in buffers if b.param_data is not None]
    else:
        compute = list(ddp.compute_module.parameters())
        shadows = list(ddp.module.parameters())
        spare = ddp._ntp_groups.role.spare
        report = DDPMemoryReport(
            "healthy spare" if spare else "healthy core",
            _param_bytes(compute, []),
            sum(_nbytes(p.main_grad) for _, p in ntp.compute),
            _param_bytes(shadows, buffers),
            grad_buffers,
        )
        model_tensors = compute + shadows + [b.param_data for b in buffers if b.param_data is not None]
    if optimizer is not None:
        main, state = _optimizer_bytes(optimizer, model_tensors)
        report = dataclasses.replace(report, optimizer_main_params=main, optimizer_state=state)
    return report


class NonuniformTPBucketGroup(_ParamAndGradBucketGroup):
    """A bucket group of a healthy replica's shadow buffer: folds the compute
    gradients of its parameters into the shadow right before the collective."""

    ntp_fold = None  # set by NonuniformTPDistributedDataParallel

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        self.ntp_fold()
        super().start_grad_sync(force_all_reduce=force_all_reduce)


def _shadow_module(named_shapes) -> torch.nn.Module:
    """An ``nn.Module`` tree with the given parameter names (dotted paths)."""
    root = torch.nn.Module()
    for name, param in named_shapes:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, param)
    return root


def _reduced_over_tp_by_finalize(config, name: str, param) -> bool:
    """Whether Megatron's ``finalize_model_grads`` all-reduces this parameter's gradient
    over the TP group (``_allreduce_non_tensor_model_parallel_grads``, megatron-core 0.19:
    the sums of :func:`reshard.tp_summed_grad`, and the averages of parameters marked
    ``average_gradients_across_tp_domain``). A spare keeps a shadow of these only, with a
    zero gradient, so that it joins that all-reduce of its TP group's core ranks."""
    return reshard.tp_summed_grad(config, name, param) or bool(
        getattr(param, "average_gradients_across_tp_domain", False)
    )


class _FoldSchedule:
    """When the fold of each of the core ranks' shadow bucket groups runs, the same on
    every rank of a healthy TP group (core ranks and spares).

    A fold is one all-to-all in the TP group, so every rank must issue them in the same
    order. Core ranks own the shadow's bucket groups; spares own none and fold by
    ``group_of`` (each compute parameter's bucket-group index, from TP rank 0). A group
    folds where Megatron's bucket group starts its collective: with ``overlap_grad_reduce``,
    from the backward hook of the last micro-batch once each of its parameters was reported
    as often as in the first batch (Megatron's golden counts; never in the first batch);
    else, and for the groups still pending, in ``start_grad_sync`` / ``finish_grad_sync``,
    in bucket-group order. A group folds once per step (until :meth:`reset`)."""

    def __init__(self, group_of: list[int], make_fold, overlap: bool):
        self.group_of = group_of
        self.members = [[] for _ in range(max(group_of, default=-1) + 1)]
        for i, k in enumerate(group_of):
            self.members[k].append(i)
        self.folds = [make_fold(m) for m in self.members]
        self.overlap = overlap
        self.last_microbatch = True
        self.golden = [None] * len(self.folds)
        self.counts = [{} for _ in self.folds]
        self.done = [False] * len(self.folds)

    def fold(self, k: int) -> None:
        if not self.done[k]:
            self.folds[k]()
            self.done[k] = True

    def fold_pending(self) -> None:
        for k in range(len(self.folds)):
            self.fold(k)

    def grad_ready(self, index: int) -> None:
        if not (self.overlap and self.last_microbatch):
            return
        k = self.group_of[index]
        counts = self.counts[k]
        counts[index] = counts.get(index, 0) + 1
        if self.golden[k] is not None and counts == self.golden[k]:
            self.fold(k)

    def reset(self) -> None:
        for k, counts in enumerate(self.counts):
            if self.golden[k] is None and counts:
                self.golden[k] = counts
        self.counts = [{} for _ in self.folds]
        self.done = [False] * len(self.folds)
        self.last_microbatch = True


_COPIED_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "allreduce",
    "sequence_parallel",
    "shared",
    "shared_embedding",
    "is_embedding_or_output_parameter",
    "average_gradients_across_tp_domain",
)


class NonuniformTPDistributedDataParallel(DistributedDataParallel):
    """Drop-in replacement for megatron-core's ``DistributedDataParallel``.

    Same arguments plus ``ntp_config`` (and optionally the ``ntp_groups`` returned
    by :func:`initialize_nonuniform_tp_process_groups`; default: the installed
    ones). ``symm_mem_config`` (a :class:`megatron_ext.fsdp_symm.SymmMemConfig`)
    stages the bucket buffers in NCCL symmetric memory per its policy; on gloo or
    unsupported setups they stay plain with one warning. On degraded replicas and in jobs without failures it is exactly
    Megatron's DDP. On healthy replicas ``self.module`` is the training shadow
    (``tp_reduced`` layout; what the optimizer and ``state_dict`` see; on spare
    ranks an empty module, see the module docstring) and :attr:`compute_module`
    is the ``tp_base`` model that ``forward`` runs.

    ``batch_shares`` (a :class:`~megatron_ext.nonuniform_tp.balance.BatchShares`,
    from ``ntp_config.batch_shares(global_batch_size, micro_batch_size)``) makes
    the gradient the exact global-batch mean when replicas process unequal
    shares; it is required when ``ntp_config.balance`` is not ``"none"``. See
    :meth:`set_batch_shares`.
    """

    def __init__(
        self,
        config,
        ddp_config,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection=None,
        full_param_layout=None,
        *,
        ntp_config: NonuniformTPConfig,
        ntp_groups: NTPProcessGroups | None = None,
        symm_mem_config=None,
        batch_shares: BatchShares | None = None,
    ):
        if batch_shares is None and ntp_config.balance != "none":
            raise ValueError(
                f"NonuniformTPConfig.balance={ntp_config.balance!r} gives the replicas unequal shares of the "
                "global batch: pass batch_shares=ntp_config.batch_shares(global_batch_size, micro_batch_size) "
                "(the same shares the sampler and num_microbatches use) so that gradients are weighted by them"
            )
        self._init_ntp(
            config, ddp_config, module, disable_bucketing, pg_collection, full_param_layout, ntp_config, ntp_groups
        )
        self.batch_shares = None
        self.symm_mem_config = symm_mem_config
        self.symm_mem_decisions = []
        if symm_mem_config is not None:
            # Stage the buckets' grad/param buffers (the shadow's on healthy ranks)
            # in NCCL symmetric memory where the policy says so.
            from megatron_ext.fsdp_symm.ddp import stage_ddp_buffers

            self.symm_mem_decisions = stage_ddp_buffers(self, symm_mem_config)
        if batch_shares is not None:
            self.set_batch_shares(batch_shares)

    def _init_ntp(
        self, config, ddp_config, module, disable_bucketing, pg_collection, full_param_layout, ntp_config, ntp_groups
    ):
        groups = ntp_groups or get_ntp_process_groups()
        if groups is None or not groups.is_active:
            raise RuntimeError(
                "NonuniformTPDistributedDataParallel needs the NTP process groups of an active rank: "
                "call initialize_nonuniform_tp_process_groups(ntp_config) first (non-active ranks in "
                "launch_mode='simulate' must not build a model)"
            )
        if groups.config is not ntp_config and groups.config != ntp_config:
            raise ValueError(
                "ntp_config differs from the config the NTP process groups were built "
                f"with: {ntp_config} vs {groups.config}"
            )
        ntp_config.check_model(config, module=module)
        self._ntp_groups = groups
        if getattr(config, "sequence_parallel", False) or config.pipeline_model_parallel_size != 1:
            raise ValueError(
                "nonuniform TP supports sequence_parallel=False and "
                "pipeline_model_parallel_size=1 only; turn them off in the model config"
            )
        role = groups.role
        healthy = groups.ntp_active and not role.degraded
        if not healthy:
            super().__init__(config, ddp_config, module, disable_bucketing, pg_collection, full_param_layout)
            self._ntp = None
            return
        if ddp_config.overlap_param_gather:
            raise NotImplementedError(
                "nonuniform TP: overlap_param_gather=True is not supported on "
                "healthy replicas yet; set overlap_param_gather=False"
            )

        b, r = ntp_config.tp_base, ntp_config.tp_reduced
        compute = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        pieces, shadows = [], []
        for idx, (name, p) in enumerate(compute):
            spec = reshard.shard_spec(name, p, config.gated_linear_unit)
            shape = list(p.shape)
            if spec.dim is not None:
                shape[spec.dim] = shape[spec.dim] * b // r
            size = p.shape[spec.dim] if spec.dim is not None else 0
            # Gradients Megatron sums over TP (qk_layernorm): the spares' partial sums fold in too.
            summed = reshard.tp_summed_grad(config, name, p)
            pieces.append(reshard.reshard_pieces(idx, spec, size, b, r, name=name, summed=summed))
            if role.spare and not _reduced_over_tp_by_finalize(config, name, p):
                shadows.append(None)  # a spare trains nothing: it only sends its gradient pieces to core ranks
                continue
            shadow = torch.nn.Parameter(torch.zeros(shape, dtype=p.dtype, device=p.device))
            for attr in _COPIED_ATTRS:
                if hasattr(p, attr):
                    setattr(shadow, attr, getattr(p, attr))
            shadows.append(shadow)
        tp_rank, tp_group = role.tp_rank, groups.tp_group
        fold_all = [pc for per in pieces for pc in per]
        params_fold = [pc for pc in fold_all if not pc.add]  # parameters are whole on every rank, never summed
        reshard.exchange(
            params_fold, tp_rank, tp_group, src=lambda i: compute[i][1].data, dst=lambda i: shadows[i].data
        )

        super().__init__(
            config,
            ddp_config,
            _shadow_module((n, s) for (n, _), s in zip(compute, shadows) if s is not None),
            disable_bucketing,
            pg_collection,
            full_param_layout,
        )

        # Compute-side gradient accumulation (what the layers and the hooks add into).
        grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else None
        for _, p in compute:
            p.main_grad = torch.zeros_like(p, dtype=grad_dtype or p.dtype)
            p.grad_added_to_main_grad = False
        scratch = reshard.Scratch()  # the folds' and unfolds' flat buffers, one per dtype
        schedule = _FoldSchedule(
            self._bucket_group_of(compute, shadows, role.spare, tp_group),
            lambda idxs: self._make_fold(
                [pc for i in idxs for pc in pieces[i]], compute, shadows, tp_rank, tp_group, scratch
            ),
            ddp_config.overlap_grad_reduce,
        )
        if not role.spare:  # a spare's own bucket groups (if any) hold only zero gradients: no fold
            for k, bucket_group in enumerate(self.bucket_groups):
                bucket_group.__class__ = NonuniformTPBucketGroup
                bucket_group.ntp_fold = functools.partial(schedule.fold, k)

        self._ntp = _HealthyState(
            compute=compute,
            shadows=shadows,
            tp_rank=tp_rank,
            tp_group=tp_group,
            unfold=reshard.reverse(fold_all, b, r),
            schedule=schedule,
            scratch=scratch,
        )
        self.__dict__["_compute_module"] = module  # not a registered submodule
        self._compute_hooks = []
        for idx, ((_, p), s) in enumerate(zip(compute, shadows)):
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._make_compute_hook(idx, p, None if role.spare else s))
            self._compute_hooks.append(acc)

    def _bucket_group_of(self, compute, shadows, spare: bool, tp_group) -> list[int]:
        """Each compute parameter's bucket group among the core ranks' shadow bucket groups
        (``self.bucket_groups`` order), the same list on every rank of the healthy TP group:
        TP rank 0 (a core rank) broadcasts its own; spares have no such bucket groups."""
        if not compute:
            return []
        mine = torch.full((len(compute),), -1, dtype=torch.int64, device=compute[0][1].device)
        if not spare:
            index_of = {id(s): i for i, s in enumerate(shadows)}
            for k, bucket_group in enumerate(self.bucket_groups):
                for s in bucket_group.params:
                    mine[index_of[id(s)]] = k
        group_of = mine.clone()
        dist.broadcast(group_of, src=dist.get_global_rank(tp_group, 0), group=tp_group)
        if (not spare and not torch.equal(group_of, mine)) or bool((group_of < 0).any()):
            raise RuntimeError(
                "nonuniform TP: the core ranks of a healthy TP group built different shadow bucket groups "
                f"({mine.tolist()} here, {group_of.tolist()} on TP rank 0); every rank needs the same "
                "DistributedDataParallelConfig and model"
            )
        return group_of.tolist()

    # ---- batch shares ---------------------------------------------------------------
    def set_batch_shares(self, shares: BatchShares) -> None:
        """Weight this replica's gradient by its share of every global batch.

        Megatron scales each bucket by ``1 / data_parallel_size`` before the
        data-parallel sum (all-reduce, or reduce-scatter with the distributed
        optimizer). Here the factor is ``shares.gradient_weight(replica)`` =
        ``num_microbatches(replica) / total_microbatches`` (times the group size
        where the collective averages), so that the sum is the mean over every
        micro-batch of the global batch when each replica's loss is divided by its
        own ``num_microbatches`` (Megatron's forward-backward function does that).
        With ``calculate_per_token_loss`` the factor stays 1: the collective sums
        per-token losses and ``finalize_model_grads`` divides by the global token
        count, which is exact for any shares.

        Takes effect at the next gradient sync; call it between steps on every
        rank with the shares the sampler and ``num_microbatches`` use."""
        if not isinstance(shares, BatchShares):
            raise TypeError(f"batch_shares must be a BatchShares (ntp_config.batch_shares(...)), got {shares!r}")
        layout, replica = self._ntp_groups.layout, self._ntp_groups.role.replica
        if shares.num_replicas != layout.num_replicas:
            raise ValueError(
                f"batch_shares are for {shares.num_replicas} replicas but the job has "
                f"{layout.num_replicas}; build them with ntp_config.batch_shares(...)"
            )
        if self.ddp_config.num_distributed_optimizer_instances > 1 and len(set(shares.microbatches)) > 1:
            raise NotImplementedError(
                "unequal batch shares with num_distributed_optimizer_instances > 1 are not "
                "supported; use one distributed-optimizer instance or --ntp-balance none"
            )
        self.batch_shares = shares
        if self.config.calculate_per_token_loss:
            return
        weight = shares.gradient_weight(replica)
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            factor = weight
            if bucket_group.ddp_config.average_in_collective:
                group = (
                    bucket_group.intra_distributed_optimizer_instance_group
                    if bucket_group.ddp_config.use_distributed_optimizer
                    else bucket_group.data_parallel_group
                )
                factor *= group.size()
            for bucket in bucket_group.buckets:
                bucket.gradient_scaling_factor = factor

    # ---- healthy-replica machinery -------------------------------------------------
    @property
    def compute_module(self) -> torch.nn.Module:
        """The module ``forward`` runs (``tp_base`` layout on healthy replicas)."""
        return self.__dict__.get("_compute_module", self.module)

    @property
    def is_ntp_healthy_rank(self) -> bool:
        return self._ntp is not None

    def memory_report(self, optimizer=None) -> DDPMemoryReport:
        """This rank's bytes for parameters, gradients, the training shadow and
        (given the Megatron optimizer) the optimizer: :class:`DDPMemoryReport`.
        Local, no communication; sizes do not change during training except the
        optimizer state, which torch's Adam allocates at the first step."""
        return ddp_memory_report(self, optimizer)

    @staticmethod
    def _make_fold(pieces, compute, shadows, tp_rank, tp_group, scratch):
        return reshard.Exchange(
            pieces,
            tp_rank,
            tp_group,
            src=lambda i: compute[i][1].main_grad,
            dst=lambda i: shadows[i].main_grad,
            scratch=scratch,
        ).run

    def _make_compute_hook(self, index, param, shadow):
        def hook(*unused):
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad.data)
            param.grad = None
            if self.ddp_config.overlap_grad_reduce:
                self._ntp.schedule.grad_ready(index)  # may fold this parameter's bucket group
                if shadow is not None:  # core ranks: Megatron's bucket group then starts its collective
                    self.param_to_bucket_group[shadow].register_grad_ready(shadow, self.force_all_reduce)

        return hook

    @torch.no_grad()
    def sync_compute_params(self) -> None:
        """Copy the (optimizer-updated) shadow into the ``tp_base`` compute
        parameters. Runs automatically before the first forward after a grad
        sync; call it yourself after loading a checkpoint into the shadow."""
        if self._ntp is None:
            return
        ntp = self._ntp
        if ntp.unfolds is None:  # one exchange per dtype, built at the first unfold, run every step
            by_dtype = {}
            for pc in ntp.unfold:
                by_dtype.setdefault(ntp.compute[pc.index][1].dtype, []).append(pc)  # a shadow has its param's dtype
            ntp.unfolds = [
                reshard.Exchange(
                    by_dtype[dtype],
                    ntp.tp_rank,
                    ntp.tp_group,
                    # only core ranks send; on a spare (no shadow) src gives the dtype and device at most
                    src=lambda i: (ntp.compute[i][1] if ntp.shadows[i] is None else ntp.shadows[i]).data,
                    dst=lambda i: ntp.compute[i][1].data,
                    scratch=ntp.scratch,
                )
                for dtype in sorted(by_dtype, key=str)
            ]
        for unfold in ntp.unfolds:
            unfold.run()
        ntp.stale = False

    def fold_gradients(self) -> None:
        """Fold this step's pending gradients into the shadow now (healthy replicas; a
        no-op on degraded ones). ``start_grad_sync`` / ``finish_grad_sync`` run the same
        folds first, so calling this before them only moves the folds' time out of the
        DP collective's, e.g. to time them apart. Collective over the TP group: call it on
        every rank of the replica."""
        if self._ntp is not None:
            self._ntp.schedule.fold_pending()

    def refresh_compute_params(self) -> None:
        """Bring the compute parameters up to date with the optimizer's last step
        (a no-op unless the shadow changed since the last unfold). Collective
        over the TP group; call it on every rank before reading
        :attr:`compute_module`'s weights outside forward, e.g. to export them."""
        if self._ntp is not None and self._ntp.stale:
            self.sync_compute_params()

    # ---- DDP interface -------------------------------------------------------------
    def __getattr__(self, name):
        # Megatron reads model attributes through the DDP wrapper (utils.get_attr_wrapped_model
        # follows ``.module``: model_type, set_input_tensor, decoder, post_process, ... in the
        # forward-backward functions). On a healthy replica ``.module`` is the shadow, so what the
        # wrapper itself lacks comes from the compute model, the one forward runs.
        # The compute model may itself be wrapped (Float16Module with --bf16): follow its ``.module``s.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_compute_module")
            if inner is None:
                raise
            while True:
                try:
                    return getattr(inner, name)
                except AttributeError:
                    inner = inner._modules.get("module") if isinstance(inner, torch.nn.Module) else None
                    if inner is None:
                        raise

    def forward(self, *inputs, **kwargs):
        if self._ntp is None:
            return super().forward(*inputs, **kwargs)
        self.refresh_compute_params()
        return self._compute_module(*inputs, **kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        if self._ntp is not None:
            self._compute_module.train(mode)
        return self

    @contextlib.contextmanager
    def no_sync(self):
        with super().no_sync():
            if self._ntp is None:
                yield
                return
            self._ntp.schedule.last_microbatch = False
            try:
                yield
            finally:
                self._ntp.schedule.last_microbatch = True

    def start_grad_sync(self, *unused):
        if self._ntp is not None:
            self._ntp.schedule.fold_pending()
        super().start_grad_sync(*unused)

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        if self._ntp is not None:
            self._ntp.schedule.fold_pending()  # in bucket-group order on every rank, spares included
        super().finish_grad_sync(force_all_reduce=force_all_reduce)
        if self._ntp is not None:
            self._ntp.stale = True

    def zero_grad_buffer(self):
        super().zero_grad_buffer()
        if self._ntp is None:
            return
        self._ntp.schedule.reset()
        self.refresh_compute_params()
        torch._foreach_zero_([p.main_grad for _, p in self._ntp.compute])  # one launch per dtype, not per param
        for _, p in self._ntp.compute:
            p.grad_added_to_main_grad = False
