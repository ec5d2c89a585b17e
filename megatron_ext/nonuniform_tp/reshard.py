"""Move TP shards between the healthy layout (``tp_base`` ranks) and the
degraded layout (``tp_reduced`` ranks) inside one healthy replica's TP group.

How a parameter is sharded is :func:`megatron_ext.sharding.shard_spec`'s
description, shared with the checkpoint converters and the refit. Megatron's
TP-sharded tensors concatenate, rank after rank, into the TP=1
tensor along ``partition_dim`` -- true for the column-parallel QKV (grouped
per query group), fc1, the vocab-parallel embedding and output layer, and the
row-parallel weights. fc1 with gated linear units is the exception: each rank
holds ``[gate_shard; up_shard]``, so it is resharded as two chunks. A shard at
degree ``t`` of rank ``k`` is therefore, per chunk, the contiguous global range
``[k*n/t, (k+1)*n/t)``; resharding is range intersection.

Tensors that are not TP-sharded (norms, row-parallel biases, position
embeddings) are replicated in a TP group: core rank ``i`` keeps its own copy
and spare rank ``j`` receives it from core rank ``j % tp_reduced``.

Some replicated parameters get a *partial* gradient on each TP rank, which
Megatron's ``finalize_model_grads`` sums over the TP group after the
data-parallel collective (:func:`tp_summed_grad`: the q/k layer norms with
``qk_layernorm``, each rank's gradient covering its own heads). Their fold adds
spare ``j``'s gradient into core rank ``j % tp_reduced``'s, so that the sum
over the core ranks is the sum over all ``tp_base`` ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..sharding.megatron import ShardSpec, shard_spec

__all__ = ["Piece", "ShardSpec", "exchange", "reshard_pieces", "shard_spec", "tp_summed_grad"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[src_off, src_off+length)`` of parameter ``index`` along ``dim``
    on TP rank ``src`` go to ``[dst_off, dst_off+length)`` on TP rank ``dst``
    (``dim is None``: the whole tensor). ``add``: added to the destination
    (after the pieces that copy into it) instead of copied."""

    index: int
    src: int
    dst: int
    dim: int | None
    src_off: int = 0
    dst_off: int = 0
    length: int = 0
    add: bool = False

    def view(self, t: torch.Tensor, side: str) -> torch.Tensor:
        if self.dim is None:
            return t
        return t.narrow(self.dim, self.src_off if side == "src" else self.dst_off, self.length)


def tp_summed_grad(config, name: str, param: torch.Tensor) -> bool:
    """Whether Megatron's ``finalize_model_grads`` sums this parameter's gradient
    over the TP group (``_allreduce_non_tensor_model_parallel_grads``, megatron-core
    0.19, same selection): a replicated parameter whose gradient each TP rank
    holds only in part. Parameters it averages (``average_gradients_across_tp_domain``)
    are not summed."""
    if getattr(param, "average_gradients_across_tp_domain", False):
        return False
    return bool(
        (getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False))
        or (getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name))
    )


def reshard_pieces(
    index: int,
    spec: ShardSpec,
    local_size_at_base: int,
    tp_base: int,
    tp_reduced: int,
    name: str | None = None,
    summed: bool = False,
) -> list[Piece]:
    """Pieces that move one parameter from the ``tp_base`` layout (src = healthy
    TP rank) to the ``tp_reduced`` layout (dst = core TP rank). ``local_size_at_base``
    is the size along ``spec.dim`` of a ``tp_base`` shard (ignored when replicated).
    ``summed`` (replicated only, :func:`tp_summed_grad`): the tensor is a partial
    sum per TP rank, so spare ``j``'s is also added into core ``j % tp_reduced``'s."""
    if spec.dim is None:
        pieces = [Piece(index, i, i, None) for i in range(tp_reduced)]
        if summed:
            pieces += [Piece(index, j, j % tp_reduced, None, add=True) for j in range(tp_reduced, tp_base)]
        return pieces
    per_chunk_b = local_size_at_base // spec.chunks
    n = per_chunk_b * tp_base
    if n % tp_reduced:
        raise ValueError(
            f"parameter {name or index}: global size {n} along dim {spec.dim} does not split over "
            f"tp_reduced={tp_reduced}; choose tp_spares so that tp_base and tp_reduced both divide "
            "the head, query-group, FFN and (padded) vocab sizes"
        )
    per_chunk_r = n // tp_reduced
    pieces = []
    for k in range(spec.chunks):
        for j in range(tp_base):
            lo_j, hi_j = j * per_chunk_b, (j + 1) * per_chunk_b
            for i in range(tp_reduced):
                lo, hi = max(lo_j, i * per_chunk_r), min(hi_j, (i + 1) * per_chunk_r)
                if lo < hi:
                    pieces.append(
                        Piece(
                            index,
                            j,
                            i,
                            spec.dim,
                            src_off=k * per_chunk_b + lo - lo_j,
                            dst_off=k * per_chunk_r + lo - i * per_chunk_r,
                            length=hi - lo,
                        )
                    )
    return pieces


