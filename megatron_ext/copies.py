"""Many tensor copies in few kernel launches, and a fused NaN/Inf check (no communication).

NTP's fold/unfold and both refit paths move a model as many small views (a TP
shard's rows of each query group, one expert's rows, ...); :class:`CopyBatch` issues them as one
multi-tensor copy per dtype and :func:`finite_flags` checks them with one fused
reduction per dtype, so the host cost does not grow with the number of views.
"""

from __future__ import annotations

import torch

__all__ = ["CopyBatch", "FINITE_CHECKED_DTYPES", "copy_all", "finite_flags"]


class CopyBatch:
    """Many ``(dst, src)`` copies issued as few kernel launches, sorted once.

    ``torch._foreach_copy_`` launches one multi-tensor kernel only for a list of
    floating tensors that all share a dtype and whose pairs are dense with equal
    strides; one odd pair sends the whole list to a per-tensor loop (one launch
    and ~15 us of host time per pair). So the pairs are grouped: one foreach call
    per floating dtype for the dense pairs, plain ``copy_`` for the rest (strided
    views, integer tensors). Build once and :meth:`run` many times when the views
    are fixed (reshard buffers); :func:`copy_all` does both for one-off lists."""

    def __init__(self, pairs):
        groups: dict[torch.dtype, tuple[list, list]] = {}
        self.single: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:
            if (
                dst.dtype == src.dtype
                and dst.is_floating_point()
                and dst.device == src.device
                and dst.is_contiguous()
                and src.is_contiguous()
                and dst.shape == src.shape
            ):
                d, s = groups.setdefault(dst.dtype, ([], []))
                d.append(dst)
                s.append(src)
            else:
                self.single.append((dst, src))
        self.groups = list(groups.values())

    def __len__(self) -> int:
        return sum(len(d) for d, _ in self.groups) + len(self.single)

    def run(self) -> None:
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs)
        for dst, src in self.single:
            dst.copy_(src)


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run many copies as few kernel launches (:class:`CopyBatch`)."""
    if pairs:
        CopyBatch(pairs).run()


FINITE_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def finite_flags(tensors: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Whether each tensor is all finite, batched: per checked dtype (fp32, bf16, fp16, fp64),
    the indices of ``tensors`` of that dtype and their flags (a bool tensor on the device),
    from one fused max-abs reduction (a NaN or Inf survives a max). No host sync; tensors of
    other dtypes and empty ones are not checked."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.dtype in FINITE_CHECKED_DTYPES and t.numel():
            groups.setdefault(t.dtype, []).append(i)
    return [
        (idx, torch.stack(torch._foreach_norm([tensors[i] for i in idx], float("inf"))).isfinite())
        for idx in groups.values()
    ]
