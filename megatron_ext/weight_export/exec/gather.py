"""Assemble the whole HF tensors of one bucket from the trainer ranks that hold their pieces.

One ``all_gather_into_tensor`` per bucket, in the bucket's group: the stage's
TP group for dense buckets, its expert group for expert buckets (the EP group,
or with expert TP Megatron's expert-tensor-and-model-parallel group). Each
member packs the pieces the plan sources from it (:attr:`BucketMeta.transfers`:
a box of an HF tensor and where it sits in the member's local tensor) into an
equal slot of a flat byte buffer; the stage leader writes every piece straight
into its box of the HF tensors (the export buffer's views, or the engine's own
tensors), so fused QKV per query group, ``[gate; up]`` halves, padded
vocabulary rows and replicated tensors need no code of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...copies import CopyBatch
from ..plan.export_plan import BucketMeta
from ..plan.reshard_plan import Transfer, run_view
from ..plan.wire import align

__all__ = ["BucketGatherer", "GatherGroup"]


@dataclasses.dataclass(frozen=True)
class GatherGroup:
    """A process group that gathers buckets: ``members[k]`` is the trainer-layout
    rank of its group rank ``k``, ``rank`` this process's group rank."""

    group: object
    rank: int
    members: tuple[int, ...]


class BucketGatherer:
    """Gathers this stage's buckets; holds one scratch buffer of ``group size x slot bytes``.

    ``tensors``: this rank's local tensors under the trainer layout's names
    (global layer indices); ``groups``: ``"tp"`` / ``"ep"`` -> :class:`GatherGroup`.
    """

    def __init__(
        self, tensors: dict[str, torch.Tensor], groups: dict[str, GatherGroup], *, device: torch.device | str = "cpu"
    ):
        self.tensors = tensors
        self.groups = groups
        self.device = torch.device(device)
        self._scratch: torch.Tensor | None = None
        self._slots: dict[int, tuple[int, list[list[tuple[Transfer, int]]]]] = {}
        self._batches: dict[tuple[str, int], tuple[tuple, CopyBatch]] = {}

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else self._scratch.numel()

    def _packing(self, bucket: BucketMeta, members: Sequence[int]) -> tuple[int, list[list[tuple[Transfer, int]]]]:
        """Slot bytes and, per member, ``(transfer, offset in its slot)`` (computed once per bucket)."""
        if bucket.index not in self._slots:
            slot = {m: k for k, m in enumerate(members)}
            packed: list[list[tuple[Transfer, int]]] = [[] for _ in members]
            used = [0] * len(members)
            for t in bucket.transfers:
                k = slot[t.src]
                packed[k].append((t, used[k]))
                used[k] = align(used[k] + t.nbytes)
            self._slots[bucket.index] = (max(used, default=0), packed)
        return self._slots[bucket.index]

    def _source(self, t: Transfer) -> torch.Tensor:
        return run_view(self.tensors[t.src_run.local], t.src_run)

    def _copies(self, key: tuple, targets, build, check: bool = False) -> CopyBatch:
        """The copies ``build()`` lists, built once per ``key`` and the objects they view (the
        ``dests`` mapping, the scratch buffer): exports repeat them, and building ~10^3 views
        per bucket on the host costs more than the copies themselves. ``check``: the copies also
        flag NaN / Inf (:class:`~...copies.CopyBatch`)."""
        targets = targets if isinstance(targets, tuple) else (targets,)
        key = (*key, check)
        hit = self._batches.get(key)
        if hit is None or len(hit[0]) != len(targets) or any(a is not b for a, b in zip(hit[0], targets)):
            hit = self._batches[key] = (targets, CopyBatch(build(), check=check))
        return hit[1]

    def placed(self, bucket: BucketMeta) -> list[str]:
        """The HF name of each copy :meth:`gather` places, in the order of its flags."""
        _, packed = self._packing(bucket, self.groups[bucket.group].members)
        if len(self.groups[bucket.group].members) == 1:
            return [t.name for t in bucket.transfers]
        return [t.name for member in packed for t, _ in member]

    def gather(self, bucket: BucketMeta, dests: dict[str, torch.Tensor] | None, *, check: bool = False):
        """Gather ``bucket`` and, on the stage leader (``dests`` not None: HF name ->
        whole tensor, e.g. views of its export buffer or the engine's weights), write
        every piece into its box. Pass the same ``dests`` object again to reuse its copies.
        ``check``: the copies that place the pieces also look for NaN / Inf, and the leader gets
        their flags (an int32 device tensor, nonzero where a piece is not finite, in
        :meth:`placed` order); otherwise, and on other ranks, None."""
        g = self.groups[bucket.group]
        chunk, packed = self._packing(bucket, g.members)
        if len(g.members) == 1:
            if dests is None:
                return None
            return self._copies(
                ("place", bucket.index),
                dests,
                lambda: [(dests[t.name][t.box.slices], self._source(t).view(t.box.shape)) for t in bucket.transfers],
                check,
            ).run()
        need = chunk * len(g.members)
        if self._scratch is None or self._scratch.numel() < need:
            old, self._scratch = self._scratch, None
            self._batches = {k: v for k, v in self._batches.items() if not any(t is old for t in v[0])}
            del old
            self._scratch = torch.empty(need, dtype=torch.uint8, device=self.device)
        scratch = self._scratch
        slots = scratch[:need].view(len(g.members), chunk)
        mine = slots[g.rank]
        self._copies(
            ("pack", bucket.index),
            scratch,
            lambda: [
                (
                    mine[off : off + t.nbytes].view(self.tensors[t.src_run.local].dtype).view(t.src_run.count, -1),
                    self._source(t),
                )
                for t, off in packed[g.rank]
            ],
        ).run()
        dist.all_gather_into_tensor(scratch[:need], mine, group=g.group)
        if dests is None:
            return None
        return self._copies(
            ("place", bucket.index),
            (dests, scratch),
            lambda: [
                (
                    dests[t.name][t.box.slices],
                    slots[k, off : off + t.nbytes].view(dests[t.name].dtype).view(t.box.shape),
                )
                for k, member in enumerate(packed)
                for t, off in member
            ],
            check,
        ).run()
