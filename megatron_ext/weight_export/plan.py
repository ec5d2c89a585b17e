"""The export plan: where every HF tensor lives in which bucket.

Computed once per model layout and sent to receivers once; afterwards only
bucket bytes travel. A bucket is one flat byte buffer; each tensor sits at an
aligned offset in it. A bucket holds tensors of one pipeline stage and one
gathering group, so it is gathered with one collective: dense tensors in the
stage's TP group (``group="tp"``), experts in its expert-parallel group
(``group="ep"``; every EP rank's copy of the same local expert weights, so each
rank contributes an equal slot). With expert tensor parallelism (ETP > 1) the
expert group is Megatron's expert-tensor-and-model-parallel group (ETP x EP
ranks of expert-DP rank 0), each rank contributing its expert-TP shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping

import torch

from .errors import PlanMismatch
from .control import ControlError, dtype_name, dtype_of
from .hf_mapping import Source

__all__ = ["ALIGNMENT", "BucketMeta", "ExportPlan", "PlanMismatch", "TensorMeta", "build_plan", "check_plan",
           "unpack"]

ALIGNMENT = 256  # bytes; keeps every view aligned for vectorised copies and NCCL


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """One HF tensor in a bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class SourceOwner:
    """Which trainer ranks hold the slices of one Megatron parameter."""

    mcore_name: str
    pp_rank: int
    partition_dim: int | None
    shard_shape: tuple[int, ...]
    hf_names: tuple[str, ...]
    expert: int | None = None   # global expert index (experts only)
    ep_rank: int | None = None  # the expert-parallel rank holding it (experts only)
    etp_size: int = 1           # expert-TP shards (experts only; 1: whole on ``ep_rank``)

    @property
    def holders(self) -> tuple[tuple[int, int], ...]:
        """Experts: ``(ep_rank, etp_rank)`` of the rank holding each slice, in shard
        order; slice ``k`` is expert-TP shard ``k`` along ``partition_dim`` (GLU
        ``linear_fc1``: rows ``k`` of gate and of up). Empty for dense sources."""
        if self.ep_rank is None:
            return ()
        return tuple((self.ep_rank, k) for k in range(self.etp_size))


@dataclasses.dataclass(frozen=True)
class BucketMeta:
    """One flat buffer's worth of tensors, all from pipeline stage ``pp_rank``,
    gathered in its ``group`` (``"tp"``: dense, ``"ep"``: experts)."""

    index: int
    pp_rank: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]
    owners: tuple[SourceOwner, ...]
    group: str = "tp"


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """Every exported tensor's name, dtype, shape and place; sent to receivers once."""

    buckets: tuple[BucketMeta, ...]
    buffer_bytes: int  # capacity of each of the two export buffers
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    etp_size: int = 1

    def tensors(self) -> Iterator[TensorMeta]:
        for b in self.buckets:
            yield from b.tensors

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def to_wire(self) -> dict:
        """What a receiver needs of the plan, as plain data (names, dtypes, shapes, offsets;
        the trainer-side owners stay home). :meth:`from_wire` rebuilds it."""
        return {"buffer_bytes": self.buffer_bytes, "tp_size": self.tp_size, "pp_size": self.pp_size,
                "ep_size": self.ep_size, "etp_size": self.etp_size,
                "buckets": [{"index": b.index, "pp_rank": b.pp_rank, "nbytes": b.nbytes, "group": b.group,
                             "tensors": [[t.name, dtype_name(t.dtype), list(t.shape), t.offset,
                                          t.nbytes] for t in b.tensors]} for b in self.buckets]}

    @classmethod
    def from_wire(cls, data: dict) -> "ExportPlan":
        """The plan :meth:`to_wire` described; ``PlanMismatch`` for anything malformed or
        inconsistent (a tensor outside its bucket, sizes that disagree with shapes)."""
        try:
            buckets = []
            for b in data["buckets"]:
                tensors = []
                for name, dtype, shape, offset, nbytes in b["tensors"]:
                    dt = dtype_of(dtype)
                    numel = 1
                    for s in shape:
                        numel *= int(s)
                    if (not isinstance(name, str) or min(shape, default=0) < 0
                            or nbytes != numel * dt.itemsize or not 0 <= offset <= offset + nbytes <= b["nbytes"]):
                        raise ValueError(f"tensor {name!r}")
                    tensors.append(TensorMeta(name, dt, tuple(int(s) for s in shape), int(offset), int(nbytes)))
                if b["group"] not in ("tp", "ep") or not 0 <= b["nbytes"] <= data["buffer_bytes"]:
                    raise ValueError(f"bucket {b['index']}")
                buckets.append(BucketMeta(int(b["index"]), int(b["pp_rank"]), int(b["nbytes"]), tuple(tensors), (),
                                          b["group"]))
            return cls(tuple(buckets), int(data["buffer_bytes"]), int(data["tp_size"]), int(data["pp_size"]),
                       int(data["ep_size"]), int(data["etp_size"]))
        except (KeyError, TypeError, ValueError, ControlError) as exc:
            raise PlanMismatch(f"the trainer sent a malformed export plan ({exc})") from None

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for b in self.buckets:
            for t in b.tensors:
                h.update(f"{b.index}:{b.group}:{t.name}:{t.dtype}:{t.shape}:{t.offset};".encode())
        return h.hexdigest()[:16]


