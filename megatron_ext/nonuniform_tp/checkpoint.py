"""Convert model state between TP layouts: NTP (degraded replicas at
``tp_reduced``) <-> uniform (``tp_base``), through the full (TP=1) tensors.

A degraded replica's ranks hold the model in the ``tp_reduced`` layout. To turn
such shards into the ``tp_base`` layout, merge them and split them at
``tp_base`` (:func:`ntp_to_uniform`); to go the other way, use
:func:`uniform_to_ntp`.

Input: one replica's per-TP-rank ``model.state_dict()`` (e.g. the ``"model"``
entry of each ``mp_rank_XX/model_optim_rng.pt``), as ``{tp_rank: state_dict}``
or as a list whose position is the TP rank. Megatron's state dict carries no TP
rank, so the converter cannot check the order: the caller states it. It does
refuse what it can see: a rank missing from the mapping, a shard given twice,
shards of different TP degrees (or a shard count that differs from the stated
degree), keys missing from a rank, tensors without a :class:`ShardSpec`, and
non-tensor values other than ``_extra_state``. ``_extra_state`` entries (None
on the local spec, Transformer Engine's metadata as bytes or a tensor) are not
TP-split; they are carried through: the merged dict keeps TP rank 0's entry and
every split shard gets a copy of it. The shard specs come from a live model
(:func:`shard_specs`).

For megatron-core's distributed checkpointing (``dist_checkpointing.save`` /
``load``), :func:`model_sharded_state_dict` is a rank's model entry: the healthy
replicas' own (a uniform ``tp_base`` checkpoint), nothing on degraded replicas.
"""

from __future__ import annotations

import collections
import copy
import io
import logging
import re
import time
from typing import Any
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ..sharding.megatron import ShardSpec, shard_spec

log = logging.getLogger(__name__)
_LAYER = re.compile(r"(.*?layers\.\d+)\.")

__all__ = [
    "gather_full_state",
    "is_extra_state",
    "merge_tp_shards",
    "model_sharded_state_dict",
    "ntp_to_uniform",
    "share_common_state",
    "shard_specs",
    "split_tp_full",
    "uniform_to_ntp",
]

#: One replica's state dicts, one per TP rank: ``{tp_rank: state_dict}`` or a
#: list in TP-rank order (position = TP rank).
TPShards = Mapping[int, Mapping[str, Any]] | Sequence[Mapping[str, Any]]

_SPEC_HINT = (
    "build specs with shard_specs(model, gated_linear_unit) from a model of the same "
    "architecture, or give ShardSpec(None) for a tensor that is replicated over TP"
)


def is_extra_state(name: str) -> bool:
    """Whether ``name`` is a module's ``_extra_state`` entry (not a TP-split tensor)."""
    return name == "_extra_state" or name.endswith("._extra_state")


def shard_specs(module: torch.nn.Module, gated_linear_unit: bool) -> dict[str, ShardSpec]:
    """``{name: ShardSpec}`` of every tensor in a Megatron module's
    ``state_dict()`` (parameters and persistent buffers; ``_extra_state``
    entries need none)."""
    specs = {n: shard_spec(n, p, gated_linear_unit) for n, p in module.named_parameters()}
    for n, t in module.state_dict(keep_vars=True).items():
        if n not in specs and torch.is_tensor(t) and not is_extra_state(n):
            specs[n] = shard_spec(n, t, gated_linear_unit)
    return specs


