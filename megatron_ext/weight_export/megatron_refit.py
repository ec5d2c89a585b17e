"""megatron-core's own inference engine as the target of a reshard refit.

Megatron-RL serves rollouts with ``megatron.core.inference``; here that engine
runs in a job of its own and takes every version the trainer job sends over a
:class:`~.control.refit_group.RefitGroup`, written in place into its ``GPTModel``'s
parameters (Megatron's local tensors at the engine's TP degree: no vLLM names,
no ``load_weights``)::

    # trainer job, every rank (T ranks, any TP x PP x DP (x EP); E = engine_tp * engine_dp engine ranks)
    group = wx.RefitGroup.join(host, port, rank=dist.get_rank(), world_size=T + E, backend="nccl")
    refit = megatron_trainer_refit(model, group, engine_tp=E_TP, engine_dp=E_DP, engine_ep=E_EP)
    refit.refit(version)

    # engine job, every rank: initialize_model_parallel(E_TP, expert_model_parallel_size=E_EP,
    #     expert_tensor_parallel_size=engine_expert_tp(E_TP, E_EP)); its GPTModel built from the trainer's config
    group = wx.RefitGroup.join(host, port, rank=T + dist.get_rank(), world_size=T + E, backend="nccl")
    published = receive_model_config(group)      # what megatron_trainer_refit published (JSON, versioned)
    problem = megatron_model_problem(published, tp=E_TP, ep=E_EP)   # None, or the field it cannot build
    if problem: refuse_refit(group, problem)     # every rank of both jobs raises at once, quoting it
    model = build_engine_model(published, device=device)   # weights NaN until the first refit
    engine = MegatronEngine(model, max_batch_size=8, max_sequence_length=4096)
    refit = MegatronEngineRefit(group, engine)   # the engine's layout, from the trainer's published specs
    refit.refit()                                # the next version, in place; the engine's state reset
    # or, gated: refit.refit(verify=wx.RefitGate(engine, tokens, reference_logits, load=False))
    tokens = engine.generate([[3, 17, 5]], num_tokens=16)   # greedy (top_k=1), collective over the engine's TP

:class:`~.engines.megatron.MegatronEngine` is megatron-core's static-batching engine (:mod:`.engines.megatron`).

The vocabulary is copied at Megatron's *padded* rows (:func:`megatron_engine_specs`):
megatron-core's sampling runs over all of ``GPTModel.vocab_size`` rows (greedy
is an argmax over them), so padded rows left at the engine's initial values
would make its tokens differ from the trainer's. The engine's ``GPTModel`` must
therefore have the trainer's padded vocabulary, dtype and shapes; anything else
(and any parameter the trainer does not send) is refused on every rank of both
jobs before a byte moves (:class:`~.plan.errors.RefitRejected`, reason ``"tensors"``).

MoE models (megatron-core's local layer spec: MoE layers of ``SequentialMLP``
experts, softmax top-k routing, dense MLP layers between them by ``moe_layer_freq``) refit at any trainer EP to an
engine EP ``E_EP`` dividing ``engine_tp * engine_dp`` and the number of experts.
The engine's expert TP is :func:`~.engines.megatron_config.engine_expert_tp`:
the engine's TP at EP 1 (experts TP-sharded like the dense MLP, megatron-core's
default), 1 at EP > 1 (whole experts per EP rank); an engine whose Megatron
groups run another expert TP is refused.

The model config (``receive_model_config``, ``megatron_model_problem``,
``build_engine_model``: JSON, versioned) is :mod:`.engines.megatron_config`. The
command ``python -m megatron_ext.weight_export.engine --engine megatron`` runs
the engine side above (:mod:`.engine`): it builds the model from the trainer's
published config, so nobody repeats the model's flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..sharding.geometry import Layout
from ..sharding.megatron import megatron_expert_coords, megatron_layout, megatron_tensors
from ..sharding.mesh import megatron_layout_from_groups
from ..sharding.names import unwrap
from ..sharding.spec import TensorSpec, specs_from_model
from .control.refit_group import RefitGroup
from .engines.gate import RefitGate
from .engines.megatron import MegatronEngine, _positive_int
from .engines.megatron_config import engine_expert_tp, megatron_model_config, publish_model_config
from .exec.reshard import RefitRejected, RefitStats
from .refit import EngineRefit, TrainerRefit

__all__ = [
    "MegatronEngineRefit",
    "megatron_engine_layout",
    "megatron_engine_specs",
    "megatron_trainer_refit",
    "refuse_refit",
]


def megatron_engine_specs(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """``specs`` of a Megatron -> Megatron refit: a vocabulary tensor (embedding,
    output layer) spans Megatron's padded rows (``padded_rows``), so the padded
    rows are copied too. Build the trainer's layout and the engine's from these."""
    return [
        dataclasses.replace(s, shape=(s.padded_rows, *s.shape[1:]), padded_rows=None) if s.padded_rows else s
        for s in specs
    ]


def megatron_engine_layout(
    specs: Sequence[TensorSpec], *, tp: int = 1, dp: int = 1, ep: int = 1, etp: int | None = None, ranks: Sequence[int]
) -> Layout:
    """A megatron-core engine's layout: ``dp`` replicas of a TP ``tp`` Megatron model
    (rank order ``tp-dp``, pipeline size 1) at refit ranks ``ranks``, vocabulary at
    the padded rows (:func:`megatron_engine_specs`). MoE experts split over ``ep``
    expert-parallel ranks, each expert sharded over ``etp`` expert-TP ranks (default
    ``tp``, Megatron's ``expert_tensor_parallel_size`` default), as
    :func:`~megatron_ext.sharding.megatron.megatron_layout` places them. The trainer
    passes it as ``dst``; :class:`MegatronEngineRefit` builds the same one from the
    trainer's specs and its own parallel state (:func:`megatron_trainer_refit` and
    the engine both take ``etp`` from :func:`~.engines.megatron_config.engine_expert_tp`)."""
    _positive_int("megatron_engine_layout", "tp", tp)
    _positive_int("megatron_engine_layout", "dp", dp)
    _positive_int("megatron_engine_layout", "ep", ep)
    if etp is not None:
        _positive_int("megatron_engine_layout", "etp", etp)
    layout = megatron_layout(megatron_engine_specs(specs), tp=tp, dp=dp, ep=ep, etp=etp, ranks=ranks)
    experts = any(s.expert is not None for s in specs)
    layout.description = f"megatron-core engine TP{tp}xDP{dp}" + (
        f" EP{ep} ETP{tp if etp is None else etp}" if experts else ""
    )
    return layout


def megatron_trainer_refit(
    model, group: RefitGroup, *, engine_tp: int = 1, engine_dp: int = 1, engine_ep: int = 1, **executor_kwargs
) -> TrainerRefit:
    """Every trainer rank's :class:`~.refit.TrainerRefit` towards a megatron-core engine job
    of ``engine_tp * engine_dp`` ranks (refit ranks ``T..``): the trainer's layout read from its live
    Megatron groups (its ranks are refit ranks ``0..T-1``, its global ranks), both layouts from
    :func:`megatron_engine_specs` of ``model``'s specs. An MoE model's experts are split over
    ``engine_ep`` engine ranks (it must divide ``engine_tp * engine_dp``; expert TP
    :func:`~.engines.megatron_config.engine_expert_tp`: whole experts when ``engine_ep > 1``); a dense
    model ignores it. ``executor_kwargs``: ``bucket_bytes``, ``max_inflight``, ``atomic``,
    ``check_finite`` (the engine's must be the same).

    Refit rank 0 first publishes, through the group's store, what the engine needs to build the
    same ``GPTModel`` (:func:`~.engines.megatron_config.megatron_model_config`, with the engine's
    ``{"tp", "dp", "ep", "etp"}``), or, when this side cannot build its layouts, why (the engine
    then stops at once, quoting it)."""
    import torch.distributed as dist

    _positive_int("megatron_trainer_refit", "engine_tp", engine_tp)
    _positive_int("megatron_trainer_refit", "engine_dp", engine_dp)
    _positive_int("megatron_trainer_refit", "engine_ep", engine_ep)
    if group.rank != dist.get_rank():
        raise ValueError(
            f"megatron_trainer_refit: the trainer's refit ranks are its global ranks, but global rank "
            f"{dist.get_rank()} joined the refit group as refit rank {group.rank}"
        )
    try:
        padded = unwrap(model).vocab_size  # the vocabulary at Megatron's padded rows: every row is copied
        specs = megatron_engine_specs(specs_from_model(model, vocab_size=padded))
        src = megatron_layout_from_groups(specs)
        trainer = len(src.ranks)
        if group.world_size != trainer + engine_tp * engine_dp:
            raise ValueError(
                f"the refit group has {group.world_size} ranks; the trainer's {trainer} + engine_tp={engine_tp} x "
                f"engine_dp={engine_dp} make {trainer + engine_tp * engine_dp}"
            )
        if (engine_tp * engine_dp) % engine_ep:
            raise ValueError(
                f"engine_ep={engine_ep} must divide the engine's engine_tp={engine_tp} x engine_dp={engine_dp} ranks"
            )
        etp = engine_expert_tp(engine_tp, engine_ep)
        dst = megatron_engine_layout(
            specs, tp=engine_tp, dp=engine_dp, ep=engine_ep, etp=etp, ranks=range(trainer, group.world_size)
        )
        published = megatron_model_config(model)
        published["engine"] = {"tp": engine_tp, "dp": engine_dp, "ep": engine_ep, "etp": etp}
    except Exception as exc:
        publish_model_config(group, error=exc)  # the engine waits for the config first: tell it why nothing comes
        raise
    publish_model_config(group, published)
    return TrainerRefit(group, src, dst, megatron_tensors(model), **executor_kwargs)


def refuse_refit(group: RefitGroup, problem: str, **executor_kwargs) -> None:
    """An engine rank that cannot take part in the trainer's refit (it cannot build the trainer's
    model, a flag does not fit it) says why, where it would build its :class:`MegatronEngineRefit`:
    every rank of both jobs raises :class:`~.plan.errors.RefitRejected` (reason ``"tensors"``) at the
    plan check, this rank with ``problem`` and the others quoting it, within seconds rather than
    after the group's timeout. Always raises."""
    _Refusal(group, problem, **executor_kwargs)
    raise RefitRejected(f"{problem} (not refused by the other ranks)", reason="tensors")  # not reached


