"""Move TP shards between the healthy layout (``tp_base`` ranks) and the
degraded layout (``tp_reduced`` ranks): a degraded replica's gradients into its
healthy partner's, the partner's parameters back (:func:`pair_pieces`).

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
embeddings) are replicated in a TP group: degraded rank ``i`` takes partner
rank ``i``'s copy, and partner rank ``j`` adds degraded rank ``j % tp_reduced``'s
gradient.

Some replicated parameters get a *partial* gradient on each TP rank, which
Megatron's ``finalize_model_grads`` sums over the TP group after the
data-parallel collective (:func:`tp_summed_grad`: the q/k layer norms with
``qk_layernorm``, each rank's gradient covering its own heads; with
``sequence_parallel`` the norms and row-parallel biases, each rank's covering its
part of the sequence). Degraded rank ``i``'s partial goes to partner rank ``i``
only, so that the partner's TP sum holds every rank's part once. A degraded
replica at TP 1 (no sequence parallelism there: Megatron refuses it) holds the
whole gradient, which goes to partner rank 0 alike; the partner decides which
gradients are summed, for both sides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..copies import CopyBatch
from ..sharding.megatron import ShardSpec, shard_spec

__all__ = [
    "Exchange",
    "Piece",
    "Scratch",
    "ShardSpec",
    "pack_units",
    "pair_pieces",
    "reshard_pieces",
    "shard_spec",
    "tp_summed_grad",
]


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
) -> list[Piece]:
    """Pieces that move one parameter from the ``tp_base`` layout (src = TP rank at
    ``tp_base``) to the ``tp_reduced`` layout (dst = TP rank at ``tp_reduced``).
    ``local_size_at_base`` is the size along ``spec.dim`` of a ``tp_base`` shard (ignored
    when replicated: TP rank ``i`` of either degree keeps its own copy)."""
    if spec.dim is None:
        return [Piece(index, i, i, None) for i in range(tp_reduced)]
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


def pair_pieces(
    index: int,
    spec: ShardSpec,
    local_size_at_base: int,
    base_ranks: Sequence[int],
    reduced_ranks: Sequence[int],
    *,
    gradient: bool,
    summed: bool = False,
    name: str | None = None,
) -> list[Piece]:
    """The pieces of one parameter between a healthy partner (``base_ranks[j]``: the group rank
    of its TP rank ``j``) and its degraded satellite (``reduced_ranks[i]``).

    ``gradient=False``: the partner's parameter into the satellite's (copies; replicated tensors
    from partner rank ``i`` to degraded rank ``i``). ``gradient=True``: the satellite's gradient
    *added* into the partner's; a replicated gradient of degraded rank ``j % tp_reduced`` into
    partner rank ``j``, or with ``summed`` (:func:`tp_summed_grad`, a partial sum per TP rank)
    degraded rank ``i``'s into partner rank ``i`` only."""
    b, r = len(base_ranks), len(reduced_ranks)
    if spec.dim is None:
        if not gradient:
            return [Piece(index, base_ranks[i], reduced_ranks[i], None) for i in range(r)]
        if summed:
            return [Piece(index, reduced_ranks[i], base_ranks[i], None, add=True) for i in range(r)]
        return [Piece(index, reduced_ranks[j % r], base_ranks[j], None, add=True) for j in range(b)]
    out = []
    for p in reshard_pieces(index, spec, local_size_at_base, b, r, name=name):
        if gradient:
            out.append(
                Piece(
                    index,
                    reduced_ranks[p.dst],
                    base_ranks[p.src],
                    p.dim,
                    src_off=p.dst_off,
                    dst_off=p.src_off,
                    length=p.length,
                    add=True,
                )
            )
        else:
            out.append(dataclasses.replace(p, src=base_ranks[p.src], dst=reduced_ranks[p.dst]))
    return out


