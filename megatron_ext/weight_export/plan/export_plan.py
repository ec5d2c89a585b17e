"""The export plan: which HF tensor goes in which bucket, and from where.

Computed once per model layout and sent to receivers once (names, dtypes,
shapes, offsets); afterwards only bucket bytes travel. A bucket is one flat
byte buffer; each whole HF tensor sits at an aligned offset in it. A bucket
holds tensors of one pipeline stage and one gathering group, so it is gathered
with one collective: dense tensors in the stage's TP group (``group="tp"``),
experts in its expert group (``group="ep"``: the EP group, or with expert
tensor parallelism Megatron's expert-tensor-and-model-parallel group). Where
each piece comes from is the reshard planner's answer for the full-tensor
destination (:func:`~megatron_ext.sharding.whole_layout`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from ...sharding.fp8 import FP8_DTYPE, is_quantized, scale_name, scale_shape
from ...sharding.geometry import whole_layout
from ...sharding.megatron import megatron_layout
from ...sharding.spec import TensorSpec
from .errors import ControlError, PlanMismatch
from .reshard_plan import Transfer, build_reshard_plan, sub_layout
from .wire import ALIGN, align, dtype_name, dtype_of

__all__ = [
    "BucketMeta",
    "ExportPlan",
    "PlanMismatch",
    "TensorMeta",
    "build_plan",
    "check_plan",
    "members",
    "stage_ranks",
    "unpack",
]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """One HF tensor in a bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """This tensor in the flat uint8 bucket buffer ``buf`` (a view, no copy)."""
        return buf[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclasses.dataclass(frozen=True)
class BucketMeta:
    """One flat buffer's worth of tensors, all from pipeline stage ``pp_rank``,
    gathered in its ``group`` (``"tp"``: dense, ``"ep"``: experts). Trainer side
    only (not sent): ``transfers``, which trainer rank holds which box of each
    tensor, and where in its local tensor; ``staged``, with FP8, the quantized
    weights in the model's dtype, at their offsets in the gathering leader's
    staging buffer (gathered there, then quantized into the bucket)."""

    index: int
    pp_rank: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]
    group: str = "tp"
    transfers: tuple[Transfer, ...] = ()
    staged: tuple[TensorMeta, ...] = ()

    @property
    def staged_bytes(self) -> int:
        return max((t.offset + t.nbytes for t in self.staged), default=0)