def build_plan(sources: list[Source], bucket_bytes: int, *, tp_size: int = 1, pp_size: int = 1,
               ep_size: int = 1, etp_size: int = 1) -> tuple[ExportPlan, list[list[Source]]]:
    """Pack ``sources`` (in order, all stages) into buckets of at most ``bucket_bytes``.

    A parameter's HF tensors stay in one bucket, and so do the ``ep_size``
    consecutive copies of one local expert weight (one per EP rank). A new
    bucket starts at a new stage or gathering group. A unit larger than
    ``bucket_bytes`` gets a bucket of its own, and the buffers grow to fit it
    (``plan.buffer_bytes``). Returns the plan and each bucket's sources.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[BucketMeta] = []
    bucket_sources: list[list[Source]] = []
    tensors: list[TensorMeta] = []
    owners: list[SourceOwner] = []
    members: list[Source] = []
    used = 0
    key = None

    def close():
        nonlocal tensors, owners, members, used
        if tensors:
            buckets.append(BucketMeta(len(buckets), key[0], used, tuple(tensors), tuple(owners), key[1]))
            bucket_sources.append(members)
        tensors, owners, members, used = [], [], [], 0

    for unit in _units(sources, ep_size):
        sizes = [[_align(s.dtype.itemsize * _numel(shape)) for _, shape in s.outputs] for s in unit]
        need = sum(map(sum, sizes))
        unit_key = (unit[0].pp_rank, unit[0].group)
        if tensors and (unit_key != key or used + need > bucket_bytes):
            close()
        key = unit_key
        for src, src_sizes in zip(unit, sizes):
            for (name, shape), size in zip(src.outputs, src_sizes):
                tensors.append(TensorMeta(name, src.dtype, tuple(shape), used,
                                          src.dtype.itemsize * _numel(shape)))
                used += size
            owners.append(SourceOwner(src.mcore_name, src.pp_rank, src.partition_dim, src.shard_shape,
                                      tuple(n for n, _ in src.outputs), src.expert, src.ep_rank,
                                      src.etp_size))
            members.append(src)
    close()
    names = [t.name for b in buckets for t in b.tensors]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"tensors exported twice: {sorted(dup)}")
    capacity = _block_size(max((b.nbytes for b in buckets), default=ALIGNMENT))
    return ExportPlan(tuple(buckets), capacity, tp_size, pp_size, ep_size, etp_size), bucket_sources


def _block_size(nbytes: int) -> int:
    """``nbytes`` rounded up to what PyTorch's CUDA caching allocator hands out for
    it: large requests get whole 2 MiB pages, so a buffer of exactly that size
    costs what it says (no hidden tail) and the tail is usable capacity."""
    page = 2 << 20
    return nbytes if nbytes <= (1 << 20) else (nbytes + page - 1) // page * page


def _units(sources: list[Source], ep_size: int) -> list[list[Source]]:
    """Sources that share a bucket: each dense one alone; each local expert weight
    with its copies on all ``ep_size`` EP ranks (equal gather slots per rank)."""
    units: list[list[Source]] = []
    for s in sources:
        if s.ep_rank is None:
            units.append([s])
        elif s.ep_rank == 0:
            units.append([s])
        else:
            last = units[-1][-1] if units else None
            if (last is None or last.ep_rank != s.ep_rank - 1 or last.local_name != s.local_name
                    or last.pp_rank != s.pp_rank or last.shard_shape != s.shard_shape or last.dtype != s.dtype):
                raise ValueError(f"{s.mcore_name}: expert sources must list EP ranks 0..{ep_size - 1} of one "
                                 "local weight in a row (as local_sources does)")
            units[-1].append(s)
    for unit in units:
        if unit[0].ep_rank is not None and len(unit) != ep_size:
            raise ValueError(f"{unit[0].mcore_name}: {len(unit)} EP copies, expected ep_size={ep_size}")
    return units


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def unpack(bucket: BucketMeta, buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view)`` of every tensor of ``bucket`` in the flat uint8 ``buf`` (no copies)."""
    for t in bucket.tensors:
        yield t.name, buf[t.offset:t.offset + t.nbytes].view(t.dtype).view(t.shape)


def check_plan(plan: ExportPlan, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
               *, allow_missing: bool = False) -> None:
    """Raise :class:`PlanMismatch` naming the first tensor of ``plan`` that
    ``expected`` (receiver name -> (shape, dtype)) does not know, or whose shape
    or dtype differs; and, unless ``allow_missing``, a receiver tensor the plan
    does not cover."""
    seen = set()
    for t in plan.tensors():
        if t.name not in expected:
            raise PlanMismatch(f"plan tensor {t.name!r} is unknown to the receiver's model "
                               f"(receiver has e.g. {sorted(expected)[:3]}); check the model family/config")
        shape, dtype = expected[t.name]
        if tuple(shape) != tuple(t.shape):
            raise PlanMismatch(f"plan tensor {t.name!r} has shape {tuple(t.shape)}, the receiver's "
                               f"has {tuple(shape)}; build the receiver from the same model config")
        if dtype != t.dtype:
            raise PlanMismatch(f"plan tensor {t.name!r} has dtype {t.dtype}, the receiver's has {dtype}; "
                               "export in the receiver's dtype or load the receiver in the trainer's")
        seen.add(t.name)
    if not allow_missing:
        missing = sorted(set(expected) - seen)
        if missing:
            raise PlanMismatch(f"receiver tensor {missing[0]!r} is not in the plan ({len(missing)} missing); "
                               "tied embeddings or a different config?")
