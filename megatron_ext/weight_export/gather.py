"""Assemble full HF tensors of one bucket from the shards and experts of its stage.

One ``all_gather_into_tensor`` per bucket, in the bucket's group: the stage's
TP group for dense buckets (each rank contributes its TP shards), its
expert group for expert buckets (each rank contributes its own copies of the
bucket's local expert weights, i.e. different global experts): the EP group,
or with expert TP > 1 Megatron's expert-tensor-and-model-parallel group, each
rank contributing its expert-TP shards of its experts. Every rank packs its
part into an equal slot of a flat byte buffer, and the stage leader (TP rank 0,
EP rank 0, expert-TP rank 0) writes every slot straight into the HF tensors'
views of the export buffer with the dense TP shard logic (no per-parameter
collectives, no full-tensor temporaries).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .hf_mapping import Source, copy_all, shard_copies
from .plan import ALIGNMENT, BucketMeta, unpack

__all__ = ["BucketGatherer"]


class BucketGatherer:
    """Gathers buckets of this stage; holds one scratch buffer of ``group size x slot bytes``.

    ``expert_group``: the group gathering expert buckets; ``expert_rank`` this
    rank's rank in it; ``expert_coords[r]`` the ``(ep_rank, etp_rank)`` of its
    rank ``r`` (default: one rank, whole experts; None with ``etp_size`` > 1 on a rank
    that gathers no expert bucket).
    """

    def __init__(self, params: dict[str, torch.Tensor], *, tp_group=None, tp_rank: int = 0, tp_size: int = 1,
                 expert_group=None, expert_rank: int = 0, expert_coords: list[tuple[int, int]] | None = None,
                 etp_size: int = 1, device: torch.device | str = "cpu"):
        self.params = params
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        self.expert_group, self.expert_rank = expert_group, expert_rank
        if expert_coords is None and etp_size == 1:
            expert_coords = [(0, 0)]
        self.expert_coords = None if expert_coords is None else [tuple(c) for c in expert_coords]
        self.etp_size = etp_size
        if self.expert_coords is not None and sorted(self.expert_coords) != [
                (e, t) for e in range(len(self.expert_coords) // etp_size) for t in range(etp_size)]:
            raise ValueError(f"expert_coords {self.expert_coords} do not cover EP x expert-TP "
                             f"ranks 0.. x 0..{etp_size - 1} once each")
        self.device = torch.device(device)
        self._scratch: torch.Tensor | None = None

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else self._scratch.numel()

    def _shard_layout(self, sources: list[Source]) -> tuple[list[int], int]:
        offsets, used = [], 0
        for s in sources:
            offsets.append(used)
            used += (s.shard_nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        return offsets, used

    def gather(self, bucket: BucketMeta, sources: list[Source], out: torch.Tensor | None,
               dests: dict[str, torch.Tensor] | None = None) -> None:
        """Fill ``out`` (the stage leader's export buffer; None elsewhere) with
        ``bucket``, or, on the leader, write it straight into ``dests`` (HF name ->
        tensor, e.g. the engine's own weights)."""
        leader = out is not None or dests is not None
        if dests is not None:
            views = dests  # written in place
        else:
            views = dict(unpack(bucket, out)) if out is not None else {}
        if bucket.group == "ep":
            if self.expert_coords is None:
                raise RuntimeError(f"bucket {bucket.index} holds experts, but this rank's expert group layout "
                                   "is unknown (it is not in expert-DP rank 0)")
            group, rank, size = self.expert_group, self.expert_rank, len(self.expert_coords)
            # Group rank r holds expert-TP shard coords[r][1] of EP rank coords[r][0]'s experts.
            per_rank = [[s for s in sources if s.ep_rank == ep] for ep, _ in self.expert_coords]
            shard_ranks = [(etp, self.etp_size) for _, etp in self.expert_coords]
        else:
            group, rank, size = self.tp_group, self.tp_rank, self.tp_size
            per_rank = [sources] * size  # every TP rank holds a shard of every source
            shard_ranks = [(r, self.tp_size) for r in range(size)]
        if size == 1:
            copy_all([pair for s in sources for pair in shard_copies(
                s, self.params[s.local_name].detach(), 0, 1, [views[n] for n, _ in s.outputs])])
            return
        offsets, chunk = self._shard_layout(per_rank[rank])
        need = chunk * size
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = None
            self._scratch = torch.empty(need, dtype=torch.uint8, device=self.device)
        slots = self._scratch[:need].view(size, chunk)
        mine = slots[rank]
        copy_all([(mine[off:off + s.shard_nbytes].view(s.dtype).view(s.shard_shape),
                   self.params[s.local_name].detach()) for s, off in zip(per_rank[rank], offsets)])
        dist.all_gather_into_tensor(self._scratch[:need], mine, group=group)
        if not leader:
            return
        pairs = []
        for r in range(size):
            for s, off in zip(per_rank[r], offsets):
                if bucket.group == "tp" and r > 0 and s.partition_dim is None:
                    continue  # replicated over TP: rank 0's copy is the tensor
                shard = slots[r, off:off + s.shard_nbytes].view(s.dtype).view(s.shard_shape)
                pairs += shard_copies(s, shard, *shard_ranks[r], [views[n] for n, _ in s.outputs])
        copy_all(pairs)