def _split(p: Piece, shape: Sequence[int], max_elems: int) -> list[Piece]:
    """``p`` cut along its dim (a replicated tensor along dim 0) into consecutive pieces of at most
    ``max_elems`` elements, or of one slice where a slice alone is larger. ``shape``: the parameter's
    shape on this side; the two sides agree on every dim but the split one, so they cut alike."""
    dim = p.dim if p.dim is not None else (0 if len(shape) else None)
    if dim is None:
        return [p]
    rest = 1
    for d, n in enumerate(shape):
        if d != dim:
            rest *= n
    length = p.length if p.dim is not None else shape[0]
    if length * rest <= max_elems:
        return [p]
    step = max(1, max_elems // max(rest, 1))
    return [
        dataclasses.replace(p, dim=dim, src_off=p.src_off + o, dst_off=p.dst_off + o, length=min(step, length - o))
        for o in range(0, length, step)
    ]


def _numel(p: Piece, shape: Sequence[int]) -> int:
    n = 1
    for d, size in enumerate(shape):
        n *= p.length if d == p.dim else size
    return n


def pack_units(pieces: Sequence[Piece], shapes: Sequence[Sequence[int]], max_elems: int) -> list[list[Piece]]:
    """``pieces`` (in order) cut and packed into units of at most ``max_elems`` elements in all, so
    that one :class:`Exchange` of a unit stages at most that many elements on any rank (a rank
    sends and receives a subset of the unit). ``shapes[index]``: parameter ``index``'s shape on
    this side. Deterministic: both sides of a pair, given the same pieces, get the same units."""
    if max_elems < 1:
        raise ValueError(f"max_elems must be >= 1, got {max_elems}")
    units: list[list[Piece]] = []
    size = 0
    for piece in pieces:
        for q in _split(piece, shapes[piece.index], max_elems):
            n = _numel(q, shapes[q.index])
            if not units or (units[-1] and size + n > max_elems):
                units.append([])
                size = 0
            units[-1].append(q)
            size += n
    return units


class Scratch:
    """Flat send/receive buffers shared by the exchanges of one model, one per dtype, as large as
    the largest exchange: they run one after another (each collective is ordered on the stream
    before the next exchange's copies), so the model holds one such workspace, not one per
    bucket group."""

    def __init__(self):
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self.buffers[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def moved(self, dtype: torch.dtype, ptr: int) -> bool:
        """Whether the ``dtype`` buffer was reallocated (grown for a larger exchange) since ``ptr``."""
        return self.buffers[dtype].data_ptr() != ptr

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class Exchange:
    """``pieces`` carried out inside a TP group, built once and run many times (NTP's per-step
    unfold and folds): this rank (TP rank ``me``) sends ``piece.view(src(index))`` and receives
    into ``piece.view(dst(index))`` (copied, or added for ``piece.add`` after every copy).

    One ``all_to_all_single`` per run (all tensors must share a dtype). The views, split sizes
    and the copies into and out of the flat send/receive buffers are fixed at construction and
    issued as multi-tensor copies (:class:`~megatron_ext.copies.CopyBatch`), so a run costs a
    few kernel launches however many pieces there are (a fused QKV splits into one piece per
    query group). ``src`` / ``dst`` are called again at each run only to check that the
    tensors were not reallocated (e.g. a checkpoint load that replaced ``.data``); if one was,
    the exchange is rebuilt."""

    def __init__(
        self,
        pieces: Sequence[Piece],
        me: int,
        group: dist.ProcessGroup | None,
        src: Callable[[int], torch.Tensor],
        dst: Callable[[int], torch.Tensor],
        scratch: Scratch | None = None,
    ):
        self.pieces, self.me, self.group, self.src, self.dst = list(pieces), me, group, src, dst
        self.scratch = Scratch() if scratch is None else scratch
        self.indices = sorted({p.index for p in self.pieces})
        self._build()

    def _pointers(self) -> list[int]:
        return [(self.src if side == "src" else self.dst)(i).data_ptr() for i, side in self.used]

    @torch.no_grad()
    def _build(self) -> None:
        me, size = self.me, dist.get_world_size(self.group)
        send = [[] for _ in range(size)]
        recv = [[] for _ in range(size)]
        local, own_adds, used = [], [], set()
        for p in self.pieces:
            if p.src == me:
                used.add((p.index, "src"))
            if p.dst == me:
                used.add((p.index, "dst"))
            if p.src == me and p.dst == me:
                (own_adds if p.add else local).append(
                    (p.view(self.dst(p.index), "dst"), p.view(self.src(p.index), "src"))
                )
            elif p.src == me:
                send[p.dst].append(p.view(self.src(p.index), "src"))
            elif p.dst == me:
                recv[p.src].append((p.view(self.dst(p.index), "dst"), p.add))
        self.used = sorted(used)
        self.size, self.ptrs = size, self._pointers()
        self.local, self.own_adds = CopyBatch(local), own_adds
        if size == 1:
            return
        moved = [t for lst in send for t in lst] + [t for lst in recv for t, _ in lst]
        # nothing to move for me, but peers still call the collective: any tensor of the dtype will do
        first = moved[0] if moved else self.src(self.pieces[0].index)
        self.in_splits = [sum(t.numel() for t in lst) for lst in send]
        self.out_splits = [sum(t.numel() for t, _ in lst) for lst in recv]
        n_in = sum(self.in_splits)
        flat = self.scratch.get(first.dtype, first.device, n_in + sum(self.out_splits))
        self.flat_in, self.flat_out, self.flat_ptr = flat[:n_in], flat[n_in:], flat.data_ptr()
        self.pack = CopyBatch(
            zip(_slices(self.flat_in, [t for lst in send for t in lst]), (t for lst in send for t in lst))
        )
        received = [(t, add) for lst in recv for t, add in lst]
        parts = _slices(self.flat_out, [t for t, _ in received])
        self.unpack = CopyBatch((t, part) for (t, add), part in zip(received, parts) if not add)
        self.adds = [(t, part) for (t, add), part in zip(received, parts) if add]

    @torch.no_grad()
    def run(self, scale: float = 1.0) -> None:
        """One exchange; ``scale``: this rank's outgoing pieces are multiplied by it on the way
        (in the flat send buffer; the source tensors are left as they are)."""
        if self._pointers() != self.ptrs or (self.size > 1 and self.scratch.moved(self.flat_in.dtype, self.flat_ptr)):
            self._build()
        self.local.run()
        if self.size > 1:
            self.pack.run()
            if scale != 1.0 and self.flat_in.numel():
                self.flat_in.mul_(scale)
            dist.all_to_all_single(self.flat_out, self.flat_in, self.out_splits, self.in_splits, group=self.group)
            self.unpack.run()
        _add_all(self.own_adds)
        if self.size > 1:
            _add_all(self.adds)


def _slices(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive pieces of ``flat`` shaped like ``like``."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _add_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if pairs:  # one multi-tensor launch per dtype, not one per piece
        dsts, srcs = zip(*pairs)
        torch._foreach_add_(list(dsts), list(srcs))
