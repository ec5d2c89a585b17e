"""``NonuniformTPDistributedDataParallel``: Megatron's DDP for NTP jobs.

Healthy replicas are a uniform ``tp_base`` job: Megatron's own DDP, grad
buffers, buckets and optimizer, DP groups over the healthy replicas only.

A degraded replica (TP ``tp_reduced``) is a *satellite* of one healthy
*partner* replica (:mod:`.layout`). It runs forward and backward on its
``tp_reduced`` shards, holds their gradients and no optimizer state (its
``module`` as the optimizer sees it is empty). Per partner bucket group, as
soon as the satellite's gradients of that group are ready, they are resharded
to ``tp_base`` and *added* into the partner's bucket, inside the partner's
``start_grad_sync`` just before its DP collective (one all-to-all over the pair
of replicas per transfer unit). After the optimizer step, before the next
forward (or in ``zero_grad_buffer``), the partner sends the updated parameters
back, resharded to ``tp_reduced``. The exchanges run in units of at most
``NonuniformTPConfig.transfer_chunk_mb`` (MiB of fp32 gradient: everything one
exchange moves over the pair; a larger tensor is cut into slices), one flat
workspace per dtype shared by all of them (:class:`.reshard.Scratch`), so a
rank's staging is at most that size per dtype.

Healthy replicas that are nobody's partner (*bystanders*) run exactly the code
of Megatron's DDP: the only difference is the gradient weight of each replica
(``1 / replicas``, or its batch share) in place of ``1 / dp_size``.

Gradient weights: replica ``d`` weighs ``w_d`` (``1 / replicas``, or its share of
the global batch with :class:`.balance.BatchShares`). A healthy bucket is scaled by
its replica's ``w`` before the DP sum; the satellite's gradient arrives scaled by
``w_sat / w_partner``, so the sum is the exact weighted mean.

Overlapped parameter gather (``overlap_param_gather`` with the distributed optimizer):
the partner's parameters are whole only group by group during its next forward, as
Megatron's forward pre-hooks finish each bucket group's all-gather. So the parameters go
back group by group too: the partner sends a group right after its gather finishes, the
satellite receives it in a forward pre-hook of the first of its modules that uses it. Both
sides run the groups in the order Megatron gathers them (the last bucket group first),
a group before it forcing those ahead of it; whatever the forward did not need moves before
the step's first gradient transfer.

Overlap (``overlap_grad_reduce``): the partner dispatches each bucket group from
its backward hooks, in the order Megatron does. That order is recorded in the
first step (which dispatches in ``finish_grad_sync``, in bucket-group order on
both sides) and sent to the satellite, which from the second step on transfers
each group when its own gradients are ready, in that order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from . import reshard
from .balance import BatchShares
from .config import NonuniformTPConfig
from .process_groups import NTPProcessGroups, get_ntp_process_groups

__all__ = ["DDPMemoryReport", "NonuniformTPDistributedDataParallel", "PartnerBucketGroup", "ddp_memory_report"]


@dataclasses.dataclass(frozen=True)
class DDPMemoryReport:
    """Bytes one rank holds for the model, by what holds them (``numel * element_size``
    of the tensors themselves, on any device; not allocator statistics).

    ``role``: ``"uniform"`` (Megatron's DDP, or NTP without a degraded replica),
    ``"bystander"`` (a healthy replica that is nobody's partner), ``"partner"`` or
    ``"degraded"``.

    - ``params``: the parameters ``forward`` runs; Megatron's whole param buffer where the
      distributed optimizer allocated one (bucket padding included).
    - ``grads``: the gradients backward accumulates into: Megatron's grad buffer (padding
      included), or on a degraded rank its ``main_grad`` tensors.
    - ``staging``: the flat buffers of the gradient and parameter transfers between a
      degraded replica and its partner (0 elsewhere).
    - ``optimizer_main_params``: the optimizer's own copies of the parameters (fp32 main
      params of a bf16/fp16 model; 0 when it steps the model's tensors in place), and
      ``optimizer_state``: its state tensors (Adam's moments and step counts). ``None`` when
      no optimizer was given.
    """

    role: str
    params: int
    grads: int
    staging: int = 0
    optimizer_main_params: int | None = None
    optimizer_state: int | None = None

    @property
    def optimizer(self) -> int:
        return (self.optimizer_main_params or 0) + (self.optimizer_state or 0)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.staging + self.optimizer

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "optimizer": self.optimizer, "total": self.total}


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
    groups = getattr(ddp, "_ntp_groups", None)
    role = "uniform" if groups is None else groups.role.kind
    pair = getattr(ddp, "_pair", None)
    staging = 0 if pair is None else pair.scratch.nbytes
    if role == "degraded":
        params = list(ddp.compute_module.parameters())
        grads = sum(_nbytes(p.main_grad) for p in pair.params)
    else:
        params = list(ddp.module.parameters())
        grads = sum(_nbytes(b.grad_data) for b in buffers)
    report = DDPMemoryReport(role, _param_bytes(params, buffers), grads, staging)
    if optimizer is not None:
        model_tensors = params + [b.param_data for b in buffers if b.param_data is not None]
        main, state = _optimizer_bytes(optimizer, model_tensors)
        report = dataclasses.replace(report, optimizer_main_params=main, optimizer_state=state)
    return report


class PartnerBucketGroup(_ParamAndGradBucketGroup):
    """A partner replica's bucket group: adds its satellite's gradients of the group into the
    bucket right before Megatron scales and reduces it, and records (in the first step) the
    order in which the backward hooks complete the groups."""

    ntp_pair = None  # the _PairState, set by NonuniformTPDistributedDataParallel
    ntp_index = 0  # this group's index in ddp.bucket_groups
    ntp_seq = -1  # position of this group's last grad-ready report in the first step

    def register_grad_ready(self, param, force_all_reduce=False):
        if self.is_last_microbatch and self.is_first_batch:
            self.ntp_seq = next(self.ntp_pair.counter)
        super().register_grad_ready(param, force_all_reduce=force_all_reduce)

    def start_grad_sync(self, force_all_reduce: bool | None = False):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        self.ntp_pair.transfer_gradients(self.ntp_index)
        super().start_grad_sync(force_all_reduce=force_all_reduce)

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False):
        super().finish_param_sync(skip_next_bucket_dispatch=skip_next_bucket_dispatch)
        pair = self.ntp_pair
        if pair.stale and not pair.sent[self.ntp_index]:
            pair.send_weights(self.ntp_index)  # this group's parameters are whole now: its satellite's turn


@dataclasses.dataclass
class _PairState:
    """One side of a degraded replica and its partner: the transfer units and their exchanges."""

    partner: bool  # True on the partner's ranks, False on the satellite's
    params: list  # this side's trainable parameters, in named_parameters order (the same on both sides)
    units: list  # per bucket group of the partner: the gradient units (lists of reshard.Piece)
    grads: list  # per group: [reshard.Exchange per unit] (satellite -> partner, added)
    weights: list  # per group: [reshard.Exchange per unit] (partner -> satellite, copied)
    scratch: reshard.Scratch
    group: object  # the pair's process group
    root: int  # global rank of the partner's TP rank 0
    overlap: bool
    param_gather: bool = False  # overlap_param_gather: the parameters go back group by group in the forward
    bucket_groups: list = dataclasses.field(default_factory=list)  # the partner's (to finish a gather early)
    scale: float = 1.0  # the satellite's gradient weight over the partner's
    order: list | None = None  # the partner's dispatch order of its groups (from the first step)
    done: list = dataclasses.field(default_factory=list)  # per group: transferred this step
    stale: bool = False  # an optimizer step happened since the last parameter transfer
    sent: list = dataclasses.field(default_factory=list)  # per group: its parameters went back since that step
    counter: object = dataclasses.field(default_factory=itertools.count)
    # satellite: when each group is ready (Megatron's rule: golden grad-ready counts of the first step)
    group_of: list = dataclasses.field(default_factory=list)
    last_microbatch: bool = True
    golden: list | None = None
    counts: list = dataclasses.field(default_factory=list)
    next_pos: int = 0

    def __post_init__(self):
        self.done = [False] * len(self.units)
        self.sent = [True] * len(self.units)
        self.counts = [{} for _ in self.units]

    # ---- parameters back ----
    def mark_stale(self) -> None:
        """An optimizer step comes: every group's parameters go back before the satellite uses them."""
        self.stale = True
        self.sent = [False] * len(self.weights)

    def send_weights(self, k: int | None = None) -> None:
        """The parameters back, group by group in the order Megatron gathers them (the last bucket
        group first), up to group ``k`` (None: all). On the partner, with ``param_gather``, each
        group's all-gather is finished first (a no-op where the forward finished it)."""
        for j in reversed(range(len(self.weights))):
            if not self.sent[j]:
                if self.partner and self.param_gather:
                    # Megatron's, not PartnerBucketGroup's (which would come back here)
                    _ParamAndGradBucketGroup.finish_param_sync(self.bucket_groups[j], skip_next_bucket_dispatch=True)
                for exchange in self.weights[j]:
                    exchange.run()
                self.sent[j] = True
            if j == k:
                break
        self.stale = not all(self.sent)

    def dispatch_order(self) -> list[int]:
        return self.order if self.order is not None else list(range(len(self.units)))

    def transfer_gradients(self, k: int) -> None:
        """Group ``k``'s gradient units (once per step). On the partner it runs where Megatron's
        bucket group starts its collective; the satellite runs them in the partner's order."""
        if self.done[k]:
            return
        if self.stale and self.param_gather:  # groups the forward did not use: back before any gradient moves
            self.send_weights()
        if self.partner and self.order is not None:
            expected = self.order[self.next_pos] if self.next_pos < len(self.order) else None
            if expected != k:
                raise RuntimeError(
                    f"nonuniform TP: partner bucket group {k} started its gradient sync where group {expected} was "
                    f"expected (the order recorded in the first step: {self.order}); the backward pass of this "
                    "step reached the bucket groups in another order, so the satellite would send another group"
                )
        for exchange in self.grads[k]:
            exchange.run(scale=1.0 if self.partner else self.scale)
        self.done[k] = True
        self.next_pos += 1

    # ---- satellite scheduling ----
    def grad_ready(self, index: int) -> None:
        if not (self.overlap and self.last_microbatch):
            return
        k = self.group_of[index]
        counts = self.counts[k]
        counts[index] = counts.get(index, 0) + 1
        if self.golden is None or self.order is None:
            return  # the first step transfers in finish_grad_sync, in group order
        order = self.order
        while self.next_pos < len(order) and self.counts[order[self.next_pos]] == self.golden[order[self.next_pos]]:
            self.transfer_gradients(order[self.next_pos])

    def flush(self) -> None:
        if self.stale and self.param_gather:
            self.send_weights()
        for k in self.dispatch_order():
            self.transfer_gradients(k)

    def reset(self) -> None:
        if self.golden is None and any(self.counts):
            self.golden = self.counts
        self.counts = [{} for _ in self.units]
        self.done = [False] * len(self.units)
        self.next_pos = 0
        self.last_microbatch = True


class NonuniformTPDistributedDataParallel(DistributedDataParallel):
    """Drop-in replacement for megatron-core's ``DistributedDataParallel``.

    Same arguments plus ``ntp_config`` (and optionally the ``ntp_groups`` returned
    by :func:`initialize_nonuniform_tp_process_groups`; default: the installed
    ones). ``symm_mem_config`` (a :class:`megatron_ext.fsdp_symm.SymmMemConfig`)
    stages the healthy replicas' bucket buffers in NCCL symmetric memory per its
    policy; on gloo or unsupported setups they stay plain with one warning.

    On healthy replicas and in uniform jobs it is Megatron's DDP (partners add their
    satellite's gradients and send it the parameters, see the module docstring). On a
    degraded replica ``self.module`` is an empty module (the optimizer built over it owns
    nothing) and :attr:`compute_module` is the ``tp_reduced`` model that ``forward`` runs.

    ``batch_shares`` (a :class:`~megatron_ext.nonuniform_tp.balance.BatchShares`, from
    ``ntp_config.batch_shares(global_batch_size, micro_batch_size)``) makes the gradient the
    exact global-batch mean when replicas process unequal shares; it is required when
    ``ntp_config.balance`` is not ``"none"``. See :meth:`set_batch_shares`.

    With ``calculate_per_token_loss`` set ``config.finalize_model_grads_func`` to
    :func:`megatron_ext.nonuniform_tp.finalize_model_grads` (it adds a satellite's token
    count to its partner's before Megatron's).
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
            # Stage the buckets' grad/param buffers in NCCL symmetric memory where the policy says so.
            from megatron_ext.fsdp_symm.ddp import stage_ddp_buffers

            self.symm_mem_decisions = stage_ddp_buffers(self, symm_mem_config)
        if batch_shares is not None:
            self.set_batch_shares(batch_shares)
        elif self._ntp_groups.ntp_active:
            self._set_weights([1.0 / self._ntp_groups.layout.num_replicas] * self._ntp_groups.layout.num_replicas)

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
        self._pair = None
        self._tokens_shared = False
        if config.pipeline_model_parallel_size != ntp_config.pipeline_model_parallel_size:
            raise ValueError(
                f"the model config has pipeline_model_parallel_size={config.pipeline_model_parallel_size} but "
                f"NonuniformTPConfig.pipeline_model_parallel_size={ntp_config.pipeline_model_parallel_size}: pass the "
                "same --pipeline-model-parallel-size to both"
            )
        if groups.layout.nonuniform and config.virtual_pipeline_model_parallel_size not in (None, 1):
            raise ValueError(
                "nonuniform TP does not run interleaved pipeline schedules (virtual_pipeline_model_parallel_size="
                f"{config.virtual_pipeline_model_parallel_size}, --num-layers-per-virtual-pipeline-stage) in a job "
                "with a degraded replica: a degraded replica and its partner run different numbers of micro-batches, "
                "and the interleaved schedule then reaches the model chunks' transfers in different orders on the two; "
                "drop --num-layers-per-virtual-pipeline-stage"
            )
        role = groups.role
        kind = role.kind
        if kind != "degraded":
            super().__init__(config, ddp_config, module, disable_bucketing, pg_collection, full_param_layout)
            if kind == "partner":
                self._init_pair(config, ddp_config, self._trainable(module), ntp_config, partner=True)
            return
        # A degraded replica: Megatron's DDP over an empty module (no buffers, and the optimizer built
        # over it owns nothing); the model itself forward runs, with its own gradient accumulation.
        super().__init__(config, ddp_config, torch.nn.Module(), disable_bucketing, pg_collection, full_param_layout)
        self.__dict__["_compute_module"] = module  # not a registered submodule
        named = self._trainable(module)
        params = [p for _, p in named]
        grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else None
        for p in params:
            p.main_grad = torch.zeros_like(p, dtype=grad_dtype or p.dtype)
            p.grad_added_to_main_grad = False
        self._init_pair(config, ddp_config, named, ntp_config, partner=False)
        self._grad_hooks = []
        for index, p in enumerate(params):
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._make_grad_hook(index, p))
            self._grad_hooks.append(acc)

    @staticmethod
    def _trainable(module):
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def _init_pair(self, config, ddp_config, named, ntp_config, partner: bool) -> None:
        names, params = [n for n, _ in named], [p for _, p in named]
        groups = self._ntp_groups
        layout, role = groups.layout, groups.role
        degraded = role.replica if not partner else role.partner
        healthy = role.partner if not partner else role.replica
        group = groups.pair_group
        base_ranks = [dist.get_group_rank(group, g) for g in layout.tp_group_ranks(healthy, role.stage)]
        reduced_ranks = [dist.get_group_rank(group, g) for g in layout.tp_group_ranks(degraded, role.stage)]
        root = layout.tp_group_ranks(healthy, role.stage)[0]
        device = params[0].device if params else torch.device("cpu")
        # The partner's bucket group of every parameter and its unit size, sent to the satellite (the same
        # on every partner rank); both sides then cut the same pieces into the same units. Then, per
        # parameter, whether the partner's finalize_model_grads sums its gradient over TP (its satellite
        # routes a summed gradient rank to rank: a degraded replica at TP 1 has no sequence parallelism).
        n = len(params)
        summed = [reshard.tp_summed_grad(config, names[i], params[i]) for i in range(n)]
        plan = torch.full((2 * n + 1,), -1, dtype=torch.int64, device=device)
        if partner:
            index_of = {id(p): i for i, p in enumerate(params)}
            for k, bucket_group in enumerate(self.bucket_groups):
                for p in bucket_group.params:
                    plan[index_of[id(p)]] = k
            plan[n : 2 * n] = torch.tensor(summed, dtype=torch.int64)
            # elements of a unit: transfer_chunk_mb of fp32 gradients
            plan[-1] = max(1, int(ntp_config.transfer_chunk_mb * 2**20) // 4)
        mine = plan.clone()
        dist.broadcast(plan, src=root, group=group)
        if (partner and not torch.equal(plan, mine)) or bool((plan < 0).any()):
            raise RuntimeError(
                "nonuniform TP: the ranks of a partner replica built different bucket groups or transfer units, or "
                f"a trainable parameter is in none ({mine.tolist()} here, {plan.tolist()} on its TP rank 0); every "
                "rank needs the same DistributedDataParallelConfig, --ntp-transfer-chunk-mb and model"
            )
        plan = plan.tolist()
        group_of, summed_at_base, max_elems = plan[:n], [bool(x) for x in plan[n : 2 * n]], plan[-1]
        # A gradient that is a partial sum per TP rank on the satellite must be summed on the partner too, and
        # one summed on the partner must be partial on the satellite or whole (at TP 1). One all-reduce over
        # the pair: the first parameter where the two disagree (+1; 0: none), so every rank of both refuses.
        odd = [
            i for i in range(n) if not partner and summed[i] != summed_at_base[i] and (summed[i] or role.tp_size > 1)
        ]
        first = torch.tensor([odd[0] + 1 if odd else 0], dtype=torch.int64, device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
        if first.item():
            i = int(first.item()) - 1
            raise ValueError(
                f"nonuniform TP: the gradient of {names[i]} is {'' if summed_at_base[i] else 'not '}summed over the "
                f"TP group on the partner replica (TP {layout.tp_base}) and {'not ' if summed_at_base[i] else ''}on "
                f"its degraded replica (TP {layout.tp_reduced}): build every replica with the same sequence_parallel "
                "and qk_layernorm (sequence_parallel may be off only at TP 1, where Megatron refuses it)"
            )
        members = [[] for _ in range(max(group_of, default=-1) + 1)]
        for i, k in enumerate(group_of):
            members[k].append(i)
        b = layout.tp_base
        me = dist.get_group_rank(group, dist.get_rank())
        scratch = reshard.Scratch()
        shapes = [tuple(p.shape) for p in params]

        def pieces(idx, gradient):
            out = []
            for i in idx:
                p = params[i]
                spec = reshard.shard_spec(names[i], p, config.gated_linear_unit)
                size = 0  # along the split dim, of a tp_base shard
                if spec.dim is not None:
                    size = p.shape[spec.dim] if partner else p.shape[spec.dim] * role.tp_size // b
                out += reshard.pair_pieces(
                    i, spec, size, base_ranks, reduced_ranks, gradient=gradient, summed=summed_at_base[i], name=names[i]
                )
            return out

        grad_units = [reshard.pack_units(pieces(m, True), shapes, max_elems) for m in members]
        weight_units = [reshard.pack_units(pieces(m, False), shapes, max_elems) for m in members]
        grad_of = lambda i: params[i].main_grad  # noqa: E731
        data_of = lambda i: params[i].data  # noqa: E731
        self._pair = _PairState(
            partner=partner,
            params=params,
            units=grad_units,
            grads=[[reshard.Exchange(u, me, group, grad_of, grad_of, scratch) for u in per] for per in grad_units],
            weights=[[reshard.Exchange(u, me, group, data_of, data_of, scratch) for u in per] for per in weight_units],
            scratch=scratch,
            group=group,
            root=root,
            overlap=ddp_config.overlap_grad_reduce,
            param_gather=ddp_config.overlap_param_gather,
            bucket_groups=list(self.bucket_groups) if partner else [],
            group_of=group_of,
        )
        if partner:
            for k, bucket_group in enumerate(self.bucket_groups):
                bucket_group.__class__ = PartnerBucketGroup
                bucket_group.ntp_pair, bucket_group.ntp_index = self._pair, k
        elif ddp_config.overlap_param_gather:
            # each module takes its parameters' groups before it runs (and every group ahead of them)
            index_of = {id(p): i for i, p in enumerate(params)}
            for module in self._compute_module.modules():
                mine = [group_of[index_of[id(p)]] for p in module.parameters(recurse=False) if id(p) in index_of]
                if mine:
                    module.register_forward_pre_hook(self._make_param_hook(min(mine)))
        self.sync_compute_params()  # the satellite starts from its partner's weights

    def _make_param_hook(self, group: int):
        def hook(*unused):
            if self._pair.stale:
                self._pair.send_weights(group)

        return hook

    def _make_grad_hook(self, index, param):
        def hook(*unused):
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad.data)
            param.grad = None
            if self.ddp_config.overlap_grad_reduce:
                self._pair.grad_ready(index)  # may transfer this parameter's bucket group (and later ready ones)

        return hook

    # ---- batch shares ---------------------------------------------------------------
    def set_batch_shares(self, shares: BatchShares) -> None:
        """Weight every replica's gradient by its share of every global batch.

        Megatron scales each bucket by ``1 / data_parallel_size`` before the
        data-parallel sum (all-reduce, or reduce-scatter with the distributed
        optimizer). Here the factor is ``shares.gradient_weight(replica)`` =
        ``num_samples(replica) / global_batch_size`` (times the group size where the
        collective averages), and a satellite's gradient arrives scaled by its weight
        over its partner's, so that the sum is the mean over every sample of the
        global batch when each replica's loss is divided by its own
        ``num_microbatches`` (Megatron's forward-backward function does that) and
        every micro-batch is full. With ``calculate_per_token_loss`` the factors stay
        1: the collective sums per-token losses and ``finalize_model_grads`` divides by
        the global token count, which is exact for any shares -- and the only exact
        way for shares in samples with a partial micro-batch, which are refused
        without it.

        Takes effect at the next gradient sync; call it between steps on every
        rank with the shares the sampler and ``num_microbatches`` use."""
        if not isinstance(shares, BatchShares):
            raise TypeError(f"batch_shares must be a BatchShares (ntp_config.batch_shares(...)), got {shares!r}")
        if shares.partial and not self.config.calculate_per_token_loss:
            raise ValueError(
                f"batch_shares {list(shares.sample_counts)} samples in micro-batches of {shares.micro_batch_size} "
                "leave a partial micro-batch, which needs calculate_per_token_loss=True (--calculate-per-token-loss): "
                "Megatron's forward-backward function divides every micro-batch's loss by the number of "
                "micro-batches, which weighs a partial one's samples more; turn it on, or use shares in whole "
                "micro-batches (--ntp-share-unit microbatch)"
            )
        layout = self._ntp_groups.layout
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
        self._set_weights([shares.gradient_weight(d) for d in range(layout.num_replicas)])

    def _set_weights(self, weights: list[float]) -> None:
        if self.config.calculate_per_token_loss:
            return
        role = self._ntp_groups.role
        if self._pair is not None:
            satellite = role.replica if role.degraded else role.partner
            healthy = role.partner if role.degraded else role.replica
            self._pair.scale = weights[satellite] / weights[healthy]
        weight = weights[role.replica]
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

    # ---- the pair of replicas -------------------------------------------------------
    @property
    def compute_module(self) -> torch.nn.Module:
        """The module ``forward`` runs (the ``tp_reduced`` model on a degraded replica)."""
        return self.__dict__.get("_compute_module", self.module)

    @property
    def ntp_role(self) -> str:
        """``"uniform"``, ``"bystander"``, ``"partner"`` or ``"degraded"``."""
        return self._ntp_groups.role.kind

    def memory_report(self, optimizer=None) -> DDPMemoryReport:
        """This rank's bytes for parameters, gradients, transfer staging and (given the
        Megatron optimizer) the optimizer: :class:`DDPMemoryReport`. Local, no
        communication; sizes do not change during training except the optimizer state,
        which torch's Adam allocates at the first step."""
        return ddp_memory_report(self, optimizer)

    @torch.no_grad()
    def sync_compute_params(self) -> None:
        """The partner's parameters into its satellite's (resharded to ``tp_reduced``). Runs
        by itself before the first forward after a step; call it yourself, on every rank of
        the pair, after loading a checkpoint into the healthy replicas. A no-op elsewhere."""
        pair = self._pair
        if pair is None:
            return
        for per in pair.weights:
            for exchange in per:
                exchange.run()
        pair.stale = False
        pair.sent = [True] * len(pair.weights)

    def refresh_compute_params(self) -> None:
        """Bring a degraded replica's parameters up to date with its partner's last step (a
        no-op unless a step happened since the last transfer). Collective over the pair: call
        it on every rank before reading :attr:`compute_module`'s weights outside forward, e.g.
        to export them."""
        pair = self._pair
        if pair is None or not pair.stale:
            return
        self._settle_order()
        pair.send_weights()

    def _settle_order(self) -> None:
        """After the first step: the order in which the partner's bucket groups dispatched, sent to
        the satellite (it transfers in that order from now on). Collective over the pair, once."""
        pair = self._pair
        if pair.overlap and pair.order is None:
            order = list(range(len(pair.units)))
            if pair.partner:
                order.sort(key=lambda k: self.bucket_groups[k].ntp_seq)
            order = torch.tensor(order, dtype=torch.int64, device=_device_of(pair))
            dist.broadcast(order, src=pair.root, group=pair.group)
            pair.order = order.tolist()

    def broadcast_params(self):
        """Megatron's (healthy replicas: from DP rank 0 over the healthy DP group), then every
        degraded replica takes its partner's parameters (training scripts call this on every rank
        after building the model)."""
        super().broadcast_params()
        self.sync_compute_params()

    def transfer_gradients(self) -> None:
        """This step's pending gradient transfers of the pair, now, in the partner's order: a
        degraded replica sends, its partner adds them into its buckets (whose collectives then
        find them done). A no-op elsewhere. Collective over the pair: call it on every rank of
        both replicas, e.g. to time the transfers apart from the DP collective."""
        if self._pair is not None:
            self._pair.flush()

    # ---- DDP interface -------------------------------------------------------------
    def __getattr__(self, name):
        # Megatron reads model attributes through the DDP wrapper (utils.get_attr_wrapped_model
        # follows ``.module``: model_type, set_input_tensor, decoder, post_process, ... in the
        # forward-backward functions). On a degraded replica ``.module`` is empty, so what the
        # wrapper itself lacks comes from the model forward runs (through Float16Module's ``.module``s).
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
        pair = self._pair
        if pair is not None and pair.stale and pair.param_gather:
            # the parameters go back group by group as this forward gathers them (forward pre-hooks); a
            # partner whose pre-hooks are off (Megatron's disable_forward_pre_hook) sends them all now
            self._settle_order()
            if pair.partner and not self.remove_forward_pre_hook_handles:
                pair.send_weights()
        else:
            self.refresh_compute_params()
        if "_compute_module" not in self.__dict__:
            return super().forward(*inputs, **kwargs)
        return self._compute_module(*inputs, **kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        if "_compute_module" in self.__dict__:
            self._compute_module.train(mode)
        return self

    def _refuse_degraded_state(self, what: str):
        raise RuntimeError(
            f"{what} of a degraded replica: it holds a copy of its partner's weights at TP "
            f"{self._ntp_groups.layout.tp_reduced} and no optimizer state; the healthy replicas hold the job's "
            "state in the uniform tp_base layout. Save from them (model_sharded_state_dict(ddp) returns None here: "
            "leave 'model' and 'optimizer' out on this rank, but call dist_checkpointing.save/load on it too)"
        )

    def state_dict(self, *args, **kwargs):
        if "_compute_module" in self.__dict__:
            self._refuse_degraded_state("state_dict()")
        return super().state_dict(*args, **kwargs)

    def sharded_state_dict(self, *args, **kwargs):
        if "_compute_module" in self.__dict__:
            self._refuse_degraded_state("sharded_state_dict()")
        return super().sharded_state_dict(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        with super().no_sync():
            if self._pair is None or self._pair.partner:
                yield
                return
            self._pair.last_microbatch = False
            try:
                yield
            finally:
                self._pair.last_microbatch = True

    def start_grad_sync(self, *unused):
        if self._pair is not None and not self._pair.partner:
            self._pair.flush()
        super().start_grad_sync(*unused)

    def finish_grad_sync(self, force_all_reduce: bool | None = False):
        pair = self._pair
        if pair is not None and self.config.calculate_per_token_loss and not self._tokens_shared:
            raise RuntimeError(
                "nonuniform TP with calculate_per_token_loss: a degraded replica's token count must reach its "
                "partner's before Megatron divides by the global count; set config.finalize_model_grads_func = "
                "megatron_ext.nonuniform_tp.finalize_model_grads (it wraps Megatron's)"
            )
        self._tokens_shared = False
        if pair is not None and not pair.partner:
            pair.flush()  # in the partner's order, the groups not sent yet
        super().finish_grad_sync(force_all_reduce=force_all_reduce)
        if pair is not None:
            pair.mark_stale()

    def zero_grad_buffer(self):
        super().zero_grad_buffer()
        pair = self._pair
        if pair is None:
            return
        pair.reset()
        if not pair.param_gather:  # (with it, the partner's parameters are whole only in its next forward)
            self.refresh_compute_params()
        if not pair.partner:
            torch._foreach_zero_([p.main_grad for p in pair.params])  # one launch per dtype, not per param
            for p in pair.params:
                p.grad_added_to_main_grad = False


def _device_of(pair: _PairState) -> torch.device:
    return pair.params[0].device if pair.params else torch.device("cpu")
