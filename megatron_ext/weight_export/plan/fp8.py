"""FP8 refit: quantize the trainer's weights into the block-scaled layout FP8 checkpoints use.

The layout side (which tensors, where the scales live) is
:func:`megatron_ext.sharding.fp8_layout`; this module holds the arithmetic and the
trainer's FP8 copies:

- :func:`quantize_blocks` / :func:`dequantize_blocks` (each one Triton kernel on CUDA, PyTorch ops elsewhere,
  with the same bits): ``float8_e4m3fn`` values and one float32 ``weight_scale_inv`` per ``block x block``
  block (``scale_inv = amax / 448``, dequantized = fp8 x ``scale_inv``). A NaN or Inf in a block makes its
  scale non-finite, so the refit's finite check (on the float32 scales) still refuses the version.
- :class:`Fp8Sources`: a trainer rank's FP8 copy of its quantized local tensors (its
  other tensors as they are), requantized by :meth:`~Fp8Sources.refresh` before each
  refit (pass it as the executor's ``refresh``). It holds 1 byte per weight element
  plus the scales: half the memory of the bf16 weights it mirrors.
- :func:`dequantized`: ``(HF name, tensor)`` pairs with FP8 weights and their scales
  turned back into the model's dtype, for engines that load plain checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from ...sharding.fp8 import FP8_BLOCK, FP8_DTYPE, scale_name, scale_shape
from ...sharding.geometry import Layout

__all__ = ["FP8_MAX", "Fp8Sources", "dequantize_blocks", "dequantized", "quantize_blocks"]

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448 for e4m3fn
_TINY = float(torch.finfo(torch.float32).tiny)  # the scale of an all-zero block (its values stay 0)


def _padded(x: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = x.shape
    pr, pc = -rows % block, -cols % block
    return F.pad(x, (0, pc, 0, pr)) if pr or pc else x


@torch.no_grad()
def quantize_blocks(
    x: torch.Tensor, block: int = FP8_BLOCK, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values, float32 scale_inv per block)`` of a 2-D tensor; a partial last block is scaled by its
    own elements. ``out``: tensors of those shapes and dtypes to write into. On CUDA one Triton kernel
    reads each block once (:func:`_quantize_triton`); elsewhere, or without Triton, PyTorch ops do the
    same arithmetic (:func:`_quantize_torch`)."""
    if x.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(x.shape)}")
    kernel = _triton_kernel() if _on_triton(x, block) else None
    if kernel is not None:
        return _quantize_triton(kernel, x, block, out)
    return _quantize_torch(x, block, out)


