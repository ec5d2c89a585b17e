"""A copy that checks for NaN/Inf as it goes: one Triton kernel per dtype reads each source
element once, writes it, and raises the flag of its pair when the element is not finite.

The refit's copies already read every byte of a version (the pack into a bucket, the place into
the engine's weights, the engine's copy out of the trainer's storage); a separate NaN/Inf check
reads them all again, which on one GPU costs half a copy more. :class:`FusedCopyCheck` is what
:class:`~megatron_ext.copies.CopyBatch` runs with ``check=True`` on a CUDA device when Triton
imports: the pairs' views are cut into blocks of equally spaced contiguous runs (a strided view's rows: a
column slice of a weight is one block), and the blocks into programs of at most :data:`CHUNK` elements
each (several short runs, or a chunk of a long one), listed once in a device table (source and
destination addresses, runs, run length, the two steps between runs, the address of the pair's flag and
of a second word to raise with it); each program of the kernel moves its runs. A NaN or
Inf ``x`` is caught by ``x - x != 0`` (NaN for both, 0 for every finite value). Pairs it cannot cut
into runs of at least :data:`MIN_RUN` elements (narrow column slices, overlapping strides) are left to
the caller.

The kernel compiles (Triton, about a second with a cold cache) and is launched once on no runs (which
loads it) in a background thread, which also runs the process's first multi-tensor copy and reduction of
each dtype on tiny tensors (the first one costs the host milliseconds): :func:`prewarm` starts it early (the
refit's executors and the export hook call it when they are built), and until a specialization is compiled
a :class:`FusedCopyCheck` runs the same copies checked by a second read, so the first refit of a process
does not wait for the compiler.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "CHECK_ONLY_CHUNK",
    "CHUNK",
    "MIN_RUN",
    "FusedCopyCheck",
    "Span",
    "available",
    "build_tables",
    "prewarm",
    "raise_words",
    "runs",
    "shared_words",
    "span_row",
    "span_views",
    "tensor_of",
]

# Elements one program moves at most: 7.2 GB of bf16 is about 27k programs, about 200 per SM, so the
# last wave is short; long enough that the table (64 bytes a program) is 1/4096 of the data and that
# building it takes the host little (numpy over every program's row: 2.6 ms for 2.4G elements on a CPU
# core, 10 ms at 1 << 15, whose refits took the same time: 2 of 4xH200, 2026-11-27).
CHUNK = 1 << 17
# Elements one check-only program (store=False) reads at most: a zero-copy sender keeps every chunk's table,
# so programs 4x longer keep a fourth of the memory (the whole 3.6B model: 425 KiB, not 1.7 MiB) at the same
# speed: 1.70 against 1.72 ms for 3.6 GB, 0.19 against 0.19 ms for 512 MiB (4.2 and 3.6 TB/s; 1 << 20 and
# longer lose up to 2x on chunks of 512 MiB and less: too few programs; H200, 2026-11-28).
CHECK_ONLY_CHUNK = 1 << 19
BLOCK = 2048  # elements per loop step of one program
MIN_RUN = 256  # shorter contiguous runs go to the caller's copy_ (one launch per pair)
MAX_RUNS = 1 << 16  # more blocks of runs than this in one pair: also the caller's
RUNS_PER_PROGRAM = 32  # short runs of one block: a program takes this many at most (runs are moved one by one)
ALIGN = 16  # bytes; runs whose two addresses are multiples get vector loads and stores


def available() -> bool:
    """Whether Triton imports (its CUDA backend compiles the kernel at the first call) and the kernel has not
    failed in this process (then new copies take the caller's second read from the start)."""
    return _UNUSABLE is None and _imports()


@functools.cache
def _imports() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def runs(dst: torch.Tensor, src: torch.Tensor) -> np.ndarray | None:
    """The pair's runs as blocks of equally spaced contiguous runs (a strided view's rows), one int64 row per
    block: ``(source element offset, destination element offset, runs, run length, source run stride, destination
    run stride)`` from the two views' storage offsets and strides (a ``(blocks, 6)`` numpy array; a view with one
    strided dimension, e.g. a column slice of a weight, is one block whatever its number of rows), or None when its
    runs would be shorter than :data:`MIN_RUN` elements or its blocks more than :data:`MAX_RUNS` (then a plain
    ``copy_`` is better). numpy, not torch: a refit's first copies cut about a thousand pairs, and a torch operation
    costs several times a numpy one's host time at these sizes."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        return None
    n = dst.numel()
    if n == 0:
        return np.empty((0, 6), dtype=np.int64)
    if dst.is_contiguous() and src.is_contiguous():  # one run (most pairs of a refit: what follows finds it too)
        return np.array([[src.storage_offset(), dst.storage_offset(), 1, n, 0, 0]], dtype=np.int64)
    shape = dst.shape
    ds, ss = dst.stride(), src.stride()
    # drop size-1 dims, then merge the innermost dims that are contiguous in both views
    dims = [(size, a, b) for size, a, b in zip(shape, ds, ss) if size != 1]
    inner, k = 1, len(dims)
    while k > 0 and dims[k - 1][1] == inner and dims[k - 1][2] == inner:
        inner *= dims[k - 1][0]
        k -= 1
    if inner < MIN_RUN and inner != n:
        return None
    d0, s0 = dst.storage_offset(), src.storage_offset()
    if k == 0:
        return np.array([[s0, d0, 1, inner, 0, 0]], dtype=np.int64)
    rows, d_step, s_step = dims[k - 1]  # the innermost strided dim: the runs of one block
    outer = dims[: k - 1]  # the blocks, row-major
    if not outer:
        return np.array([[s0, d0, rows, inner, s_step, d_step]], dtype=np.int64)
    if math.prod(size for size, _, _ in outer) > MAX_RUNS:
        return None
    d_off, s_off = np.array([d0], dtype=np.int64), np.array([s0], dtype=np.int64)
    for size, a, b in outer:
        steps = np.arange(size, dtype=np.int64)
        d_off = (d_off[:, None] + steps[None, :] * a).reshape(-1)
        s_off = (s_off[:, None] + steps[None, :] * b).reshape(-1)
    block = np.array([rows, inner, s_step, d_step], dtype=np.int64)
    return np.concatenate([s_off[:, None], d_off[:, None], np.broadcast_to(block, (s_off.shape[0], 4))], axis=1)


class Span(NamedTuple):
    """Elements ``offset + i * stride + [0, length)`` for ``i < count`` of contiguous ``tensor`` (offsets from its
    first element): one side of a copy, without a torch view. A refit's staging names thousands of pieces of its
    weights and buffers; the kernel's rows come from these integers (:func:`span_row`), and a view is made only
    where a copy needs one (:meth:`view`, :func:`span_views`: the fallbacks, short runs, other dtypes)."""

    tensor: torch.Tensor
    offset: int
    count: int
    length: int
    stride: int

    @property
    def numel(self) -> int:
        return self.count * self.length

    def view(self, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """The ``(count, length)`` view (or ``shape``, which a contiguous span takes whole)."""
        t = self.tensor
        rows, cols = shape or (self.count, self.length)
        if self.count > 1 and (rows, cols) != (self.count, self.length):
            raise ValueError(f"a span of {self.count} runs of {self.length} viewed as {rows} x {cols}")
        stride = self.stride if self.count > 1 else cols
        return t.as_strided((rows, cols), (stride, 1), t.storage_offset() + self.offset)


def span_views(dst: Span, src: Span) -> tuple[torch.Tensor, torch.Tensor]:
    """The two spans' views in one shape: the strided side's ``(count, length)`` (a contiguous side, ``count`` 1,
    viewed alike), so that ``copy_`` and the multi-tensor copies take them as they are."""
    shape = (dst.count, dst.length) if dst.count > 1 else (src.count, src.length)
    return dst.view(shape), src.view(shape)


def span_row(dst: Span, src: Span) -> tuple[int, int, int, int, int, int] | None:
    """The pair's one block of runs, as :func:`runs` gives it for :func:`span_views` (source and destination
    offsets from their storages' starts, runs, run length, the two steps), from the spans' integers; None where
    :func:`runs` gives None (runs shorter than :data:`MIN_RUN`) or the two sides are not one box's runs."""
    n = dst.numel
    if n != src.numel or dst.tensor.dtype != src.tensor.dtype:
        return None
    s0, d0 = src.tensor.storage_offset() + src.offset, dst.tensor.storage_offset() + dst.offset
    strided = dst if dst.count > 1 else src
    rows, cols = strided.count, strided.length
    s_step = src.stride if src.count > 1 else cols
    d_step = dst.stride if dst.count > 1 else cols
    if rows == 1 or (s_step == cols and d_step == cols):  # one contiguous range on both sides
        return (s0, d0, 1, n, 0, 0)
    if (src.count > 1 and (src.count, src.length) != (rows, cols)) or (
        dst.count > 1 and (dst.count, dst.length) != (rows, cols)
    ):
        return None
    if cols < MIN_RUN:
        return None
    return (s0, d0, rows, cols, s_step, d_step)


def tensor_of(side) -> torch.Tensor:
    """The tensor a copy's side (a tensor or a :class:`Span`) reads or writes in."""
    return side.tensor if type(side) is Span else side


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_check(table, DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr, STORE: tl.constexpr):
        row = table + tl.program_id(0).to(tl.int64) * 8
        src = tl.load(row).to(tl.pointer_type(DTYPE))
        dst = tl.load(row + 1).to(tl.pointer_type(DTYPE))
        count = tl.load(row + 2).to(tl.int32)  # runs, each `n` elements, `src_step` / `dst_step` apart
        n = tl.load(row + 3).to(tl.int32)
        src_step = tl.load(row + 4)
        dst_step = tl.load(row + 5)
        flag = tl.load(row + 6).to(tl.pointer_type(tl.int32))
        also = tl.load(row + 7)
        lanes = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        full = n // BLOCK
        offs = full * BLOCK + lanes
        mask = offs < n
        for r in range(count):
            s = src + r * src_step
            d = dst + r * dst_step
            if ALIGNED:
                s = tl.multiple_of(s, 16)
                d = tl.multiple_of(d, 16)
            for i in range(full):
                x = tl.load(s + i * BLOCK + lanes)
                if STORE:
                    tl.store(d + i * BLOCK + lanes, x)
                acc = acc | ((x - x) != 0).to(tl.int32)
            x = tl.load(s + offs, mask=mask, other=0)
            if STORE:
                tl.store(d + offs, x, mask=mask)
            acc = acc | ((x - x) != 0).to(tl.int32)
        bad = tl.max(acc, 0)
        tl.atomic_max(flag, bad)
        if also != 0:
            tl.atomic_max(also.to(tl.pointer_type(tl.int32)), bad)

    return copy_check


_COMPILED: dict[tuple, threading.Event] = {}  # (device index, dtype, aligned, store) -> set once its compile ended


def _compiling(key: tuple) -> threading.Event:
    """The background compile of one specialization (started here the first time it is asked for)."""
    done = _COMPILED.get(key)
    if done is None:
        done = _COMPILED[key] = threading.Event()
        index, dtype, aligned, store = key

        def compile_() -> None:
            try:
                torch.cuda.set_device(index)  # a new thread starts on device 0; compile for this rank's
                device = torch.device("cuda", index)
                stream = torch.cuda.Stream(device)  # not the legacy default stream, which waits on every other
                with torch.cuda.stream(stream):
                    kernel, dtype_ = _kernel(), _tl_dtype(dtype)
                    table = torch.zeros((1, 8), dtype=torch.int64, device=device)
                    kernel.warmup(
                        table, DTYPE=dtype_, BLOCK=BLOCK, ALIGNED=aligned, STORE=store, num_warps=8, grid=(1,)
                    )
                    # warmup only compiles: the first launch loads the module and builds its launcher. Launch it
                    # here, on no runs, with a flag (and source and destination) of its own that it raises by 0, so
                    # that the refit's first launch does not pay for that
                    word = torch.zeros(1, dtype=torch.int32, device=device)
                    at = word.data_ptr()
                    table.copy_(torch.tensor([[at, at, 0, 0, 0, 0, at, 0]], dtype=torch.int64))
                    kernel[(1,)](table, DTYPE=dtype_, BLOCK=BLOCK, ALIGNED=aligned, STORE=store, num_warps=8)
                stream.synchronize()
            except Exception:  # the first launch raises it again and falls back for the process (run)
                pass
            finally:
                if aligned and store:  # once per device and dtype
                    _warm_torch(index, dtype)
                done.set()

        threading.Thread(target=compile_, name="megatron_ext copy_check compile", daemon=True).start()
    return done


def _warm_torch(index: int, dtype: torch.dtype) -> None:
    """The process's first multi-tensor copy and max-abs reduction of ``dtype`` on device ``index``, on tiny
    tensors, next to the compile: otherwise a refit's first round pays for it (the first ``torch._foreach_copy_`` of
    a process took 13-15 ms of host time on each rank, 3.3 ms of it the launch that loads its module; with this
    warm-up the first refit's 23 multi-tensor copies took 0.6-1.0 ms of host time against 12-17 ms: colocated
    TP2 -> TP1xDP2 on 2xH200 under cProfile, 2026-11-27)."""
    try:
        device = torch.device("cuda", index)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            a, b = torch.zeros(2, dtype=dtype, device=device), torch.zeros(2, dtype=dtype, device=device)
            torch._foreach_copy_([a, b], [b, a])
            torch._foreach_norm([a, b], float("inf"))
        stream.synchronize()
    except Exception:  # a warm-up only: the refit's own copies report their errors
        pass


def prewarm(device: torch.device | str, dtypes, wait: bool = False, check_only: bool = False) -> None:
    """Start compiling the kernel for ``dtypes`` (checked ones: fp32, bf16, fp16) on a CUDA ``device`` in a
    background thread, both alignments, and warm each dtype's multi-tensor copy and reduction; a no-op
    elsewhere, without Triton, or once started. ``wait``: return when those compiles ended (benchmarks and
    tests that time or profile the kernel itself). ``check_only``: also the variant that reads and checks
    without copying (``FusedCopyCheck(store=False)``)."""
    device = torch.device(device)
    if device.type != "cuda" or not available():
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    for dtype in dtypes:
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            for aligned in (True, False):
                for store in (True, False) if check_only else (True,):
                    done = _compiling((index, dtype, aligned, store))
                    if wait:
                        done.wait()


def shared_words(words, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The second words of pairs ``0..n-1`` (int32 words, or None: the pair raises none), each word once with
    the positions of its pairs (an int64 tensor on ``device``): what :func:`raise_words` raises."""
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, word in enumerate(words):
        if word is not None:
            groups.setdefault(word.data_ptr(), (word, []))[1].append(i)
    return [(word, torch.tensor(idx, dtype=torch.int64, device=device)) for word, idx in groups.values()]


def raise_words(words: list[tuple[torch.Tensor, torch.Tensor]], bad: torch.Tensor) -> None:
    """Each word of :func:`shared_words` raised to the max of its pairs' flags in ``bad`` (a word that several
    pairs share, e.g. a bucket's header, once; never lowered)."""
    for word, idx in words:
        torch.maximum(word, bad[idx].amax().to(word.device), out=word)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    names = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return names.get(dtype, tl.float64)


def _upload(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """``table`` on ``device``, queued on the current stream: from pinned memory without waiting (a copy from
    pageable memory waits for the stream's earlier work, so a refit's first rounds, whose copies are built as
    they run, would wait on the transfers in flight: 48 uploads took 20 ms of a colocated first refit's host time
    on 4xH200). The caching host allocator keeps the pinned block until the copy is done."""
    host = torch.from_numpy(table)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def build_tables(checks: list[FusedCopyCheck]) -> None:
    """The device tables of ``checks`` (:class:`FusedCopyCheck` s) in one pass per device: a few numpy operations
    over every block of runs of them all, whatever their number, and one upload (a refit's rounds build theirs
    at once: each pass costs the host tens of numpy calls, and a colocated first refit that built over a hundred
    rounds' one by one spent about 0.5 ms on each on 4xH200); each check launches on its own rows of the table."""
    devices: dict[torch.device, list] = {}
    for check in checks:
        check.launches, check._keys, check._uploaded = [], [], None
        check._where = check._addresses()
        check.built = True
        rows = check._rows()
        if rows is not None:
            devices.setdefault(tensor_of(check.pairs[0][2]).device, []).append((check, rows))
    for device, got in devices.items():
        _build_on(device, got)


def _build_on(device: torch.device, got: list) -> None:
    blocks = np.concatenate([b for _, (b, _, _) in got])
    bases = np.concatenate([base for _, (_, base, _) in got])
    counts = [b.shape[0] for _, (b, _, _) in got]
    size = np.repeat(np.array([s for _, (_, _, s) in got], dtype=np.int64), counts)
    chunk = np.repeat(np.array([c.chunk for c, _ in got], dtype=np.int64), counts)
    owner = np.repeat(np.arange(len(got), dtype=np.int64), counts)
    count, length = blocks[:, 2], blocks[:, 3]
    # a program takes up to `chunk` elements: whole runs of a block (up to RUNS_PER_PROGRAM of them), or one
    # chunk of a longer run
    cuts = -(-length // chunk)
    group = np.where(cuts == 1, np.clip(chunk // np.maximum(length, 1), 1, RUNS_PER_PROGRAM), 1)
    programs = -(-count // group) * cuts
    # each block's first program's row, repeated for its programs, which differ only in where they start and
    # how much they take (columns 0-3): numpy over the blocks, then a few operations over the programs
    first = np.empty((blocks.shape[0], 8), dtype=np.int64)
    first[:, 0] = bases[:, 0] + blocks[:, 0] * size
    first[:, 1] = bases[:, 1] + blocks[:, 1] * size
    first[:, 2] = group
    first[:, 3] = chunk
    first[:, 4:6] = blocks[:, 4:6]
    first[:, 6:8] = bases[:, 2:4]
    rows = np.repeat(first, programs, axis=0)
    q = np.arange(rows.shape[0], dtype=np.int64) - np.repeat(np.cumsum(programs) - programs, programs)
    run, cut = np.divmod(q, np.repeat(cuts, programs))  # the program's first run (in groups) and chunk
    run *= rows[:, 2]
    col = cut * rows[:, 3]
    sz = np.repeat(size, programs)
    rows[:, 0] += (run * rows[:, 4] + col) * sz
    rows[:, 1] += (run * rows[:, 5] + col) * sz
    np.minimum(rows[:, 2], np.repeat(count, programs) - run, out=rows[:, 2])
    np.minimum(rows[:, 3], np.repeat(length, programs) - col, out=rows[:, 3])
    # vector loads and stores where both first addresses are aligned and so are the steps to the next run
    steps = np.repeat((blocks[:, 4] * size % ALIGN == 0) & (blocks[:, 5] * size % ALIGN == 0), programs)
    aligned = ((rows[:, 0] | rows[:, 1]) % ALIGN == 0) & ((rows[:, 2] == 1) | steps)
    # each check's aligned rows, then its others, so that each launch's rows are one slice of the table (rows are
    # in check order already: where every row is aligned, as a refit's usually are, nothing moves)
    part = np.repeat(owner * 2, programs) + (~aligned)
    if not aligned.all():
        order = np.argsort(part, kind="stable")
        rows, part = rows[order], part[order]
    bounds = np.searchsorted(part, np.arange(2 * len(got) + 1))
    table = _upload(rows, device)
    for i, (check, _) in enumerate(got):
        dtype = tensor_of(check.pairs[0][2]).dtype
        for flag, start, end in (
            (True, bounds[2 * i], bounds[2 * i + 1]),
            (False, bounds[2 * i + 1], bounds[2 * i + 2]),
        ):
            if end > start:
                check.launches.append((table[start:end], _tl_dtype(dtype), flag))
        if device.type == "cuda":
            check._keys = [(device.index, dtype, flag, check.store) for _, _, flag in check.launches]
            check._uploaded = torch.cuda.current_stream(device)  # where the tables' uploads are queued


class FusedCopyCheck:
    """The copies of ``pairs`` (``(index, also, dst, src, runs)``: CUDA tensors of one checked dtype cut by
    :func:`runs`, or :class:`Span` s of them cut by :func:`span_row`; ``index`` the pair's word in ``flags``, an
    int32 tensor; ``also`` an int32 word or None) as one
    or two kernel launches: :meth:`run` sets ``flags[index]`` (and ``also``) to 1 when the pair's values hold a
    NaN or Inf, and leaves them as they are otherwise.

    The table of addresses is built once and kept while the storages stay where they are. It holds the
    tensors (so their storages live as long as it does), and before each run it compares each storage's
    address with the table's: a storage that moved (symmetric-memory staging moves a buffer's storage
    into its pool and back, keeping every view valid) rebuilds the table instead of copying from where the
    storage was. ``build=False``: the table is left to the caller's :func:`build_tables`, which builds many
    checks' tables in one pass (or to the first :meth:`run`, alone).

    ``store=False`` (``check`` only): the kernel reads and checks each pair's ``src`` without writing (pass the
    source as ``dst`` too): a check of tensors that no copy reads, in one or two launches however many they are,
    where a multi-tensor max-abs reduction and its flags cost the host a dozen operations. ``chunk``: elements a
    program takes at most (default :data:`CHUNK`, :data:`CHECK_ONLY_CHUNK` with ``store=False``)."""

    def __init__(
        self,
        flags: torch.Tensor,
        pairs,
        *,
        check: bool = True,
        store: bool = True,
        chunk: int | None = None,
        build: bool = True,
    ):
        if not (check or store):
            raise ValueError("FusedCopyCheck(store=False) checks without copying: it needs check=True")
        if chunk is not None and not 0 < chunk < 1 << 31:  # the kernel reads a run's length as int32
            raise ValueError(f"FusedCopyCheck chunk={chunk}: elements per program, 1 .. 2**31 - 1")
        self.flags, self.pairs = flags, pairs
        self.chunk = chunk or (CHUNK if store else CHECK_ONLY_CHUNK)  # elements a program takes at most
        self.store = store  # False: checks only (the fallback reduces over the sources and copies nothing)
        self.check = check  # False: copies only (the kernel's flags are not read; its fallback copies, no reduction)
        self.launches: list[tuple[torch.Tensor, object, bool]] = []
        watch: dict[int, torch.Tensor] = {id(flags): flags}  # every tensor once: its address tells if it moved
        for _, also, dst, src, _ in pairs:
            dst, src = tensor_of(dst), tensor_of(src)
            watch.setdefault(id(dst), dst)
            watch.setdefault(id(src), src)
            if also is not None:
                watch.setdefault(id(also), also)
        self._watch = list(watch.values())
        self._fallback: tuple | None = None  # the fallback's indices and second words, at its first run
        self._views: list | None = None  # the fallback's (dst, src) tensors, at its first run
        self._where: list[int] = []
        self.rebuilds = 0
        self._keys: list[tuple] = []
        self._uploaded = None
        self.built = False  # whether the table was built (build_tables)
        if build:  # (build=False: the caller builds many checks' tables at once, build_tables)
            self._build()

    def _addresses(self) -> list[int]:
        return [t.data_ptr() for t in self._watch]

    def _build(self) -> None:
        build_tables([self])

    def _rows(self) -> tuple[np.ndarray, np.ndarray, int] | None:
        """This check's pairs as blocks of runs (:func:`runs`' rows), each block's pair bases (source and
        destination storages, its flag's and second word's addresses) and the element size (None: no pairs)."""
        if not self.pairs:
            return None
        size = tensor_of(self.pairs[0][2]).element_size()
        flags = self.flags.data_ptr()
        starts: dict[int, int] = {}  # id(tensor) -> where its storage starts (spans of one tensor share it)

        def start(side) -> int:
            t = tensor_of(side)
            got = starts.get(id(t))
            if got is None:
                got = starts[id(t)] = t.data_ptr() - t.storage_offset() * size
            return got

        bases = np.array(  # where each pair's two storages start (runs() gives offsets in them), its flag, its word
            [
                (start(src), start(dst), flags + 4 * index, 0 if also is None else also.data_ptr())
                for index, also, dst, src, _ in self.pairs
            ],
            dtype=np.int64,
        )
        if all(type(p) is tuple for *_, p in self.pairs):  # one block each (span_row): one array of them all
            return np.array([p for *_, p in self.pairs], dtype=np.int64).reshape(-1, 6), bases, size
        pieces = [np.asarray(p, dtype=np.int64).reshape(-1, 6) for *_, p in self.pairs]
        return np.concatenate(pieces), bases.repeat([p.shape[0] for p in pieces], axis=0), size

    def refresh(self) -> bool:
        """Build the table if it was not (``build=False`` and no :func:`build_tables` yet), or rebuild it if a
        storage moved since it was built; whether it did."""
        if not self.built:
            self._build()
            return True
        if self._addresses() == self._where:
            return False
        self.rebuilds += 1
        self._build()
        return True

    def run(self) -> None:
        global _UNUSABLE
        if _UNUSABLE is None:
            self.refresh()
            if not all([_compiling(key).is_set() for key in self._keys]):
                self._copy_then_check()  # compiling in the background: this run checks by a second read
                return
            try:
                kernel = _kernel()
                if self._uploaded is not None:  # the tables were queued on another stream: after them
                    current = torch.cuda.current_stream(self._uploaded.device)
                    if current != self._uploaded:
                        current.wait_stream(self._uploaded)
                    self._uploaded = None
                for table, dtype, aligned in self.launches:
                    kernel[(table.shape[0],)](
                        table, DTYPE=dtype, BLOCK=BLOCK, ALIGNED=aligned, STORE=self.store, num_warps=8
                    )
                return
            except Exception as exc:  # e.g. no C compiler for Triton's launcher: the same copies, checked after
                _UNUSABLE = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"megatron_ext: the fused copy-and-check kernel cannot run here ({_UNUSABLE}); copies are checked "
                    "by a second read instead (correct, slower)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._copy_then_check()

    def _copy_then_check(self) -> None:
        """The same copies and flags without the kernel, in a few multi-tensor launches whatever the number of
        pairs (this runs while the kernel compiles, next to a thread that holds the GIL for much of the
        time): one copy of every pair, one max-abs reduction over the destinations (a second read; a NaN or
        Inf survives a max), each pair's flag raised, then each second word by its pairs' flags. With
        ``check=False`` the copy only."""
        if not self.pairs:
            return
        if self._views is None:  # (spans viewed at the first fallback only)
            self._views = [
                span_views(dst, src) if type(dst) is Span else (dst, src) for _, _, dst, src, _ in self.pairs
            ]
        dsts = [dst for dst, _ in self._views]  # one dtype, none empty (runs() cut them)
        if self.store:
            torch._foreach_copy_(dsts, [src for _, src in self._views])
        if not self.check:
            return
        read = dsts if self.store else [src for _, src in self._views]  # check only: the sources
        bad = (~torch.stack(torch._foreach_norm(read, float("inf"))).isfinite()).to(torch.int32)
        if self._fallback is None:
            index = torch.tensor([i for i, *_ in self.pairs], dtype=torch.int64, device=self.flags.device)
            self._fallback = index, shared_words([also for _, also, _, _, _ in self.pairs], bad.device)
        index, words = self._fallback
        self.flags.index_copy_(0, index, torch.maximum(self.flags.index_select(0, index), bad.to(self.flags.device)))
        raise_words(words, bad)


_UNUSABLE: str | None = None  # why the kernel cannot run in this process (None: it can, or was not tried)
