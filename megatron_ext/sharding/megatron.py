"""Megatron's side of the sharding facts (no communication).

- :class:`ShardSpec` / :func:`shard_spec`: how one Megatron parameter splits over
  tensor parallelism, read from the parameter itself (``partition_dim``; a gated
  ``linear_fc1`` is two chunks, ``[gate_r; up_r]`` per rank). NTP's per-step
  transfers between partner replicas (:mod:`megatron_ext.nonuniform_tp.reshard`), its checkpoint
  converters and the export hook's sources use it.
- :func:`megatron_layout`: where each HF tensor lives in a Megatron job
  (TP x PP x DP, EP and expert TP for experts; rank order ``tp-dp-pp``, experts
  ``etp-ep-edp`` inside a stage); :func:`ntp_megatron_layout` under nonuniform TP.
  TP boxes and fused stacking are :mod:`.geometry`'s, shared with the engines'
  layouts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch

from ..nogc import paused_gc
from .fp8 import fp8_layout
from .geometry import Layout, local_tensors, tp_box
from .names import global_layer_names, global_name, unwrap
from .spec import TensorSpec

__all__ = [
    "ShardSpec",
    "layout_from_recipe",
    "megatron_expert_coords",
    "megatron_layout",
    "megatron_tensors",
    "ntp_megatron_layout",
    "shard_spec",
]


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over TP: along ``dim`` in ``chunks`` chunks
    (``dim is None``: replicated). Each chunk's TP shards concatenate, rank after
    rank, into the TP=1 chunk along ``dim``."""

    dim: int | None
    chunks: int = 1


def shard_spec(name: str, param: torch.Tensor, gated_linear_unit: bool) -> ShardSpec:
    """The :class:`ShardSpec` of a Megatron parameter (local spec or TE)."""
    if not getattr(param, "tensor_model_parallel", False):
        return ShardSpec(None)
    dim = getattr(param, "partition_dim", 0)
    chunks = 2 if gated_linear_unit and dim == 0 and ".linear_fc1." in f".{name}" else 1
    return ShardSpec(dim, chunks)


def _stage_of(spec: TensorSpec, layer_stage: list[int], pp: int) -> int:
    if spec.layer is not None:
        return layer_stage[spec.layer]
    return 0 if "embed_tokens" in spec.name else pp - 1