def _quantize_torch(x, block, out):
    rows, cols = x.shape
    xp = _padded(x, block)
    shape = (xp.shape[0] // block, block, xp.shape[1] // block, block)
    blocks = xp.view(shape)
    # max |x| per block from the block's max and min, read in x's own dtype (exact; no |x| temporary);
    # a NaN or Inf stays in the scale
    amax = torch.maximum(blocks.amax(dim=(1, 3)).float(), blocks.amin(dim=(1, 3)).float().neg())
    scale = (amax / FP8_MAX).clamp(min=_TINY)
    if out is not None and out[0].shape == xp.shape:
        q = out[0]
    else:
        q = torch.empty(xp.shape, dtype=FP8_DTYPE, device=x.device)
    # x / scale computed in float32 and rounded once to e4m3 as it is stored (one kernel, no float32
    # tensor); |x / scale| <= 448 up to the division's rounding, which the conversion saturates to 448
    torch.div(blocks, scale[:, None, :, None], out=q.view(shape))
    return _into(out, q[:rows, :cols], scale)


def _into(out, q: torch.Tensor, scale: torch.Tensor):
    """``(q, scale)``, or ``out`` with them copied in where they are not already ``out``'s own tensors."""
    if out is None:
        return q, scale
    for dst, src in zip(out, (q, scale)):
        if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
            dst.copy_(src)
    return out


def _on_triton(x: torch.Tensor, block: int) -> bool:
    """Whether the Triton kernels take ``x``: a contiguous CUDA tensor, ``block`` a power of two (a tile size)."""
    return x.is_cuda and x.is_contiguous() and block > 0 and block & (block - 1) == 0


_KERNELS: list = []  # {"quantize": ..., "dequantize": ...}, or None when Triton is not usable (looked up once)


def _kernels() -> dict | None:
    if not _KERNELS:
        _KERNELS.append(_compile())
    return _KERNELS[0]


def _triton_kernel():
    """The quantize kernel (None without Triton)."""
    kernels = _kernels()
    return None if kernels is None else kernels["quantize"]


def _dequantize_kernel():
    """The dequantize kernel (None without Triton)."""
    kernels = _kernels()
    return None if kernels is None else kernels["dequantize"]


def _compile() -> dict | None:
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def quantize(x_ptr, q_ptr, s_ptr, rows, cols, n_col_blocks, BLOCK: tl.constexpr, FMAX: tl.constexpr):
        # one program per block: max |x| (a NaN anywhere makes the scale NaN), then x / scale, rounded to
        # nearest (div_rn, as PyTorch divides) and stored as e4m3 (the conversion saturates at 448);
        # 64-bit offsets (a weight may hold 2^31 elements or more)
        br, bc = tl.program_id(0), tl.program_id(1)
        r = (br * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)[:, None]
        c = (bc * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)[None, :]
        mask = (r < rows) & (c < cols)
        x = tl.load(x_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        nans = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)
        scale = tl.maximum(amax / FMAX, 1.1754943508222875e-38)
        scale = tl.where(nans > 0, float("nan"), scale)
        tl.store(q_ptr + r * cols + c, tl.math.div_rn(x, scale).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + br * n_col_blocks + bc, scale)

    @triton.jit
    def dequantize(
        q_ptr, s_ptr, o_ptr, rows, cols, n_col_blocks, o_row, o_col, BLOCK: tl.constexpr, TILE: tl.constexpr
    ):
        # one program per TILE rows of one block column (TILE divides BLOCK, so the tile has one scale):
        # each e4m3 value read once, exactly widened to float32, times the block's float32 scale (one
        # correctly rounded product), rounded once to the output's dtype (to nearest even) and written once;
        # the output may be strided (a view of an engine's weight); 64-bit offsets
        tr, bc = tl.program_id(0), tl.program_id(1)
        r = (tr * TILE + tl.arange(0, TILE)).to(tl.int64)[:, None]
        c = (bc * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)[None, :]
        mask = (r < rows) & (c < cols)
        scale = tl.load(s_ptr + (tr * TILE // BLOCK) * n_col_blocks + bc)
        x = tl.load(q_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
        y = (x * scale).to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(o_ptr + r * o_row + c * o_col, y, mask=mask)

    return {"quantize": quantize, "dequantize": dequantize}


def _quantize_triton(kernel, x, block, out):
    rows, cols = x.shape
    grid = scale_shape(x.shape, block)
    q, scale = out if out is not None else (None, None)
    if q is None or not q.is_contiguous():
        q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if scale is None or not scale.is_contiguous():
        scale = torch.empty(grid, dtype=torch.float32, device=x.device)
    kernel[grid](x, q, scale, rows, cols, grid[1], BLOCK=block, FMAX=FP8_MAX)
    return _into(out, q, scale)


_DEQUANTIZE_TILE = 32  # rows per dequantize program (a power of two; capped at the block)
_TRITON_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.no_grad()
def dequantize_blocks(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block: int = FP8_BLOCK,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight that the 2-D ``q`` and its block scales (shape :func:`scale_shape` of ``q``'s) stand for, in
    ``dtype``: each value in float32 times its block's float32 scale, rounded once to ``dtype``. ``out``: a
    tensor of ``q``'s shape in ``dtype`` to write into (any strides, e.g. a view of an engine's weight) instead
    of a new one; it is returned. On CUDA (``q`` contiguous, ``dtype`` bf16, fp16 or fp32) one Triton kernel
    reads each value once and writes each result once (:func:`_dequantize_triton`); elsewhere PyTorch ops
    through a float32 copy (:func:`_dequantize_torch`) give the same bits."""
    if q.dim() != 2:
        raise ValueError(f"block FP8 dequantizes 2-D weights, got shape {tuple(q.shape)}")
    want = scale_shape(q.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)}; a {tuple(q.shape)} weight in {block}x{block} blocks "
            f"has {want}: pass the weight's own weight_scale_inv"
        )
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != dtype):
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype}; it must be the weight's shape {tuple(q.shape)} in dtype {dtype}"
        )
    same_device = scale_inv.device == q.device and (out is None or out.device == q.device)
    if _on_triton(q, block) and same_device and dtype in _TRITON_OUT_DTYPES:
        kernel = _dequantize_kernel()
        if kernel is not None:
            return _dequantize_triton(kernel, q, scale_inv, dtype, block, out)
    return _dequantize_torch(q, scale_inv, dtype, block, out)


def _dequantize_torch(q, scale_inv, dtype, block, out):
    rows, cols = q.shape
    x = _padded(q.float(), block)  # one float32 copy (padded only for a partial last block)
    shape = (x.shape[0] // block, block, x.shape[1] // block, block)
    x.view(shape).mul_(scale_inv.float()[:, None, :, None])  # each block times its scale, broadcast
    if out is None:
        return x[:rows, :cols].to(dtype).contiguous()
    return out.copy_(x[:rows, :cols])  # the same one rounding to dtype as .to(dtype)


def _dequantize_triton(kernel, q, scale_inv, dtype, block, out):
    rows, cols = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.numel() == 0:
        return out
    tile = min(_DEQUANTIZE_TILE, block)
    grid = (-(-rows // tile), -(-cols // block))
    scale = scale_inv.to(torch.float32).contiguous()  # no copy for a checkpoint's float32 scales
    kernel[grid](q, scale, out, rows, cols, scale.shape[1], out.stride(0), out.stride(1), BLOCK=block, TILE=tile)
    return out


class Fp8Sources:
    """A trainer rank's tensors for an FP8 source layout (:func:`~megatron_ext.sharding.fp8_layout`).

    ``tensors``: the rank's own local tensors (e.g. :func:`~megatron_ext.sharding.megatron_tensors`);
    ``layout``: the FP8 layout; :attr:`tensors` is what the executor sends (FP8 copies and scales for the
    quantized tensors, the others as given). Build the executor with ``refresh=sources.refresh``.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], layout: Layout, rank: int, *, block: int = FP8_BLOCK):
        self.block = block
        self.tensors: dict[str, torch.Tensor] = {}
        self._jobs: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        mine = layout.tensors.get(rank, {})
        for name, lt in mine.items():
            if name in self.tensors:
                continue
            if lt.dtype != FP8_DTYPE:
                if name in tensors:
                    self.tensors[name] = tensors[name]
                continue
            src = tensors.get(name)
            if src is None or tuple(src.shape) != lt.shape:
                continue  # the executor reports the missing or misshapen tensor at the first refit
            q = torch.empty(lt.shape, dtype=FP8_DTYPE, device=src.device)
            s = torch.empty(mine[scale_name(name)].shape, dtype=torch.float32, device=src.device)
            self.tensors[name], self.tensors[scale_name(name)] = q, s
            self._jobs.append((name, src, q, s))
        self.refresh()

    @property
    def nbytes(self) -> int:
        """Memory of the FP8 copies and their scales."""
        return sum(q.numel() + s.numel() * 4 for _, _, q, s in self._jobs)

    def refresh(self) -> None:
        """Quantize the current weights (one local tensor at a time: its float32 scratch is the only extra)."""
        for _, src, q, s in self._jobs:
            quantize_blocks(src, self.block, out=(q, s))


def dequantized(
    pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16, block: int = FP8_BLOCK
) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs`` (e.g. ``Layout.hf_tensors`` of an FP8 engine layout) with every FP8 weight dequantized
    with its ``weight_scale_inv`` (the scales themselves are not yielded); other tensors pass through."""
    pairs = dict(pairs)
    for name, t in pairs.items():
        if t.dtype == FP8_DTYPE:
            yield name, dequantize_blocks(t, pairs[scale_name(name)], dtype, block)
        elif not (name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in pairs):
            yield name, t