class _Refusal(EngineRefit):
    """Takes part in the plan check with nothing to receive, only to say why this rank cannot."""

    def __init__(self, group: RefitGroup, problem: str, **executor_kwargs):
        self._problem = problem
        # the trainer's own layout as the destination: this rank holds nothing of either, so it needs no tensors
        super().__init__(group, None, lambda specs, trainer: trainer, {}, **executor_kwargs)

    def _model_problem(self) -> str | None:
        return self._problem


class MegatronEngineRefit(EngineRefit):
    """An engine rank's side of the reshard refit into a :class:`MegatronEngine`.

    Joins the trainer's refit (``group``: this rank is refit rank ``T + its engine-job rank``),
    takes the trainer's layout and specs from the trainer, and writes every version into
    ``engine.model``'s parameters in place at the engine's layout
    (:func:`megatron_engine_layout`: TP, EP and expert TP from the engine job's parallel
    state, DP = engine ranks / TP); after each refit the engine's inference state is reset and
    ``engine.version`` says what it holds. The trainer builds its side with
    :func:`megatron_trainer_refit` (its ``engine_ep`` the engine's EP). Refused on every rank
    before a byte moves (reason ``"tensors"``) when the model is not the trainer's at this
    layout: another shape (e.g. another padded vocabulary), dtype, a parameter the trainer does
    not send, TP or EP ranks out of Megatron's order, engine ranks that are not a multiple of the
    TP size, an expert TP other than :func:`~.engines.megatron_config.engine_expert_tp`, or a
    trainer whose layout keeps only the HF vocabulary rows (not built by :func:`megatron_trainer_refit`).
    ``verify``: a :class:`~.engines.gate.RefitGate` built with ``consumer=engine, load=False``.
    """

    def __init__(
        self,
        group: RefitGroup,
        engine: MegatronEngine,
        *,
        bucket_bytes: int = 64 << 20,
        max_inflight: int = 2,
        atomic: bool = True,
        check_finite: bool = True,
        memory_budget_bytes: int | None = None,
        atomic_staging: str = "device",
        memory_budget_strict: bool = True,
        zero_copy_bytes: int | None = None,
    ):
        from megatron.core import parallel_state as ps

        self.engine = engine
        initialized = ps.model_parallel_is_initialized()
        self.tp = ps.get_tensor_model_parallel_world_size() if initialized else 1
        self._tp_rank = ps.get_tensor_model_parallel_rank() if initialized else 0
        self.ep = ps.get_expert_model_parallel_world_size() if initialized else 1
        self.etp = ps.get_expert_tensor_parallel_world_size() if initialized else 1
        self._expert_coords = (
            (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()) if initialized else (0, 0)
        )
        self._layout_problem: str | None = None
        tp, ep, etp, world, rank = self.tp, self.ep, self.etp, group.world_size, group.rank

        def layout(specs: list[TensorSpec], trainer: Layout) -> Layout:
            cut = next((s for s in specs if s.padded_rows), None)
            first = len(trainer.ranks)
            engines = world - first
            if cut is not None:
                self._layout_problem = (
                    f"engine refit rank {rank}: the trainer's layout keeps {cut.shape[0]} of the {cut.padded_rows} "
                    f"padded rows of {cut.name}; megatron-core samples over every padded row: build the trainer's "
                    "side with megatron_trainer_refit (layouts from megatron_engine_specs)"
                )
            elif engines < 1 or engines % tp or engines % ep:
                self._layout_problem = (
                    f"engine refit rank {rank}: the refit group's {world} ranks less the trainer's {first} leave "
                    f"{engines} engine ranks, not a multiple of the engine's TP {tp}"
                    + (f" and EP {ep}" if ep > 1 else "")
                )
            elif etp != engine_expert_tp(tp, ep):
                self._layout_problem = (
                    f"engine refit rank {rank}: its Megatron groups run expert TP {etp} at TP {tp} x EP {ep}; the "
                    f"megatron-core engine runs expert TP {engine_expert_tp(tp, ep)} there (the TP at EP 1, whole "
                    "experts at EP > 1): initialize_model_parallel(..., expert_tensor_parallel_size="
                    "engine_expert_tp(tp, ep))"
                )
            if self._layout_problem is not None:  # refused at the plan check, on every rank of both jobs
                return trainer  # a stand-in destination this rank holds nothing of
            return megatron_engine_layout(specs, tp=tp, dp=engines // tp, ep=ep, etp=etp, ranks=range(first, world))

        super().__init__(
            group,
            None,
            layout,
            megatron_tensors(engine.model),
            bucket_bytes=bucket_bytes,
            max_inflight=max_inflight,
            atomic=atomic,
            check_finite=check_finite,
            memory_budget_bytes=memory_budget_bytes,
            atomic_staging=atomic_staging,
            memory_budget_strict=memory_budget_strict,
            zero_copy_bytes=zero_copy_bytes,
        )

    def _model_problem(self) -> str | None:
        if self._layout_problem is not None:
            return self._layout_problem
        if self.rank not in self.dst.ranks:
            return None
        who = f"engine refit rank {self.rank}"
        position = self.rank - min(self.dst.ranks)
        if position % self.tp != self._tp_rank:
            return (
                f"{who} is TP rank {position % self.tp} of the engine's layout but TP rank {self._tp_rank} of its "
                "Megatron groups: join the refit group as refit rank T + the engine job's rank, with Megatron's "
                "default rank order (TP ranks consecutive)"
            )
        engines = len(self.dst.ranks)
        coords = megatron_expert_coords(position, tp=self.tp, dp=engines // self.tp, ep=self.ep, etp=self.etp)
        if coords != self._expert_coords:
            return (
                f"{who} is (EP, expert-TP) rank {coords} of the engine's layout but {self._expert_coords} of its "
                "Megatron groups: initialize_model_parallel with Megatron's default rank order"
            )
        local = self.dst.tensors[self.rank]
        extra = sorted(set(self.tensors) - set(local))
        if extra:
            return (
                f"{who}: the engine's model has parameters the trainer does not send: {extra[:3]} (build the "
                "engine's GPTModel from the trainer's config: same layers, biases, tied embeddings)"
            )
        for name, lt in local.items():
            t = self.tensors.get(name)
            if t is not None and tuple(t.shape) != lt.shape:
                return (
                    f"{who}: {name} is {tuple(t.shape)}, the trainer's model at engine TP{self.tp} is {lt.shape} "
                    "(build the engine's GPTModel from the trainer's config and padded vocabulary)"
                )
        return None

    def refit(
        self, version: int | None = None, *, timeout_s: float | None = None, verify: RefitGate | None = None
    ) -> RefitStats:
        """:meth:`EngineRefit.refit` (the trainer's next version, written into the engine's
        parameters), then the engine's inference state is reset, also after a failed refit."""
        try:
            return super().refit(version, timeout_s=timeout_s, verify=verify)
        finally:
            self.engine.reset()
            self.engine.version = self.version
