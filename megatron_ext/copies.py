"""Many tensor copies in few kernel launches, and a fused NaN/Inf check (no communication).

NTP's fold/unfold and both refit paths move a model as many small views (a TP
shard's rows of each query group, one expert's rows, ...); :class:`CopyBatch` issues them as one
multi-tensor copy per dtype and :func:`finite_flags` checks them with one fused
reduction per dtype, so the host cost does not grow with the number of views; a
tensor of :data:`LARGE` elements or more gets a kernel of its own, which moves more bytes per second.
"""

from __future__ import annotations

import torch

from . import copy_check
from .copy_check import Span

__all__ = [
    "CopyBatch",
    "FINITE_CHECKED_DTYPES",
    "FiniteCheck",
    "FlagsByName",
    "LARGE",
    "Span",
    "copy_all",
    "finite_flags",
]

# Tensors of at least this many elements get a kernel of their own: PyTorch's multi-tensor kernels
# cut every tensor into 64K-element chunks and move less per second than one copy_ / reduction per
# large tensor (1xH100, a 3.6B Llama's 171 bf16 tensors, 7.2 GB: copies 6.5 vs 5.2 ms, max-abs
# 4.2 vs 3.5 ms); one more launch costs nothing next to a 2 MB move.
LARGE = 1 << 20


def _kernel_runs(dst, src, device: torch.device):
    """A floating pair's runs for :mod:`~megatron_ext.copy_check`'s kernel (:func:`~.copy_check.runs`; for two
    :class:`~.copy_check.Span` s, :func:`~.copy_check.span_row`), or None where the kernel cannot take it (not on
    ``device``'s GPU, no Triton, runs too short)."""
    d, s = copy_check.tensor_of(dst), copy_check.tensor_of(src)
    if d.is_cuda and s.device == d.device == device and copy_check.available():
        return copy_check.span_row(dst, src) if type(dst) is Span else copy_check.runs(dst, src)
    return None


