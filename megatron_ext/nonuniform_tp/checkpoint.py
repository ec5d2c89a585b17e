"""Convert model state between TP layouts: NTP (degraded replicas at
``tp_reduced``) <-> uniform (``tp_base``), through the full (TP=1) tensors.

An NTP job's training state is the ``tp_reduced`` layout: a degraded replica's
ranks hold it, and so do the training shadows of healthy replicas' core ranks
(``NonuniformTPDistributedDataParallel.state_dict()``). To resume at full TP
once the GPU is back, merge the ``tp_reduced`` shards and split them at
``tp_base`` (:func:`ntp_to_uniform`); to go the other way, use
:func:`uniform_to_ntp`. Works on per-rank ``{name: tensor}`` dicts (e.g. the
model part of a ``torch.save`` checkpoint) and needs the shard specs, which
:func:`shard_specs` reads from a live model.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from .reshard import ShardSpec, shard_spec

__all__ = ["gather_full_state", "merge_tp_shards", "ntp_to_uniform", "shard_specs", "split_tp_full",
           "uniform_to_ntp"]


def shard_specs(module: torch.nn.Module, gated_linear_unit: bool) -> dict[str, ShardSpec]:
    """``{name: ShardSpec}`` of a Megatron module's parameters."""
    return {n: shard_spec(n, p, gated_linear_unit) for n, p in module.named_parameters()}


def merge_tp_shards(shards: Sequence[Mapping[str, torch.Tensor]],
                    specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """Full tensors from the state dicts of one replica's TP ranks (in TP-rank order)."""
    full = {}
    for name in shards[0]:
        spec = specs.get(name, ShardSpec(None))
        parts = [s[name] for s in shards]
        if spec.dim is None:
            full[name] = parts[0].clone()
            continue
        chunked = [p.chunk(spec.chunks, spec.dim) for p in parts]
        full[name] = torch.cat([torch.cat([c[k] for c in chunked], spec.dim)
                                for k in range(spec.chunks)], spec.dim)
    return full


def split_tp_full(full: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec],
                  tp: int) -> list[dict[str, torch.Tensor]]:
    """Per-TP-rank state dicts of ``full`` at TP degree ``tp`` (Megatron's layout)."""
    out = [{} for _ in range(tp)]
    for name, t in full.items():
        spec = specs.get(name, ShardSpec(None))
        if spec.dim is None:
            for rank in range(tp):
                out[rank][name] = t.clone()
            continue
        if t.shape[spec.dim] % (tp * spec.chunks):
            raise ValueError(f"{name}: size {t.shape[spec.dim]} along dim {spec.dim} does not split "
                             f"into {tp} TP shards of {spec.chunks} chunk(s)")
        chunks = [c.chunk(tp, spec.dim) for c in t.chunk(spec.chunks, spec.dim)]
        for rank in range(tp):
            out[rank][name] = torch.cat([c[rank] for c in chunks], spec.dim).contiguous()
    return out


def ntp_to_uniform(reduced_shards, specs, tp_base: int) -> list[dict[str, torch.Tensor]]:
    """``tp_reduced`` shards (one degraded replica, or healthy core shadows) ->
    ``tp_base`` shards, ready for a uniform-TP resume."""
    return split_tp_full(merge_tp_shards(reduced_shards, specs), specs, tp_base)


def uniform_to_ntp(base_shards, specs, tp_reduced: int) -> list[dict[str, torch.Tensor]]:
    """``tp_base`` shards -> ``tp_reduced`` shards (for a degraded replica or the
    healthy core ranks' shadows)."""
    return split_tp_full(merge_tp_shards(base_shards, specs), specs, tp_reduced)


@torch.no_grad()
def gather_full_state(module: torch.nn.Module, tp_group, gated_linear_unit: bool,
                      use_main_grad: bool = False) -> dict[str, torch.Tensor]:
    """Full (TP=1) tensors of a live TP-sharded module, gathered in its TP group
    (every rank gets them). ``use_main_grad``: gather ``param.main_grad`` instead."""
    specs = shard_specs(module, gated_linear_unit)
    tp = dist.get_world_size(tp_group)
    shards = [{} for _ in range(tp)]
    for name, p in module.named_parameters():
        t = (p.main_grad if use_main_grad else p).detach().contiguous()
        if specs[name].dim is None or tp == 1:
            for s in shards:
                s[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t, group=tp_group)
        for s, part in zip(shards, parts):
            s[name] = part
    return {k: v.cpu() for k, v in merge_tp_shards(shards, specs).items()}