class _Progress:
    """One INFO line per tensor group (a transformer layer, or the rest) of a conversion."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0
        self.group, self.group_tensors, self.group_bytes = None, 0, 0
        self.start = time.perf_counter()

    def step(self, name: str, nbytes: int) -> None:
        m = _LAYER.match(name)
        group = m.group(1) if m else "other tensors"
        if group != self.group:
            self.flush()
            self.group = group
        self.group_tensors += 1
        self.group_bytes += nbytes
        self.done += 1

    def flush(self) -> None:
        if self.group is not None and self.group_tensors:
            log.info(
                "%s: %s: %d tensors, %.1f MB (%d/%d tensors, %.1f s)",
                self.what,
                self.group,
                self.group_tensors,
                self.group_bytes / 1e6,
                self.done,
                self.total,
                time.perf_counter() - self.start,
            )
        self.group_tensors = self.group_bytes = 0


def _check_degree(value, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arg} must be a TP degree, a positive int (1, 2, 4, ...), got {value!r}")
    return value


def _ranked(shards, arg: str, tp: int | None, tp_arg: str) -> list[Mapping[str, Any]]:
    """``shards`` as a list indexed by TP rank, after the checks that need no tensor."""
    form = (
        f"{arg} must be one replica's state dicts, one per TP rank: {{tp_rank: state_dict}} or a list in TP-rank order"
    )
    if isinstance(shards, Mapping):
        keys = list(shards)
        bad = [k for k in keys if isinstance(k, bool) or not isinstance(k, int)]
        if bad:
            hint = " (this looks like a single state dict: pass every TP rank's)" if isinstance(bad[0], str) else ""
            raise ValueError(f"{form}; got the key {bad[0]!r}{hint}")
        missing = sorted(set(range(max(keys, default=-1) + 1)) - set(keys))
        if missing or min(keys, default=0) < 0:
            raise ValueError(
                f"{form}; the TP ranks {sorted(keys)} are not 0..{len(keys) - 1}"
                + (f" (missing TP rank(s) {missing})" if missing else "")
            )
        ranked = [shards[r] for r in range(len(keys))]
    elif isinstance(shards, (list, tuple)):
        ranked = list(shards)
    else:
        raise ValueError(f"{form}; got a {type(shards).__name__}")
    if not ranked:
        raise ValueError(f"{form}; got none")
    for r, sd in enumerate(ranked):
        if not isinstance(sd, Mapping):
            raise ValueError(
                f"{form}; TP rank {r}'s entry is a {type(sd).__name__}, not a state dict ({{name: tensor}})"
            )
    if tp is not None and len(ranked) != _check_degree(tp, tp_arg):
        raise ValueError(
            f"{arg}: got {len(ranked)} shard(s) but {tp_arg}={tp}: pass the state dict "
            f"of every one of the {tp} TP ranks, once"
        )
    return ranked


def _spec_of(specs: Mapping[str, ShardSpec], name: str, t: torch.Tensor) -> ShardSpec:
    """``specs[name]``, checked against the tensor, with ``dim`` made non-negative."""
    if name not in specs:
        raise ValueError(
            f"{name}: no ShardSpec for this tensor in specs; {_SPEC_HINT} (only '_extra_state' entries need no spec)"
        )
    spec = specs[name]
    if not isinstance(spec, ShardSpec):
        raise ValueError(f"{name}: specs[{name!r}] is a {type(spec).__name__}, not a ShardSpec")
    if spec.dim is None:
        return spec
    if isinstance(spec.dim, bool) or not isinstance(spec.dim, int) or not -t.dim() <= spec.dim < t.dim():
        raise ValueError(
            f"{name}: ShardSpec dim {spec.dim!r} does not fit a {t.dim()}-dim tensor of shape "
            f"{tuple(t.shape)}; allowed: None (replicated) or 0..{t.dim() - 1}"
        )
    if isinstance(spec.chunks, bool) or not isinstance(spec.chunks, int) or spec.chunks < 1:
        raise ValueError(
            f"{name}: ShardSpec chunks must be a positive int (2 for a gated fc1, else 1), got {spec.chunks!r}"
        )
    return ShardSpec(spec.dim % t.dim(), spec.chunks)


def _tensor(value, name: str, where: str) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise ValueError(
            f"{name}: {where} holds a {type(value).__name__}, not a tensor; only "
            "'_extra_state' entries may be non-tensors (pass the model's state dict, "
            "e.g. the checkpoint's 'model' entry)"
        )
    return value


def _copy_extra(value):
    """A copy of an ``_extra_state`` value (None, BytesIO, tensor, or picklable object)."""
    if value is None:
        return None
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, io.BytesIO):
        return io.BytesIO(value.getvalue())
    return copy.deepcopy(value)


def _new_state_dict(like: Mapping) -> collections.OrderedDict:
    """An empty state dict carrying ``like``'s ``_metadata`` (module versions), as ``state_dict()`` does."""
    out = collections.OrderedDict()
    meta = getattr(like, "_metadata", None)
    if meta is not None:
        out._metadata = copy.deepcopy(meta)
    return out