@paused_gc()  # tens of thousands of boxes and segments at scale (see megatron_ext/nogc.py)
def megatron_layout(
    specs: list[TensorSpec],
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    ranks: Sequence[int] | None = None,
    layer_stage: Sequence[int] | None = None,
) -> Layout:
    """The trainer's layout: dense tensors TP-sharded, replicated over DP;
    inside each stage experts split over EP, each expert sharded over ``etp``
    expert-TP ranks (``linear_fc1`` rows, ``[gate_r; up_r]`` per shard;
    ``linear_fc2`` columns) and replicated over the stage's
    ``tp * dp / (ep * etp)`` expert-DP ranks. ``etp`` defaults to ``tp``, as
    Megatron's ``expert_tensor_parallel_size`` does. ``ranks`` default
    ``range(tp*pp*dp)``; ``layer_stage`` defaults to an even split of layers
    over stages."""
    etp = tp if etp is None else etp
    world = tp * pp * dp
    ranks = tuple(range(world)) if ranks is None else tuple(ranks)
    if len(ranks) != world:
        raise ValueError(f"ranks has {len(ranks)} entries, tp*pp*dp is {world}")
    if (tp * dp) % (ep * etp):
        raise ValueError(f"ep={ep} x etp={etp} must divide tp*dp={tp * dp}")
    layer_stage = _layer_stages(specs, pp) if layer_stage is None else list(layer_stage)
    outside = [st for st in layer_stage if not 0 <= st < pp]
    if outside:
        raise ValueError(f"layer_stage holds stages {sorted(set(outside))} outside 0..{pp - 1} (pp={pp})")
    num_experts = 1 + max((s.expert for s in specs if s.expert is not None), default=0)
    if num_experts % ep:
        raise ValueError(f"ep={ep} must divide the number of experts ({num_experts})")
    by_stage: list[list[TensorSpec]] = [[] for _ in range(pp)]  # each stage's specs, in order (sorted out once)
    for s in specs:
        by_stage[_stage_of(s, layer_stage, pp)].append(s)
    tensors = {}
    built: dict[tuple[int, int, int, int], dict] = {}  # ranks that hold the same shards share one dict of them
    for i, g in enumerate(ranks):
        tp_r, pp_r = i % tp, i // (tp * dp)
        ep_r, etp_r = megatron_expert_coords(i, tp=tp, dp=dp, ep=ep, etp=etp)
        same = built.get((tp_r, pp_r, ep_r, etp_r))
        if same is not None:  # a data-parallel replica: a plan indexes its tensors once (reshard_plan)
            tensors[g] = same
            continue
        boxes, mine = {}, []
        for s in by_stage[pp_r]:
            if s.expert is not None:
                if s.expert * ep // num_experts == ep_r:
                    b = tp_box(s, etp, etp_r, megatron=True)
                    if b is None or (s.tp_dim is not None and s.shape[s.tp_dim] % etp):
                        raise ValueError(
                            f"{s.name}: dim {s.tp_dim} ({s.shape[s.tp_dim]}) is not divisible by expert TP {etp}"
                        )
                    boxes[s.name] = b
                    mine.append(_local_expert(s, s.expert - ep_r * (num_experts // ep)))
                continue
            b = tp_box(s, tp, tp_r, megatron=True)
            if b is not None:
                boxes[s.name] = b
                mine.append(s)
        tensors[g] = built[(tp_r, pp_r, ep_r, etp_r)] = local_tensors(mine, boxes, megatron=True)
    moe = any(s.expert is not None for s in specs)
    return Layout(
        ranks,
        tensors,
        {s.name: s for s in specs},
        f"megatron TP{tp}xPP{pp}xDP{dp}" + (f" EP{ep}" if ep > 1 else "") + (f" ETP{etp}" if etp > 1 and moe else ""),
        # the recipe: this function's arguments
        dict(kind="megatron", tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, ranks=list(ranks), layer_stage=list(layer_stage)),
    )


def layout_from_recipe(specs: list[TensorSpec], recipe: dict) -> Layout:
    """The layout that ``recipe`` (:attr:`Layout.recipe`, e.g. sent by the trainer)
    describes, built from ``specs``."""
    kind = recipe.get("kind") if isinstance(recipe, dict) else None
    if kind == "megatron":
        return megatron_layout(specs, **{k: v for k, v in recipe.items() if k != "kind"})
    if kind == "replicas":
        return _replicas_layout(specs, recipe["groups"], recipe["description"], recipe.get("pp", 1))
    if kind == "fp8-block":
        return fp8_layout(layout_from_recipe(specs, recipe["base"]), recipe["block"])
    raise ValueError(f"unknown layout recipe {recipe!r}: expected kind 'megatron', 'replicas' or 'fp8-block'")


def megatron_expert_coords(i: int, *, tp: int, dp: int, ep: int, etp: int) -> tuple[int, int]:
    """``(ep_rank, etp_rank)`` of the ``i``-th rank of a Megatron job (``tp * dp``
    ranks per stage). Megatron's expert ranks are ordered ``tp-ep-dp-pp`` with
    expert TP fastest (``parallel_state.initialize_model_parallel``: the expert
    ``RankGenerator(tp=etp, ep=ep, dp=tp*dp/(ep*etp), pp=pp)``, order
    ``tp-cp-ep-dp-pp`` with cp 1), so inside a stage rank ``j`` is expert-TP rank
    ``j % etp`` of EP rank ``j // etp % ep``."""
    j = i % (tp * dp)
    return (j // etp) % ep, j % etp


def ntp_megatron_layout(specs: list[TensorSpec], ntp_layout) -> Layout:
    """The trainer's layout under nonuniform TP (``megatron_ext.nonuniform_tp``):
    each data-parallel replica holds the whole model at its own TP degree
    (``tp_base`` when healthy, ``tp_reduced`` when degraded) on its active ranks,
    in each of its pipeline stages (layers split evenly over them, as Megatron does).

    ``ntp_layout`` is the job's ``NTPLayout`` (``NTPLayout.from_config(ntp_config,
    world_size)`` or ``get_ntp_process_groups().layout``). On a degraded replica the
    local tensors are its ``tp_reduced`` parameters
    (``NonuniformTPDistributedDataParallel.compute_module``; ``ddp.module`` is empty
    there), which take their partner's weights only after a step: give the executor
    :func:`~.reshard.ntp_megatron_tensors` and ``refresh=ddp.refresh_compute_params``."""
    pp = ntp_layout.pp
    # each replica's ranks stage by stage (Megatron's tp-pp order within one replica)
    groups = [
        [r for stage in range(pp) for r in ntp_layout.tp_group_ranks(d, stage)] for d in range(ntp_layout.num_replicas)
    ]
    return _replicas_layout(
        specs,
        groups,
        f"megatron NTP tp_base={ntp_layout.tp_base} tp_reduced={ntp_layout.tp_reduced}"
        + (f" PP{pp}" if pp > 1 else "")
        + f" x{ntp_layout.num_replicas} replicas",
        pp=pp,
    )


def _replicas_layout(specs: list[TensorSpec], groups: list[list[int]], description: str, pp: int = 1) -> Layout:
    """Whole-model replicas, each over its own ranks (``groups``: a replica's ranks stage by stage), TP-sharded
    in each of its ``pp`` stages."""
    ranks, tensors = [], {}
    for group in groups:
        ranks += group
        tensors.update(megatron_layout(specs, tp=len(group) // pp, pp=pp, ranks=group).tensors)
    recipe = {"kind": "replicas", "groups": groups, "description": description}
    if pp > 1:
        recipe["pp"] = pp
    return Layout(tuple(ranks), tensors, {s.name: s for s in specs}, description, recipe)


def _local_expert(spec: TensorSpec, local: int) -> TensorSpec:
    """``spec`` under Megatron's name on its EP rank: the expert's index within
    the rank (``local_experts.{j}.`` in SequentialMLP, ``weight{j}`` in TEGroupedMLP)."""
    name = spec.megatron_name.replace(f"local_experts.{spec.expert}.", f"local_experts.{local}.")
    name = re.sub(rf"(\.experts\.linear_fc[12]\.weight){spec.expert}$", rf"\g<1>{local}", name)
    return dataclasses.replace(spec, megatron_name=name)


def _layer_stages(specs: list[TensorSpec], pp: int) -> list[int]:
    n = 1 + max((s.layer for s in specs if s.layer is not None), default=-1)
    if n and n < pp:
        raise ValueError(f"{n} layers cannot fill pp={pp} stages")
    return [layer * pp // n for layer in range(n)]


def megatron_tensors(model) -> dict[str, torch.Tensor]:
    """A Megatron model's parameters under global names (pipeline-stage layer offsets applied).

    For a nonuniform-TP DDP use :func:`~megatron_ext.weight_export.ntp_megatron_tensors`: this returns its
    compute parameters as they are, stale on a degraded replica after an
    optimizer step (until it takes its partner's)."""
    model = unwrap(model)
    prefixes = global_layer_names(model)
    return {global_name(name, prefixes): p.detach() for name, p in model.named_parameters()}
