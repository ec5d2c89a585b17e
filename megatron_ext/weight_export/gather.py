"""Assemble full HF tensors of one bucket from the TP shards of its stage.

One ``all_gather_into_tensor`` per bucket in the stage's TP group: each TP rank
packs its shards of the bucket's parameters into its slot of a flat byte buffer,
and the TP leader writes every shard straight into the HF tensors' views of the
export buffer (no per-parameter collectives, no full-tensor temporaries).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .hf_mapping import Source, copy_all, shard_copies
from .plan import BucketMeta, unpack

__all__ = ["BucketGatherer"]


class BucketGatherer:
    """Gathers buckets of this stage; holds one scratch buffer of ``tp x shard bytes``."""

    def __init__(self, params: dict[str, torch.Tensor], *, tp_group=None, tp_rank: int = 0, tp_size: int = 1,
                 device: torch.device | str = "cpu"):
        self.params = params
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        self.device = torch.device(device)
        self._scratch: torch.Tensor | None = None

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else self._scratch.numel()

    def _shard_layout(self, sources: list[Source]) -> tuple[list[int], int]:
        offsets, used = [], 0
        for s in sources:
            offsets.append(used)
            used += (s.shard_nbytes + 255) // 256 * 256
        return offsets, used

    def gather(self, bucket: BucketMeta, sources: list[Source], out: torch.Tensor | None) -> None:
        """Fill ``out`` (the TP leader's export buffer; None elsewhere) with ``bucket``."""
        views = dict(unpack(bucket, out)) if out is not None else {}
        if self.tp_size == 1:
            copy_all([pair for s in sources for pair in shard_copies(
                s, self.params[s.local_name].detach(), 0, 1, [views[n] for n, _ in s.outputs])])
            return
        offsets, chunk = self._shard_layout(sources)
        need = chunk * self.tp_size
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = None
            self._scratch = torch.empty(need, dtype=torch.uint8, device=self.device)
        slots = self._scratch[:need].view(self.tp_size, chunk)
        mine = slots[self.tp_rank]
        copy_all([(mine[off:off + s.shard_nbytes].view(s.dtype).view(s.shard_shape),
                   self.params[s.local_name].detach()) for s, off in zip(sources, offsets)])
        dist.all_gather_into_tensor(self._scratch[:need], mine, group=self.tp_group)
        if out is None:
            return
        pairs = []
        for s, off in zip(sources, offsets):
            dests = [views[n] for n, _ in s.outputs]
            for r in range(self.tp_size if s.partition_dim is not None else 1):
                shard = slots[r, off:off + s.shard_nbytes].view(s.dtype).view(s.shard_shape)
                pairs += shard_copies(s, shard, r, self.tp_size, dests)
        copy_all(pairs)
