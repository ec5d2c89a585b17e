"""Where every Hugging Face tensor lives: boxes, fused stacking and layouts (no communication).

Coordinates are always the *Hugging Face* tensor's (``q_proj``, ``gate_proj``,
one tensor per expert, ...). A rank holds a :class:`Box` of an HF tensor (a
``[start, stop)`` range per dim) inside one of its *local* tensors. A local
tensor is a stack along dim 0 of :class:`Segment` s, which is how fused tensors
are described without gathering: Megatron's ``linear_qkv`` shard is
``[q_g; k_g; v_g]`` per local query group, its ``linear_fc1`` shard
``[gate_r; up_r]``, and an inference engine's ``qkv_proj`` / ``gate_up_proj``
shard ``[q_r; k_r; v_r]`` / ``[gate_r; up_r]``. :func:`tp_box` is the one rule
for what a TP rank holds of a tensor (Megatron's and an engine's), and
:func:`local_tensors` the one rule for how fused parts stack.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence

import torch

from .spec import TensorSpec

__all__ = ["Box", "Layout", "LocalTensor", "Segment", "local_tensors", "split_range", "tp_box", "whole_layout"]


@dataclasses.dataclass(frozen=True)
class Box:
    """``[start, stop)`` per dim of an HF tensor."""

    ranges: tuple[tuple[int, int], ...]

    def __hash__(self) -> int:  # boxes key the planner's dicts: hashed once
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(self.ranges)

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        return cls(tuple((0, s) for s in shape))

    def replace(self, dim: int, start: int, stop: int) -> "Box":
        r = list(self.ranges)
        r[dim] = (start, stop)
        return Box(tuple(r))

    def intersect(self, other: "Box") -> "Box | None":
        out = []  # a plain loop with an early exit: the planner calls this ~10^4 times per plan
        for (a0, a1), (b0, b1) in zip(self.ranges, other.ranges):
            lo, hi = (a0 if a0 > b0 else b0), (a1 if a1 < b1 else b1)
            if lo >= hi:
                return None
            out.append((lo, hi))
        return Box(tuple(out))

    def contains(self, other: "Box") -> bool:
        for (a0, a1), (b0, b1) in zip(self.ranges, other.ranges):
            if b0 < a0 or a1 < b1:
                return False
        return True

    @functools.cached_property  # a frozen box: computed once (the planner and the executor ask often)
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.ranges)

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def slices(self) -> tuple[slice, ...]:
        """Index the HF tensor with these to get the box's view."""
        return tuple(slice(a, b) for a, b in self.ranges)


@dataclasses.dataclass(frozen=True)
class Segment:
    """``box`` of HF tensor ``name``, stored at row ``row`` of a local tensor."""

    name: str
    box: Box
    row: int


@dataclasses.dataclass(frozen=True)
class LocalTensor:
    """One tensor a rank holds: ``shape`` and its segments stacked on dim 0."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class Layout:
    """A mesh of global ranks and, per rank, its local tensors.

    ``ranks`` are global ranks (of the job that moves the bytes); the two sides'
    ranks may be disjoint (separate GPUs) or overlap (colocated).
    """

    ranks: tuple[int, ...]
    tensors: dict[int, dict[str, LocalTensor]]
    specs: dict[str, TensorSpec]
    description: str = ""
    recipe: dict | None = None  # JSON-able: how to rebuild it from the same specs (megatron.layout_from_recipe)
    base: Layout | None = None  # the layout this one was derived from (fp8.fp8_layout: its unquantized form)

    def holdings(self, name: str) -> list[tuple[int, str, Segment]]:
        """``(rank, local tensor, segment)`` of every copy of any part of HF tensor ``name``."""
        return self._index().get(name, [])

    def _index(self) -> dict[str, list[tuple[int, str, Segment]]]:
        if getattr(self, "_idx", None) is None:
            idx: dict[str, list] = {}
            for rank, locals_ in self.tensors.items():
                for lt in locals_.values():
                    for seg in lt.segments:
                        idx.setdefault(seg.name, []).append((rank, lt.name, seg))
            self._idx = idx
        return self._idx

    def segments(self, rank: int) -> Iterator[tuple[LocalTensor, Segment]]:
        for lt in self.tensors.get(rank, {}).values():
            for seg in lt.segments:
                yield lt, seg

    def hf_tensors(self, rank: int, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, view)`` of every HF tensor ``rank`` holds whole, as views
        into its local ``tensors`` (e.g. to load an engine replica into an HF
        model, or to feed ``load_weights`` after a refit)."""
        for lt, seg in self.segments(rank):
            if seg.box == Box.full(self.specs[seg.name].shape):
                n = seg.box.shape[0]
                yield seg.name, tensors[lt.name][seg.row : seg.row + n].view(self.specs[seg.name].shape)

    def bytes_held(self, rank: int) -> int:
        return sum(lt.nbytes for lt in self.tensors.get(rank, {}).values())