class CopyBatch:
    """Many ``(dst, src)`` copies issued as few kernel launches, sorted once.

    ``torch._foreach_copy_`` launches one multi-tensor kernel only for a list of
    floating tensors that all share a dtype and whose pairs are dense with equal
    strides; one odd pair sends the whole list to a per-tensor loop (one launch
    and ~15 us of host time per pair). So the pairs are grouped: one foreach call
    per floating dtype for the dense pairs, plain ``copy_`` for the rest (strided
    views, integer tensors). Build once and :meth:`run` many times when the views
    are fixed (reshard buffers); :func:`copy_all` does both for one-off lists. Tensors of
    :data:`LARGE` elements or more get a ``copy_`` of their own (faster than the foreach chunks).

    ``check=True``: :meth:`run` also returns a NaN/Inf flag per pair. On CUDA the floating pairs that cut into
    long contiguous runs are copied by :mod:`~megatron_ext.copy_check`'s kernel, which checks as it copies
    (no second read); the rest are checked by a max-abs reduction over their destinations after the copy.
    ``also_flag``: per pair, an int32 word (or None) raised with that pair's flag, e.g. the header of the
    bucket the pair packs into.

    ``kernel=True`` (``check=False``): the floating pairs that the kernel can cut are copied by it all the same,
    their flags unused, as one or two launches per dtype. Strided views (a TP shard's columns of a weight)
    otherwise take a ``copy_`` each (4xH100, 3.6B colocated TP4 -> TP1xDP4, whose unpacks and atomic apply
    write such views: streaming 31.9 -> 25.7 ms, atomic 32.7 -> 28.2 ms).

    A pair may be two :class:`~megatron_ext.copy_check.Span` s instead of two views (a refit's staging: its pieces
    as integers over its weights and buffers): the kernel's row comes from them
    (:func:`~megatron_ext.copy_check.span_row`), and their views are made only where another copy takes them."""

    def __init__(self, pairs, *, check: bool = False, also_flag=None, kernel: bool = False, _flags=None):
        pairs = list(pairs)
        self.check = check
        self.size = len(pairs)
        self.device = copy_check.tensor_of(pairs[0][0]).device if pairs else torch.device("cpu")
        # check=True: one int32 flag per pair (nonzero: NaN / Inf), reused by every run (kernel=True: the
        # kernel's, never read); _flags: this batch's part of one zeroed buffer of several (many)
        n = self.size if check or kernel else 0
        self.bad = torch.zeros(n, dtype=torch.int32, device=self.device) if _flags is None else _flags(n, self.device)
        also_flag = list(also_flag) if also_flag is not None else [None] * self.size
        fusable: dict[torch.dtype, list] = {}
        groups: dict[torch.dtype, tuple[list, list]] = {}
        self.single: list[tuple[torch.Tensor, torch.Tensor]] = []
        checked: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        for i, (dst, src) in enumerate(pairs):
            if type(dst) is Span:  # (a pair of spans) the kernel's row from their integers, else their views
                dtype = dst.tensor.dtype
                if (check or kernel) and dtype in FINITE_CHECKED_DTYPES and dst.numel > 0:
                    row = _kernel_runs(dst, src, self.device)
                    if row is not None:
                        fusable.setdefault(dtype, []).append((i, also_flag[i], dst, src, row))
                        continue
                dst, src = copy_check.span_views(dst, src)
            floating = dst.dtype in FINITE_CHECKED_DTYPES and dst.numel() > 0  # what the kernel copies
            is_checked = check and floating
            pieces = _kernel_runs(dst, src, self.device) if (check or kernel) and floating else None
            if pieces is not None:
                fusable.setdefault(dst.dtype, []).append((i, also_flag[i], dst, src, pieces))
                continue
            if is_checked:  # checked after the copy, by a reduction over the destination
                idx, views = checked.setdefault(dst.dtype, ([], []))
                idx.append(i)
                views.append(dst)
            if (
                dst.dtype == src.dtype
                and dst.is_floating_point()
                and dst.device == src.device
                and dst.is_contiguous()
                and src.is_contiguous()
                and dst.shape == src.shape
                and dst.numel() < LARGE
            ):
                d, s = groups.setdefault(dst.dtype, ([], []))
                d.append(dst)
                s.append(src)
            else:
                self.single.append((dst, src))
        self.groups = list(groups.values())
        self.fused = [
            copy_check.FusedCopyCheck(self.bad, p, check=check, build=_flags is None) for p in fusable.values()
        ]
        self.checked = [
            (torch.tensor(idx, dtype=torch.int64, device=self.device), views) for idx, views in checked.values()
        ]
        # the second words the reduction's flags are raised into (the kernel raises the fused pairs' own)
        reduced = {i for idx, _ in checked.values() for i in idx}
        self.also = copy_check.shared_words(
            [word if i in reduced else None for i, word in enumerate(also_flag)], self.device
        )

    @classmethod
    def many(cls, batches) -> list[CopyBatch]:
        """One :class:`CopyBatch` per ``(pairs, options)`` of ``batches`` (options: ``check``, ``also_flag``,
        ``kernel``), built together: their flags are parts of one buffer per device and the kernel's tables
        one pass (:func:`~megatron_ext.copy_check.build_tables`), so building many batches costs the host
        about what one batch of all their pairs does (a refit's rounds)."""
        batches = [(list(pairs), options) for pairs, options in batches]
        sizes: dict[torch.device, int] = {}
        for pairs, options in batches:
            if pairs and (options.get("check") or options.get("kernel")):
                device = copy_check.tensor_of(pairs[0][0]).device
                sizes[device] = sizes.get(device, 0) + len(pairs)
        buffers = {device: torch.zeros(n, dtype=torch.int32, device=device) for device, n in sizes.items()}
        taken = dict.fromkeys(buffers, 0)

        def flags(n: int, device: torch.device) -> torch.Tensor:
            if not n:
                return torch.zeros(0, dtype=torch.int32, device=device)
            start = taken[device]
            taken[device] = start + n
            return buffers[device][start : start + n]

        out = [cls(pairs, **options, _flags=flags) for pairs, options in batches]
        copy_check.build_tables([fused for batch in out for fused in batch.fused])
        return out

    def __len__(self) -> int:
        return self.size

    def run(self) -> torch.Tensor | None:
        """Run the copies. With ``check=True``, returns :attr:`bad`, int32 on the first destination's
        device, one flag per pair in the order given: nonzero where the pair's values hold a NaN or Inf
        (pairs of other dtypes read 0); the next run overwrites it. ``also_flag[i]`` (an int32 word, e.g.
        in the header of the bucket pair ``i`` packs into) is raised to 1 with pair ``i``'s flag and
        otherwise left as it is. No host sync."""
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, srcs)
        for dst, src in self.single:
            dst.copy_(src)
        if not self.check:
            for fused in self.fused:  # kernel=True: copies only, its flags never read
                fused.run()
            return None
        self.bad.zero_()
        for fused in self.fused:
            fused.run()
        for idx, views in self.checked:
            for _, finite in finite_flags(views):
                self.bad.index_put_((idx,), (~finite).to(device=self.bad.device, dtype=torch.int32))
        copy_check.raise_words(self.also, self.bad)
        return self.bad