def _is_constant(t: torch.Tensor) -> bool:
    return t.numel() <= 1 or bool((t == t.reshape(-1)[0]).all())


def _refuse_duplicates(ranked: list[Mapping[str, Any]], split: list[str], arg: str) -> None:
    """Two TP ranks whose TP-split tensors are all equal hold the same shard
    (real shards differ; all-constant ones, e.g. zero gradients, cannot tell)."""
    for i in range(len(ranked)):
        for j in range(i + 1, len(ranked)):
            same = ranked[i] is ranked[j] or (
                all(torch.equal(ranked[i][k], ranked[j][k]) for k in split)
                and not all(_is_constant(ranked[i][k]) for k in split)
            )
            if same:
                example = f" (e.g. {split[0]})" if split else ""
                raise ValueError(
                    f"{arg}: TP ranks {i} and {j} hold the same shard: every TP-split tensor is equal"
                    f"{example}. Pass each TP rank's state dict once, as {{tp_rank: state_dict}} or a "
                    "list in TP-rank order"
                )


def merge_tp_shards(shards: TPShards, specs: Mapping[str, ShardSpec], *, tp: int | None = None) -> dict[str, Any]:
    """Full (TP=1) state dict from one replica's per-TP-rank state dicts.

    ``shards``: ``{tp_rank: state_dict}``, or a list whose position is the TP
    rank (Megatron's state dict carries no rank, so the order is the caller's
    word). ``tp``: the TP degree they were saved at; if given, the number of
    shards must equal it. Raises ValueError, naming the key, on inconsistent
    shards (see the module docstring).
    """
    return _merge(shards, specs, tp, "shards", "tp")


def _merge(shards, specs, tp, arg: str, tp_arg: str) -> dict[str, Any]:
    ranked = _ranked(shards, arg, tp, tp_arg)
    if not isinstance(specs, Mapping):
        raise ValueError(f"specs must be a {{name: ShardSpec}} mapping; {_SPEC_HINT}")
    names = list(ranked[0])
    for r, sd in enumerate(ranked[1:], 1):
        missing = [n for n in names if n not in sd]
        if missing:
            raise ValueError(
                f"{missing[0]}: in TP rank 0's state dict but missing from TP rank {r}'s; "
                "every TP rank of one checkpoint has the same keys"
            )
        extra = [n for n in sd if n not in ranked[0]]
        if extra:
            raise ValueError(
                f"{extra[0]}: in TP rank {r}'s state dict but missing from TP rank 0's; "
                "every TP rank of one checkpoint has the same keys"
            )
    spec_of, split = {}, []
    for name in names:
        if is_extra_state(name):
            continue
        parts = [_tensor(sd[name], name, f"TP rank {r}") for r, sd in enumerate(ranked)]
        spec = spec_of[name] = _spec_of(specs, name, parts[0])
        for r, p in enumerate(parts[1:], 1):
            if p.shape != parts[0].shape or p.dtype != parts[0].dtype:
                raise ValueError(
                    f"{name}: TP rank {r} holds {tuple(p.shape)} {p.dtype}, TP rank 0 "
                    f"{tuple(parts[0].shape)} {parts[0].dtype}. The shards of one TP degree have equal "
                    "shapes: pass the state dicts of one replica of one checkpoint, every TP rank once"
                )
        if spec.dim is not None:
            split.append(name)
            if parts[0].shape[spec.dim] % spec.chunks:
                raise ValueError(
                    f"{name}: size {parts[0].shape[spec.dim]} along dim {spec.dim} does not "
                    f"split into the {spec.chunks} chunks of its ShardSpec"
                )
    _refuse_duplicates(ranked, split, arg)
    full = _new_state_dict(ranked[0])
    progress = _Progress(f"merging {len(ranked)} TP shards", len(spec_of))
    for name in names:
        if is_extra_state(name):
            full[name] = _copy_extra(ranked[0][name])
            continue
        spec, parts = spec_of[name], [sd[name] for sd in ranked]
        if spec.dim is None:
            full[name] = parts[0].clone()
        else:
            chunked = [p.chunk(spec.chunks, spec.dim) for p in parts]
            full[name] = torch.cat([torch.cat([c[k] for c in chunked], spec.dim) for k in range(spec.chunks)], spec.dim)
        progress.step(name, full[name].numel() * full[name].element_size())
    progress.flush()
    return full