def split_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``n`` split into ``parts`` (ceil-sized parts, last one clipped)."""
    size = -(-n // parts)
    return min(i * size, n), min((i + 1) * size, n)


def tp_box(spec: TensorSpec, tp: int, r: int, *, megatron: bool, vocab_padding: int = 1) -> Box | None:
    """The box of ``spec`` on TP rank ``r`` of ``tp`` (None: nothing, e.g. padded rows only)."""
    kv = bool(spec.fused and spec.fused[0] == "qkv" and spec.fused[1] > 0)
    if kv and megatron and spec.tp_dim is not None and 1 < tp and spec.num_groups < tp:
        raise ValueError(f"{spec.name}: Megatron needs num_query_groups ({spec.num_groups}) divisible by TP ({tp})")
    return _tp_box(spec.shape, spec.tp_dim, kv, spec.num_groups, spec.padded_rows, tp, r, megatron, vocab_padding)


@functools.lru_cache(maxsize=1 << 14)  # a model's tensors share a few shapes: one Box each (frozen, shared)
def _tp_box(shape, tp_dim, kv: bool, num_groups: int, padded_rows, tp: int, r: int, megatron: bool, vocab_padding: int):
    box = Box.full(shape)
    if tp_dim is None or tp == 1:
        return box
    d = tp_dim
    if kv:
        # k / v: whole query groups per rank; an engine with tp > groups repeats them.
        head_dim = shape[0] // num_groups
        if tp <= num_groups:
            g0, g1 = split_range(num_groups, tp, r)
        else:
            g0 = r * num_groups // tp
            g1 = g0 + 1
        return box.replace(0, g0 * head_dim, g1 * head_dim)
    n = shape[d]
    if d == 0 and padded_rows:  # vocabulary rows
        n = padded_rows if megatron else -(-n // vocab_padding) * vocab_padding
    a, b = split_range(n, tp, r)
    b = min(b, shape[d])
    return box.replace(d, a, b) if a < b else None


def local_tensors(specs: list[TensorSpec], boxes: dict[str, Box], *, megatron: bool) -> dict[str, LocalTensor]:
    """Group this rank's boxes into its local tensors (fused ones stacked in order)."""
    groups: dict[str, list[TensorSpec]] = {}
    for s in specs:
        if s.name in boxes:
            groups.setdefault(s.megatron_name if megatron else s.engine_name, []).append(s)
    out = {}
    for local, members in groups.items():
        members.sort(key=lambda s: s.fused[1] if s.fused else 0)
        segs: list[tuple[str, Box]] = []
        if megatron and members[0].fused and members[0].fused[0] == "qkv" and len(members) == 3:
            q, k, v = members
            head_dim = k.shape[0] // k.num_groups
            per_group = q.num_heads // q.num_groups
            g0, g1 = boxes[k.name].ranges[0][0] // head_dim, boxes[k.name].ranges[0][1] // head_dim
            for g in range(g0, g1):  # Megatron interleaves [q heads of g; k_g; v_g]
                qb = boxes[q.name].replace(0, g * per_group * head_dim, (g + 1) * per_group * head_dim)
                segs += [
                    (q.name, qb),
                    (k.name, boxes[k.name].replace(0, g * head_dim, (g + 1) * head_dim)),
                    (v.name, boxes[v.name].replace(0, g * head_dim, (g + 1) * head_dim)),
                ]
        else:
            segs = [(s.name, boxes[s.name]) for s in members]
        row, placed = 0, []
        for name, box in segs:
            placed.append(Segment(name, box, row))
            row += box.shape[0]
        trailing = {box.shape[1:] for _, box in segs}
        if len(trailing) != 1:
            raise ValueError(f"{local}: fused parts differ beyond dim 0: {sorted(trailing)}")
        out[local] = LocalTensor(local, members[0].dtype, (row, *trailing.pop()), tuple(placed))
    return out


def whole_layout(specs: Sequence[TensorSpec], rank: int = 0) -> Layout:
    """One rank holding every HF tensor of ``specs`` whole under its own name: the
    export hook's destination (engines that load checkpoint-format tensors)."""
    tensors = {s.name: LocalTensor(s.name, s.dtype, s.shape, (Segment(s.name, Box.full(s.shape), 0),)) for s in specs}
    return Layout((rank,), {rank: tensors}, {s.name: s for s in specs}, "whole HF tensors")