def reverse(pieces: Sequence[Piece], tp_base: int, tp_reduced: int) -> list[Piece]:
    """The pieces of the opposite move (``tp_reduced`` core ranks -> ``tp_base`` ranks)."""
    out = []
    for p in pieces:
        if p.dim is None:
            if p.src == p.dst and not p.add:  # replicated: every rank j takes core j % tp_reduced's copy
                out.extend(Piece(p.index, p.src, j, None) for j in range(tp_base) if j % tp_reduced == p.src)
        else:
            out.append(Piece(p.index, p.dst, p.src, p.dim, src_off=p.dst_off, dst_off=p.src_off, length=p.length))
    return out


@torch.no_grad()
def exchange(
    pieces: Sequence[Piece],
    me: int,
    group: dist.ProcessGroup | None,
    src: Callable[[int], torch.Tensor],
    dst: Callable[[int], torch.Tensor],
) -> None:
    """Carry out ``pieces`` inside a TP group: this rank (TP rank ``me``) sends
    ``piece.view(src(index))`` and receives into ``piece.view(dst(index))``
    (copied, or added for ``piece.add`` after every copy).
    One ``all_to_all_single`` per call (all tensors must share a dtype)."""
    size = dist.get_world_size(group)
    send = [[] for _ in range(size)]
    recv = [[] for _ in range(size)]
    own_adds = []
    for p in pieces:
        if p.src == me and p.dst == me:
            if p.add:
                own_adds.append(p)
            else:
                p.view(dst(p.index), "dst").copy_(p.view(src(p.index), "src"))
        elif p.src == me:
            send[p.dst].append(p.view(src(p.index), "src"))
        elif p.dst == me:
            recv[p.src].append((p.view(dst(p.index), "dst"), p.add))
    if size == 1:
        for p in own_adds:
            p.view(dst(p.index), "dst").add_(p.view(src(p.index), "src"))
        return
    dtype = device = None
    for t in [t for lst in send for t in lst] + [t for lst in recv for t, _ in lst]:
        dtype, device = t.dtype, t.device
    if dtype is None:  # nothing to move for me, but peers may still call the collective
        dtype, device = src(pieces[0].index).dtype, src(pieces[0].index).device
    in_splits = [sum(t.numel() for t in lst) for lst in send]
    out_splits = [sum(t.numel() for t, _ in lst) for lst in recv]
    flat_in = (
        torch.cat([t.reshape(-1) for lst in send for t in lst])
        if any(in_splits)
        else torch.empty(0, dtype=dtype, device=device)
    )
    flat_out = torch.empty(sum(out_splits), dtype=dtype, device=device)
    dist.all_to_all_single(flat_out, flat_in, out_splits, in_splits, group=group)
    offset, adds = 0, []
    for lst in recv:
        for t, add in lst:
            n = t.numel()
            if add:
                adds.append((t, flat_out[offset : offset + n].view(t.shape)))
            else:
                t.copy_(flat_out[offset : offset + n].view(t.shape))
            offset += n
    for p in own_adds:
        p.view(dst(p.index), "dst").add_(p.view(src(p.index), "src"))
    for t, received in adds:
        t.add_(received)