def split_tp_full(full: Mapping[str, Any], specs: Mapping[str, ShardSpec], tp: int) -> list[dict[str, Any]]:
    """Per-TP-rank state dicts of ``full`` (one full, TP=1 state dict) at TP
    degree ``tp`` (Megatron's layout); ``_extra_state`` entries are copied to
    every rank."""
    return _split(full, specs, tp, "tp")


def _split(full, specs, tp, tp_arg: str) -> list[dict[str, Any]]:
    tp = _check_degree(tp, tp_arg)
    if not isinstance(full, Mapping):
        raise ValueError(f"full must be one state dict of full (TP=1) tensors, got a {type(full).__name__}")
    if not isinstance(specs, Mapping):
        raise ValueError(f"specs must be a {{name: ShardSpec}} mapping; {_SPEC_HINT}")
    bad = [k for k in full if not isinstance(k, str)]
    if bad:
        raise ValueError(
            f"full must be one state dict of full (TP=1) tensors ({{name: tensor}}); got the "
            f"key {bad[0]!r} (to convert per-TP-rank shards, merge them first)"
        )
    spec_of = {}
    for name, t in full.items():
        if is_extra_state(name):
            continue
        spec = spec_of[name] = _spec_of(specs, name, _tensor(t, name, "full"))
        if spec.dim is not None and t.shape[spec.dim] % (tp * spec.chunks):
            raise ValueError(
                f"{name}: size {t.shape[spec.dim]} along dim {spec.dim} does not split "
                f"into {tp_arg}={tp} TP shards of {spec.chunks} chunk(s)"
            )
    out = [_new_state_dict(full) for _ in range(tp)]
    progress = _Progress(f"splitting into {tp} TP shards", len(spec_of))
    for name, t in full.items():
        if is_extra_state(name):
            for rank in range(tp):
                out[rank][name] = _copy_extra(t)
            continue
        spec = spec_of[name]
        if spec.dim is None:
            for rank in range(tp):
                out[rank][name] = t.clone()
        else:
            chunks = [c.chunk(tp, spec.dim) for c in t.chunk(spec.chunks, spec.dim)]
            for rank in range(tp):
                out[rank][name] = torch.cat([c[rank] for c in chunks], spec.dim).contiguous()
        progress.step(name, t.numel() * t.element_size())
    progress.flush()
    return out


def ntp_to_uniform(
    reduced_shards: TPShards, specs: Mapping[str, ShardSpec], tp_base: int, *, tp_reduced: int | None = None
) -> list[dict[str, Any]]:
    """``tp_reduced`` shards (one degraded replica's) ->
    ``tp_base`` shards, ready for a uniform-TP resume. ``reduced_shards`` as in
    :func:`merge_tp_shards`; ``tp_reduced``, if given, must equal their number."""
    _check_degree(tp_base, "tp_base")
    return _split(_merge(reduced_shards, specs, tp_reduced, "reduced_shards", "tp_reduced"), specs, tp_base, "tp_base")