_SIZES = ("tp_size", "pp_size", "ep_size", "etp_size")  # the trainer layout an ExportPlan was cut for


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
    def staging_bytes(self) -> int:
        """The FP8 staging buffer a gathering leader needs (0 without FP8; trainer side only)."""
        return max((b.staged_bytes for b in self.buckets), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def to_wire(self) -> dict:
        """What a receiver needs of the plan, as plain data (names, dtypes, shapes, offsets;
        the trainer-side transfers stay home). :meth:`from_wire` rebuilds it."""
        return {
            "buffer_bytes": self.buffer_bytes,
            **{f: getattr(self, f) for f in _SIZES},
            "buckets": [
                {
                    "index": b.index,
                    "pp_rank": b.pp_rank,
                    "nbytes": b.nbytes,
                    "group": b.group,
                    "tensors": [[t.name, dtype_name(t.dtype), list(t.shape), t.offset, t.nbytes] for t in b.tensors],
                }
                for b in self.buckets
            ],
        }

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
                    if (
                        not isinstance(name, str)
                        or min(shape, default=0) < 0
                        or nbytes != math.prod(int(s) for s in shape) * dt.itemsize
                        or not 0 <= offset <= offset + nbytes <= b["nbytes"]
                    ):
                        raise ValueError(f"tensor {name!r}")
                    tensors.append(TensorMeta(name, dt, tuple(int(s) for s in shape), int(offset), int(nbytes)))
                if b["group"] not in ("tp", "ep") or not 0 <= b["nbytes"] <= data["buffer_bytes"]:
                    raise ValueError(f"bucket {b['index']}")
                buckets.append(
                    BucketMeta(int(b["index"]), int(b["pp_rank"]), int(b["nbytes"]), tuple(tensors), b["group"])
                )
            return cls(tuple(buckets), int(data["buffer_bytes"]), *(int(data[f]) for f in _SIZES))
        except (KeyError, TypeError, ValueError, ControlError) as exc:
            raise PlanMismatch(f"the trainer sent a malformed export plan ({exc})") from None

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for b in self.buckets:
            for t in b.tensors:
                h.update(f"{b.index}:{b.group}:{t.name}:{t.dtype}:{t.shape}:{t.offset};".encode())
        return h.hexdigest()[:16]


GROUPS = ("tp", "ep")  # a bucket's gathering group, indexed by "holds experts"


def stage_ranks(tp: int, ep: int = 1, etp: int = 1) -> int:
    """Ranks per stage of the trainer layout the export plans with: just enough data-parallel
    ranks to hold DP replica 0 (which gathers dense tensors) and expert-DP rank 0 (which
    gathers experts); the job's own DP size does not matter (NTP replicas may even differ in TP)."""
    return math.lcm(tp, ep * etp)


def members(
    group: str, stage: int, *, tp: int, ep: int = 1, etp: int = 1, coords: Sequence[tuple[int, int]] | None = None
) -> list[int]:
    """The trainer-layout ranks that gather ``group``'s buckets of ``stage``, in group-rank
    order: the TP ranks of DP replica 0 (``"tp"``), or the ranks of expert-DP rank 0 with
    ``(ep_rank, etp_rank)`` ``coords`` (``"ep"``; default EP-major, Megatron's order)."""
    base = stage * stage_ranks(tp, ep, etp)
    if group == "tp":
        return [base + r for r in range(tp)]
    coords = coords or [(e, t) for e in range(ep) for t in range(etp)]
    return [base + e * etp + t for e, t in coords]


def build_plan(
    specs: Sequence[TensorSpec],
    bucket_bytes: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    layer_stage: Sequence[int] | None = None,
    quantize: str = "none",
) -> ExportPlan:
    """Every HF tensor of ``specs``, whole, in buckets of at most ``bucket_bytes``.

    The tensors' pieces are the reshard planner's transfers from the trainer's
    Megatron layout (TP x PP, EP and expert TP; ``layer_stage`` gives each
    layer's stage, default an even split) to
    :func:`~megatron_ext.sharding.whole_layout`: one description of where each
    box lives, fused QKV and ``[gate; up]`` included, sourced only from the
    ranks that gather (:func:`members`). A bucket holds tensors of one stage and
    one group, so it is gathered with one collective; expert tensors are ordered
    so that consecutive ones belong to different EP ranks (equal gather slots).
    A tensor larger than ``bucket_bytes`` gets a bucket of its own and the
    buffers grow to fit it (``plan.buffer_bytes``).

    ``quantize="fp8-block"``: the decoder-layer linear weights
    (:func:`~megatron_ext.sharding.fp8.is_quantized`) travel as ``float8_e4m3fn``
    plus a float32 ``weight_scale_inv`` per 128 x 128 block of the whole tensor,
    next to each other in one bucket (the layout of FP8 checkpoints); they are
    gathered in the model's dtype into a staging buffer (:attr:`BucketMeta.staged`)
    and quantized from there. A bucket then also keeps its staged bytes within
    ``bucket_bytes``, so the staging buffer plus the two (smaller) export buffers
    take no more memory than the two export buffers of the unquantized plan.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    per_stage = stage_ranks(tp, ep, etp)
    trainer = megatron_layout(list(specs), tp=tp, pp=pp, dp=per_stage // tp, ep=ep, etp=etp, layer_stage=layer_stage)
    num_experts = 1 + max((s.expert for s in specs if s.expert is not None), default=-1)
    per_rank = max(num_experts // ep, 1)
    experts = sorted(
        (s for s in specs if s.expert is not None),
        key=lambda s: (s.layer, s.expert % per_rank, s.fused[1] if s.fused else 2, s.expert // per_rank),
    )
    pieces: dict[str, list[Transfer]] = {}
    for group, tensors in (("tp", [s for s in specs if s.expert is None]), ("ep", experts)):
        if tensors:
            ranks = [m for stage in range(pp) for m in members(group, stage, tp=tp, ep=ep, etp=etp)]
            for t in build_reshard_plan(sub_layout(trainer, ranks), whole_layout(tensors)).transfers:
                pieces.setdefault(t.name, []).append(t)
    units = sorted(
        (ts[0].src // per_stage, trainer.specs[name].expert is not None, i, name, ts)
        for i, (name, ts) in enumerate(pieces.items())
    )
    if quantize not in ("none", "fp8-block"):
        raise ValueError(f"quantize must be 'none' or 'fp8-block', got {quantize!r}")
    buckets: list[BucketMeta] = []
    tensors: list[TensorMeta] = []
    transfers: list[Transfer] = []
    staged: list[TensorMeta] = []
    used = staging = 0
    key = None

    def close():
        b = BucketMeta(len(buckets), key[0], used, tuple(tensors), GROUPS[key[1]], tuple(transfers), tuple(staged))
        buckets.append(b)

    for stage, expert, _, name, ts in units:
        spec = trainer.specs[name]
        fp8 = quantize == "fp8-block" and is_quantized(spec)
        wire = _wire_tensors(spec) if fp8 else [(name, spec.dtype, spec.shape)]
        wire_bytes = sum(align(math.prod(shape) * dt.itemsize) for _, dt, shape in wire)
        stage_bytes = align(spec.nbytes) if fp8 else 0
        if tensors and (
            (stage, expert) != key or used + wire_bytes > bucket_bytes or staging + stage_bytes > bucket_bytes
        ):
            close()
            tensors, transfers, staged, used, staging = [], [], [], 0, 0
        key = (stage, expert)
        for wname, dt, shape in wire:
            nbytes = math.prod(shape) * dt.itemsize
            tensors.append(TensorMeta(wname, dt, shape, used, nbytes))
            used += align(nbytes)
        if stage_bytes:
            staged.append(TensorMeta(name, spec.dtype, spec.shape, staging, spec.nbytes))
            staging += stage_bytes
        transfers += ts
    if tensors:
        close()
    capacity = _block_size(max((b.nbytes for b in buckets), default=ALIGN))
    return ExportPlan(tuple(buckets), capacity, tp, pp, ep, etp)


def _wire_tensors(spec: TensorSpec) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """A quantized weight as it travels: its FP8 values, then its block scales."""
    return [(spec.name, FP8_DTYPE, spec.shape), (scale_name(spec.name), torch.float32, scale_shape(spec.shape))]


def _block_size(nbytes: int) -> int:
    """``nbytes`` rounded up to what PyTorch's CUDA caching allocator hands out for
    it: large requests get whole 2 MiB pages, so a buffer of exactly that size
    costs what it says (no hidden tail) and the tail is usable capacity."""
    page = 2 << 20
    return nbytes if nbytes <= (1 << 20) else (nbytes + page - 1) // page * page


def unpack(bucket: BucketMeta, buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view)`` of every tensor of ``bucket`` in the flat uint8 ``buf`` (no copies)."""
    for t in bucket.tensors:
        yield t.name, t.view(buf)


def check_plan(
    plan: ExportPlan, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *, allow_missing: bool = False
) -> None:
    """Raise :class:`PlanMismatch` naming the first tensor of ``plan`` that
    ``expected`` (receiver name -> (shape, dtype)) does not know, or whose shape
    or dtype differs; and, unless ``allow_missing``, a receiver tensor the plan
    does not cover."""
    seen = set()
    for t in plan.tensors():
        if t.name not in expected:
            raise PlanMismatch(
                f"plan tensor {t.name!r} is unknown to the receiver's model "
                f"(receiver has e.g. {sorted(expected)[:3]}); check the model family/config"
            )
        shape, dtype = expected[t.name]
        if tuple(shape) != tuple(t.shape):
            raise PlanMismatch(
                f"plan tensor {t.name!r} has shape {tuple(t.shape)}, the receiver's "
                f"has {tuple(shape)}; build the receiver from the same model config"
            )
        if dtype != t.dtype:
            raise PlanMismatch(
                f"plan tensor {t.name!r} has dtype {t.dtype}, the receiver's has {dtype}; "
                "export in the receiver's dtype or load the receiver in the trainer's"
            )
        seen.add(t.name)
    if not allow_missing:
        missing = sorted(set(expected) - seen)
        if missing:
            raise PlanMismatch(
                f"receiver tensor {missing[0]!r} is not in the plan ({len(missing)} missing); "
                "tied embeddings or a different config?"
            )