class FiniteCheck:
    """NaN/Inf flags of many tensors that no copy reads (a zero-copy sender's sources, an atomic rank's local
    copies' sources before its apply), sorted once and run many times.

    On CUDA with Triton, the tensors :mod:`~megatron_ext.copy_check`'s kernel can cut into runs are read by its
    check-only variant (``FusedCopyCheck(store=False)``, one or two launches per dtype); the rest, and every
    tensor elsewhere, by one multi-tensor max-abs reduction per dtype (a reduction per large tensor would cost a
    launch each). Either way the host issues a few operations however many tensors there are."""

    def __init__(self, tensors):
        tensors = list(tensors)
        self.size = len(tensors)
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.bad = torch.zeros(self.size, dtype=torch.int32, device=self.device)  # reused by every run
        fusable: dict[torch.dtype, list] = {}
        reduced: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        for i, t in enumerate(tensors):
            if t.dtype not in FINITE_CHECKED_DTYPES or not t.numel():
                continue
            pieces = _kernel_runs(t, t, self.device)
            if pieces is not None:
                fusable.setdefault(t.dtype, []).append((i, None, t, t, pieces))
                continue
            idx, views = reduced.setdefault(t.dtype, ([], []))
            idx.append(i)
            views.append(t)
        self.fused = [copy_check.FusedCopyCheck(self.bad, p, store=False) for p in fusable.values()]
        self.reduced = [
            (torch.tensor(idx, dtype=torch.int64, device=self.device), views) for idx, views in reduced.values()
        ]

    def __len__(self) -> int:
        return self.size

    def run(self) -> torch.Tensor:
        """Returns :attr:`bad`: int32 on the first tensor's device, one flag per tensor in the order given,
        nonzero where it holds a NaN or Inf (tensors of other dtypes and empty ones read 0); the next run
        overwrites it. No host sync."""
        self.bad.zero_()
        for fused in self.fused:
            fused.run()
        for idx, views in self.reduced:
            for _, finite in finite_flags(views, large=None):  # (one dtype: one group)
                self.bad.index_put_((idx,), (~finite).to(device=self.bad.device, dtype=torch.int32))
        return self.bad


class FlagsByName:
    """NaN/Inf flags of named pieces (a checked :class:`CopyBatch`'s, or :func:`finite_flags`' inverted),
    kept on the device and read once: :meth:`bad` names each tensor with a non-finite piece."""

    def __init__(self):
        self.names: list[str] = []
        self.flags: list[torch.Tensor] = []  # nonzero: not finite

    def add(self, names: list[str], bad: torch.Tensor) -> None:
        """One flag per name; copied, since a batch reuses its flags at its next run."""
        self.names += names
        self.flags.append(bad.clone())

    def bad(self) -> list[str]:
        """The names with a NaN or Inf, each once (one device-to-host read)."""
        if not self.flags:
            return []
        bad = torch.cat([f.to(self.flags[0].device) for f in self.flags]).tolist()
        return list(dict.fromkeys(n for n, b in zip(self.names, bad) if b))


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run many copies as few kernel launches (:class:`CopyBatch`)."""
    if pairs:
        CopyBatch(pairs).run()


FINITE_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def finite_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The indices of ``tensors`` that :func:`finite_flags` checks, in the order of its groups (one per
    checked dtype): the flags of its groups, concatenated, are in this order."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.dtype in FINITE_CHECKED_DTYPES and t.numel():
            groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def finite_flags(tensors: list[torch.Tensor], large: int | None = LARGE) -> list[tuple[list[int], torch.Tensor]]:
    """Whether each tensor is all finite, batched: per checked dtype (fp32, bf16, fp16, fp64),
    the indices of ``tensors`` of that dtype and their flags (a bool tensor on the device),
    from one fused max-abs reduction (a NaN or Inf survives a max). No host sync; tensors of
    other dtypes and empty ones are not checked. Tensors of ``large`` (:data:`LARGE`) elements or more
    get a reduction of their own, the rest one multi-tensor reduction per dtype; ``large=None``: every
    tensor in the one multi-tensor reduction (one launch, where hundreds of launches would keep the host
    busy: the zero-copy refit's check)."""
    out = []
    for idx in finite_groups(tensors):
        small = [i for i in idx if large is None or tensors[i].numel() < large]
        norms = dict(zip(small, torch._foreach_norm([tensors[i] for i in small], float("inf")) if small else ()))
        for i in idx:
            if i not in norms:
                norms[i] = torch.linalg.vector_norm(tensors[i], float("inf"))
        out.append((idx, torch.stack([norms[i] for i in idx]).isfinite()))
    return out