def uniform_to_ntp(
    base_shards: TPShards, specs: Mapping[str, ShardSpec], tp_reduced: int, *, tp_base: int | None = None
) -> list[dict[str, Any]]:
    """``tp_base`` shards -> ``tp_reduced`` shards (for a degraded replica).
    ``base_shards`` as in :func:`merge_tp_shards`;
    ``tp_base``, if given, must equal their number."""
    _check_degree(tp_reduced, "tp_reduced")
    return _split(_merge(base_shards, specs, tp_base, "base_shards", "tp_base"), specs, tp_reduced, "tp_reduced")


@torch.no_grad()
def gather_full_state(
    module: torch.nn.Module, tp_group, gated_linear_unit: bool, use_main_grad: bool = False
) -> dict[str, torch.Tensor]:
    """Full (TP=1) tensors of a live TP-sharded module's parameters, gathered in
    its TP group (every rank gets them). ``use_main_grad``: gather
    ``param.main_grad`` instead."""
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


# ---- megatron-core distributed checkpointing ---------------------------------------------------
def model_sharded_state_dict(ddp) -> dict | None:
    """This rank's ``"model"`` entry of a megatron-core distributed checkpoint
    (``dist_checkpointing.save`` / ``load``).

    ``ddp``: Megatron's ``DistributedDataParallel`` (or a subclass) of a uniform
    job, or a :class:`~megatron_ext.nonuniform_tp.NonuniformTPDistributedDataParallel`.

    - Uniform jobs and the healthy replicas of an NTP job (bystanders and partners):
      the model's own ``ddp.module.sharded_state_dict()``. The healthy replicas are a
      uniform ``tp_base`` job, so an NTP job's checkpoint is a uniform ``tp_base``
      checkpoint, and a uniform job resumes it with no conversion (and the reverse).
    - A degraded replica: ``None``. It holds a copy of its partner's weights and no
      optimizer state; leave the ``"model"`` and ``"optimizer"`` entries out of its
      state dict, but call ``dist_checkpointing.save`` / ``load`` on it too (they are
      collective). Its ``state_dict()`` / ``sharded_state_dict()`` refuse.

    Before the save call :func:`share_common_state` on every rank (global rank 0, which writes the
    non-sharded entries, may be degraded). After a load call ``ddp.sync_compute_params()`` on every
    rank, so that each degraded replica takes its partner's loaded weights.
    """
    if getattr(ddp, "ntp_role", None) == "degraded":
        return None
    return ddp.module.sharded_state_dict()


def share_common_state(state: dict, keys: Sequence[str] = ("model", "optimizer")) -> None:
    """Give a degraded rank's checkpoint ``state`` the non-sharded entries of the healthy ranks'
    ``state[key]`` (collective over all ranks: call it on every rank right before
    ``dist_checkpointing.save``; a no-op without a degraded replica).

    ``dist_checkpointing.save`` writes the non-sharded part of a state dict (the optimizer's
    ``param_groups``, Adam's step count) from global rank 0 only. A degraded replica describes no
    model or optimizer (:func:`model_sharded_state_dict` is None there), and a packed launch numbers
    replica 0's ranks first: with replica 0 degraded the checkpoint would lack them, and a job
    resuming it would fail in ``optimizer.load_state_dict``. The first healthy rank's non-sharded
    entries are broadcast and set on the degraded ranks (as ``save``'s own extraction leaves them)."""
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    from .process_groups import get_ntp_process_groups

    groups = get_ntp_process_groups()
    if groups is None or not groups.layout.nonuniform:
        return
    src = groups.layout.tp_group_ranks(groups.layout.healthy_replicas[0])[0]
    common = [None]
    if dist.get_rank() == src:
        parts = {k: extract_sharded_base(extract_nonpersistent(state[k])[1])[1] for k in keys if k in state}
        common[0] = {k: v for k, v in parts.items() if v}
    dist.broadcast_object_list(common, src=src)
    if groups.role.degraded:
        state.update(common[0])
