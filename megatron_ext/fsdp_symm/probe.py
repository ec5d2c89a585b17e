"""Size bands measured on the machine that runs: a short start-up probe, cached.

``SymmMemConfig(bands="probe")`` (``--symm-mem-bands probe``) replaces the
shipped bands (measured on 2x H200 at 2 ranks) by bands timed on the group that
will use them:

- :func:`measure_bands` times plain against symmetric buffers for all-gather
  (bf16), reduce-scatter and all-reduce (bf16 and fp32) over doubling sizes,
  on every rank of the group, and derives the bands with
  :func:`bands_from_timings` from times agreed by all ranks, so every rank gets
  the same bands (staging decisions must match: symmetric allocation is
  collective).
- :func:`load_bands` keeps them in a JSON file keyed by what makes bands differ
  (GPU, its interconnect, ranks, NCCL, torch, NCCL algorithm variables): the
  group's first rank reads it and tells the others; on a miss every rank probes
  and the first rank merges the new entry into the file.
- :func:`resolve_config` is what staging calls: the config with the probed bands
  in every band field the user did not set, once per group of ranks per process.

Timing. A ``torch.distributed`` call costs the host tens of microseconds, more
than a small collective's kernel, so back-to-back calls timed with CUDA events
measure the host. Each timed run therefore queues a GPU sleep first and the
calls behind it: while the GPU sleeps the host queues every call, then the GPU
runs them back to back. A run whose sleep ended before the host had queued
everything, on any rank, is repeated with a longer sleep on every rank (the
ranks agree after each run, so they issue the same collectives: a rank that
repeated a run alone would pair its calls with a peer's next ones, plain with
symmetric buffers, and hang). The per-call time of a run is the
smallest over the ranks (the rank that reached the first call last never waited
for a peer); a point's time is the median of its runs, plain and symmetric runs
interleaved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from . import capability
from .config import BAND_FIELDS, COLLECTIVES, DEFAULT_BANDS_RANKS, SymmMemConfig
from .memory import SymmetricMemory, SymmetricPlacementMismatch, release_storage
from .policy import REPORTER

__all__ = [
    "BandProbeError",
    "MeasuredBands",
    "PROBE_POINTS",
    "PROBE_SIZES",
    "apply_bands",
    "bands_from_timings",
    "cache_key",
    "default_cache_path",
    "describe",
    "load_bands",
    "measure_bands",
    "read_cache",
    "resolve_config",
    "write_entry",
]

logger = logging.getLogger("megatron_ext.fsdp_symm")

_MIB = 1 << 20
# Full-buffer bytes timed by the probe: 256 KiB .. 256 MiB, doubling.
PROBE_SIZES = tuple((_MIB // 4) << i for i in range(11))
# (collective, dtype) pairs timed; all-gather moves bytes whatever the dtype, so
# its float32 band is its bf16 band.
PROBE_POINTS = (
    ("all_gather", "bf16"),
    ("reduce_scatter", "bf16"),
    ("reduce_scatter", "fp32"),
    ("all_reduce", "bf16"),
    ("all_reduce", "fp32"),
)
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Part of every cache key: a changed probe method measures again.
PROBE_VERSION = 1
CACHE_FORMAT = 1
# Environment variables that change which NCCL kernels run; part of the key when set.
KEY_ENV = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE")
_NEVER = (0, 0)  # a band no buffer with data lies in

# (global ranks of the group) -> MeasuredBands, for this process.
_MEMO: dict[tuple[int, ...], MeasuredBands | str] = {}  # str: why the probe failed
_WARNED_PATHS: set[str] = set()


# --------------------------------------------------------------------------- bands
def bands_from_timings(rows, tolerance: float = 0.01, dtypes=None) -> dict[str, tuple[int, int] | None]:
    """Per collective with rows: the longest run of consecutive measured sizes
    where symmetric buffers were not slower than plain by more than
    ``tolerance`` for every dtype (or only ``dtypes``), as ``(min_bytes,
    max_bytes)``; ``min_bytes`` is 0 when the run starts at the smallest size.
    ``None``: no such size. Of runs equally long, the one of smaller sizes.

    ``rows``: dicts with ``collective``, ``dtype``, ``nbytes``, ``plain_us``,
    ``symmetric_us``; a row with ``symk_engaged`` false (the symmetric kernel
    did not run) or ``host_bound`` true (the timing measured the host) never
    counts as not slower."""
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0; got {tolerance}")
    bands = {}
    for collective in COLLECTIVES:
        rows_c = [r for r in rows if r["collective"] == collective and (dtypes is None or r["dtype"] in dtypes)]
        if not rows_c:
            continue
        sizes = sorted({r["nbytes"] for r in rows_c})
        good = [
            all(
                r.get("symk_engaged") is not False
                and not r.get("host_bound")
                and r["symmetric_us"] <= r["plain_us"] * (1 + tolerance)
                for r in rows_c
                if r["nbytes"] == size
            )
            for size in sizes
        ]
        best = run = None
        for i, ok in enumerate(good):
            run = ((run[0] if run else i), i) if ok else None
            if run and (best is None or run[1] - run[0] > best[1] - best[0]):
                best = run
        bands[collective] = None if best is None else (0 if best[0] == 0 else sizes[best[0]], sizes[best[1]])
    return bands


class BandProbeError(RuntimeError):
    """The probe could not run; raised on every rank of the group alike."""


@dataclasses.dataclass(frozen=True)
class MeasuredBands:
    """Bands of one group of ranks: ``bands`` for every dtype but float32,
    ``bands_fp32`` for float32 buffers; per collective ``(min_bytes, max_bytes)``
    or ``None`` (symmetric never won). ``source``: ``"probe"`` (measured by this
    process) or ``"cache"`` (read from ``path``); ``seconds`` and ``date``: how
    long the probe took and when (for a cache hit: the probe that made the
    entry); ``rows``: the timings (probe only)."""

    bands: dict
    bands_fp32: dict
    ranks: int
    seconds: float
    source: str = "probe"
    key: str = ""
    path: str | None = None
    date: str = ""
    rows: tuple = ()


# --------------------------------------------------------------------------- measuring
def _views(collective, dtype, nbytes, ws, send, recv):
    """Send and receive views (``recv`` ``None``: in place) of ``nbytes`` of full buffer."""
    numel = nbytes // dtype.itemsize
    numel -= numel % ws
    s, r = send.view(dtype), recv.view(dtype)
    if collective == "all_gather":
        return s[: numel // ws], r[:numel]
    if collective == "reduce_scatter":
        return s[:numel], r[: numel // ws]
    return s[:numel], None


def _op(collective, send, recv, group):
    if collective == "all_gather":
        return lambda: dist.all_gather_into_tensor(recv, send, group=group)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(recv, send, op=dist.ReduceOp.SUM, group=group)
    return lambda: dist.all_reduce(send, op=dist.ReduceOp.SUM, group=group)


def _calls_per_run(nbytes: int) -> int:
    """Back-to-back calls per timed run: about 0.5 ms of kernels, 4 to 32 calls."""
    est_us = 10.0 + nbytes / 300e3  # ~300 GB/s bus bandwidth at large sizes
    return int(min(32, max(4, round(500.0 / est_us))))


def _any_late(late: bool, group, device) -> bool:
    """Whether the host of any rank of ``group`` was late for a run (one small all-reduce;
    every rank gets the same answer, so every rank repeats the run or none does)."""
    flag = torch.tensor([1.0 if late else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


class _Timer:
    """Runs of back-to-back calls behind a GPU sleep long enough for the host to
    queue them all (see the module docstring), over the ranks of ``group``."""

    def __init__(self, group, device):
        self.group, self.device = group, device
        if not hasattr(torch.cuda, "_sleep"):  # the same torch on every rank: all raise
            raise BandProbeError(f"torch {torch.__version__} has no torch.cuda._sleep to time collectives behind")
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(1_000_000)
        e.record()
        e.synchronize()
        self.cycles_per_us = 1e6 / max(s.elapsed_time(e) * 1e3, 1.0)
        # Host time to queue one call: 1.5x the latest measured, decaying slowly.
        self.host_us_per_call = 100.0

    def run(self, fn, n: int):
        """``(start event, end event, host_bound)`` of ``n`` calls of ``fn``."""
        sleep_us = n * self.host_us_per_call + 100.0
        for _ in range(3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(sleep_us * self.cycles_per_us))
            s.record()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host_us = (time.perf_counter() - t0) * 1e6 / n
            e.record()
            self.host_us_per_call = max(1.5 * host_us, 0.9 * self.host_us_per_call)
            # late: the GPU no longer slept when the last call was queued (descheduled, say)
            if not _any_late(s.query(), self.group, self.device):
                return s, e, False
            # Some rank's host was late: the run again on every rank, sleeping longer.
            sleep_us = 2 * max(sleep_us, n * host_us + 100.0)
        return s, e, True


def _symmetric_kernels(calls) -> list[bool | None]:
    """Whether each call of ``calls`` ran an NCCL symmetric kernel (``ncclSymk*``),
    from one profiler session; ``None`` each where the kernels cannot be told apart.
    Every call runs whether or not the profiler starts, so that every rank issues
    the same collectives."""
    torch.cuda.synchronize()
    try:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.start()
    except Exception:  # noqa: BLE001 - a profiler already running, no CUPTI: unknown
        prof = None
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    if prof is None:
        return [None] * len(calls)
    try:
        prof.stop()
        events = sorted(
            (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()),
            key=lambda e: e.time_range.start,
        )
    except Exception:  # noqa: BLE001 - the profiler could not collect: unknown
        return [None] * len(calls)
    if len(events) != len(calls):
        return [None] * len(calls)
    return ["symk" in e.name.lower() for e in events]


def measure_bands(
    group=None,
    device=None,
    *,
    sizes=PROBE_SIZES,
    reps: int = 5,
    tolerance: float = 0.01,
    check_kernels: bool = False,
) -> MeasuredBands:
    """Time plain vs symmetric buffers on ``group`` and derive its bands.

    Collective: every rank of ``group`` (default: the world) calls it at the same
    point, with the same arguments, on a group the capability probe found
    available. ``device``: this rank's GPU (default: the current one).
    ``sizes``: full-buffer bytes to time; ``reps``: timed runs per point and
    buffer kind; ``tolerance``: see :func:`bands_from_timings`;
    ``check_kernels``: profile one call of every symmetric point to see whether
    NCCL ran a symmetric kernel (a point where it did not is never in a band);
    off by default: the first profiler session of a process costs seconds (5 s
    on an H100), more than the timing, and a point where NCCL ran its plain
    kernel on symmetric buffers times like plain anyway.

    Allocates two symmetric buffers (registered for ``group``) and two plain
    ones of ``max(sizes)`` bytes each; the symmetric ones go back to the pool
    afterwards, still registered, for staging to reuse. With the default sizes
    it takes a few seconds.
    """
    group = group if group is not None else dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"sizes must be positive byte counts; got {sizes}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1; got {reps}")
    ws = dist.get_world_size(group)
    top = -(-sizes[-1] // (4 * ws)) * 4 * ws  # room for every dtype's views
    start = time.perf_counter()
    with torch.cuda.device(device):
        memory = SymmetricMemory(device, group)
        sym, plain = _allocate(memory, top, group, device)
        try:
            for t in sym + plain:
                t.zero_()
            rows = _measure(group, ws, sizes, reps, sym, plain, check_kernels)
        finally:
            release_storage(sym)
            del plain
    bands = bands_from_timings(rows, tolerance, dtypes=("bf16",))
    fp32 = bands_from_timings(rows, tolerance, dtypes=("fp32",))
    fp32.setdefault("all_gather", bands["all_gather"])
    return MeasuredBands(
        bands=bands,
        bands_fp32=fp32,
        ranks=ws,
        seconds=time.perf_counter() - start,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        rows=tuple(rows),
    )


def _allocate(memory: SymmetricMemory, nbytes: int, group, device):
    """Two registered symmetric and two plain buffers of ``nbytes``, or
    :class:`BandProbeError` on every rank when one rank cannot have them."""
    sym, plain, why = [], [], ""
    try:
        with memory.allocating():
            sym = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        plain = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    except torch.cuda.OutOfMemoryError as exc:
        why = f"out of GPU memory for 4 buffers of {nbytes / _MIB:g} MiB ({exc})"
    ok = torch.tensor([0.0 if why else 1.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() != 1.0:
        release_storage(sym)
        raise BandProbeError(why or "another rank could not allocate the probe's buffers")
    try:
        for t in sym:
            # check=True: the same place of the pool on every rank, or an error on every rank.
            memory.register(t, check=True)
    except SymmetricPlacementMismatch as exc:
        release_storage(sym)
        raise BandProbeError(str(exc)) from exc
    return sym, plain


def _measure(group, ws, sizes, reps, sym, plain, check_kernels):
    points = [(c, d, n) for c, d in PROBE_POINTS for n in sizes]
    fns = {}
    for collective, dname, nbytes in points:
        dtype = _DTYPES[dname]
        fns[collective, dname, nbytes] = {
            "plain": _op(collective, *_views(collective, dtype, nbytes, ws, *plain), group),
            "symmetric": _op(collective, *_views(collective, dtype, nbytes, ws, *sym), group),
        }
    # Warm-up: first calls set up connections and kernels.
    for collective, dname in PROBE_POINTS:
        for nbytes in (sizes[0], sizes[-1]):
            for fn in fns[collective, dname, nbytes].values():
                fn()
                fn()
    torch.cuda.synchronize()
    timer = _Timer(group, sym[0].device)
    variants = ("plain", "symmetric")
    # Per point, reduced with MIN over the ranks: reps plain times, reps symmetric
    # times, then 1/0 flags: queued ahead of the GPU in every run; the symmetric
    # kernel ran or is unknown; known whether it ran.
    width = 2 * reps + 3
    local = torch.zeros(len(points), width, dtype=torch.float64)
    for i, point in enumerate(points):
        n = _calls_per_run(point[2])
        runs = {v: [] for v in variants}
        bound = False
        for rep in range(reps):
            for v in variants if rep % 2 == 0 else variants[::-1]:
                s, e, host_bound = timer.run(fns[point][v], n)
                runs[v].append((s, e))
                bound |= host_bound
        torch.cuda.synchronize()
        for j, v in enumerate(variants):
            for k, (s, e) in enumerate(runs[v]):
                local[i, j * reps + k] = s.elapsed_time(e) * 1e3 / n
        local[i, 2 * reps] = 0.0 if bound else 1.0
    engaged = _symmetric_kernels([fns[p]["symmetric"] for p in points]) if check_kernels else [None] * len(points)
    local[:, 2 * reps + 1] = torch.tensor([0.0 if x is False else 1.0 for x in engaged], dtype=torch.float64)
    local[:, 2 * reps + 2] = torch.tensor([0.0 if x is None else 1.0 for x in engaged], dtype=torch.float64)
    agreed = local.to(sym[0].device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    agreed = agreed.cpu()
    rows = []
    for i, (collective, dname, nbytes) in enumerate(points):
        times = {v: agreed[i, j * reps : (j + 1) * reps].tolist() for j, v in enumerate(variants)}
        rows.append(
            dict(
                collective=collective,
                dtype=dname,
                nbytes=nbytes,
                calls_per_run=_calls_per_run(nbytes),
                plain_us=statistics.median(times["plain"]),
                symmetric_us=statistics.median(times["symmetric"]),
                plain_runs_us=times["plain"],
                symmetric_runs_us=times["symmetric"],
                host_bound=bool(agreed[i, 2 * reps] == 0.0),
                symk_engaged=_engaged(agreed[i, 2 * reps + 1].item(), agreed[i, 2 * reps + 2].item()),
            )
        )
    return rows


def _engaged(ran_or_unknown: float, known: float) -> bool | None:
    """Agreed over the ranks: ``False`` if some rank saw no symmetric kernel,
    ``True`` if every rank saw one, else ``None`` (unknown)."""
    if ran_or_unknown == 0.0:
        return False
    return True if known == 1.0 else None


# --------------------------------------------------------------------------- cache
def default_cache_path() -> str:
    """``$XDG_CACHE_HOME/megatron_ext/symm_mem_bands.json`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_ext", "symm_mem_bands.json")


def cache_key(ranks: int, device) -> str:
    """The cache key of bands for ``ranks`` ranks on one host, this rank's
    ``device``: GPU name, its interconnect (:func:`_interconnect`; CUDA only),
    ranks, NCCL and torch versions, the probe's version and the NCCL variables
    of :data:`KEY_ENV` that are set. :func:`load_bands` uses the key of the
    group's first rank only, so the ranks need not agree on it."""
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a build without NCCL
        nccl = "none"
    parts = [gpu, *(_interconnect(device) if device.type == "cuda" else [])]
    parts += [f"{ranks} ranks on one host", f"NCCL {nccl}", f"torch {torch.__version__}", f"probe {PROBE_VERSION}"]
    parts += [f"{name}={os.environ[name]}" for name in KEY_ENV if name in os.environ]
    return " | ".join(parts)


def _interconnect(device: torch.device) -> list[str]:
    """How this host's GPUs are linked, for :func:`cache_key`: peer access among
    the visible GPUs (``P2P all``, ``P2P none``, ``P2P k/m pairs`` of the m
    ordered pairs, ``P2P n/a`` with one GPU) and, when ``pynvml`` can tell, the
    active NVLink links of ``device`` (``NVLink k``). A part that cannot be
    found out is left out."""
    parts = []
    try:
        n = torch.cuda.device_count()
        pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
        peer = sum(bool(torch.cuda.can_device_access_peer(a, b)) for a, b in pairs)
        if not pairs:
            parts.append("P2P n/a")
        elif peer in (0, len(pairs)):
            parts.append("P2P all" if peer else "P2P none")
        else:
            parts.append(f"P2P {peer}/{len(pairs)} pairs")
    except Exception:  # noqa: BLE001 - no CUDA runtime to ask
        pass
    links = _nvlink_links(device)
    if links is not None:
        parts.append(f"NVLink {links}")
    return parts


def _nvlink_links(device: torch.device) -> int | None:
    """Active NVLink links of ``device`` by NVML, or ``None`` when ``pynvml`` is
    missing or NVML cannot tell (never raises)."""
    try:
        import pynvml
    except Exception:  # noqa: BLE001 - ImportError or a broken install
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no NVML
        return None
    try:
        props = torch.cuda.get_device_properties(device)
        # By PCI address: NVML numbers all GPUs, CUDA only the visible ones.
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        links = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                links += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except Exception:  # noqa: BLE001 - no such link, or no NVLink at all
                pass
        return links
    except Exception:  # noqa: BLE001
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _band(value, what: str):
    if value is None:
        return None
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 0 <= value[0] <= value[1]
    ):
        return tuple(value)
    raise ValueError(f"{what} must be null or [min_bytes, max_bytes] with 0 <= min <= max; got {value!r}")


def _entry_bands(entry) -> tuple[dict, dict]:
    """The ``(bands, bands_fp32)`` of a cache entry; ``ValueError`` when malformed."""
    if not isinstance(entry, dict):
        raise ValueError(f"an entry must be an object; got {type(entry).__name__}")
    out = []
    for field in ("bands", "bands_fp32"):
        table = entry.get(field)
        if not isinstance(table, dict) or set(table) != set(COLLECTIVES):
            raise ValueError(f"{field!r} must map each of {', '.join(COLLECTIVES)} to a band; got {table!r}")
        out.append({c: _band(table[c], f"{field}.{c}") for c in COLLECTIVES})
    return out[0], out[1]


def read_cache(path: str) -> tuple[dict, str | None]:
    """``(entries, problem)`` of the cache file: ``({}, None)`` when it does not
    exist; ``({}, why)`` when it cannot be read or is not a cache file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or encoding
        return {}, f"{type(exc).__name__}: {exc}"
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), dict):
        return {}, f"not a format-{CACHE_FORMAT} band cache (an object with 'format' and 'entries')"
    return data["entries"], None


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on ``path + '.lock'`` (processes and threads alike)."""
    import fcntl

    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_entry(path: str, key: str, entry: dict) -> None:
    """Add or replace ``entry`` under ``key`` in the cache file, keeping every other
    entry: read, merge and an atomic replace, under a lock file beside it, so
    writers in other processes lose nothing. An unreadable file is replaced.
    Raises ``OSError`` when the file cannot be written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _locked(path):
        entries, _ = read_cache(path)
        entries = dict(entries)
        entries[key] = entry
        data = {"format": CACHE_FORMAT, "entries": entries}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".symm_mem_bands.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _entry(measured: MeasuredBands) -> dict:
    return dict(
        bands={c: list(b) if b else None for c, b in measured.bands.items()},
        bands_fp32={c: list(b) if b else None for c, b in measured.bands_fp32.items()},
        ranks=measured.ranks,
        probe_s=round(measured.seconds, 3),
        date=measured.date,
        sizes=sorted({r["nbytes"] for r in measured.rows}),
    )


def _warn_once(path: str, text: str) -> None:
    if path not in _WARNED_PATHS:
        _WARNED_PATHS.add(path)
        warnings.warn(f"megatron_ext.fsdp_symm: {text}", RuntimeWarning, stacklevel=3)


def load_bands(group=None, device=None, cache_path: str | None = None) -> MeasuredBands:
    """The bands of ``group`` from the cache file, or measured and added to it.

    Collective over ``group`` (default: the world), which the capability probe
    found available. The group's first rank reads the file and sends the entry
    of :func:`cache_key` (or a miss) to the others; on a miss every rank runs
    :func:`measure_bands` and the first rank writes the entry
    (:func:`write_entry`). An unreadable file or entry gives one warning and
    counts as a miss; a file that cannot be written gives one warning and the
    bands hold for this process only.
    """
    group = group if group is not None else dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    path = os.path.expanduser(cache_path) if cache_path else default_cache_path()
    ranks = dist.get_world_size(group)
    first = dist.get_rank(group) == 0
    message: list = [None]
    if first:
        key = cache_key(ranks, device)
        entries, problem = read_cache(path)
        if problem is not None:
            _warn_once(
                path,
                f"the symmetric-memory band cache {path} is unreadable ({problem}); probing the bands "
                "again and replacing the file",
            )
        hit = None
        if key in entries:
            try:
                hit = (*_entry_bands(entries[key]), entries[key])
            except ValueError as exc:
                _warn_once(path, f"the entry {key!r} of the band cache {path} is malformed ({exc}); probing again")
        message = [(key, hit)]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    key, hit = message[0]
    if hit is not None:
        bands, bands_fp32, entry = hit
        return MeasuredBands(
            bands=bands,
            bands_fp32=bands_fp32,
            ranks=ranks,
            seconds=float(entry.get("probe_s", 0.0)),
            source="cache",
            key=key,
            path=path,
            date=str(entry.get("date", "")),
        )
    measured = dataclasses.replace(measure_bands(group, device), key=key, path=path)
    if first:
        try:
            write_entry(path, key, _entry(measured))
        except OSError as exc:
            _warn_once(
                path,
                f"cannot write the symmetric-memory band cache {path} ({exc}); the probed bands "
                "hold for this process only (--symm-mem-probe-cache PATH picks another file)",
            )
    return measured


# --------------------------------------------------------------------------- config
def _merge(user, probed, keep_lo: bool, keep_hi: bool):
    if keep_lo and keep_hi:
        return user
    if probed is None:
        return _NEVER
    lo = user[0] if keep_lo else probed[0]
    hi = user[1] if keep_hi else probed[1]
    return (lo, hi) if lo <= hi else _NEVER


def apply_bands(config: SymmMemConfig, measured: MeasuredBands) -> SymmMemConfig:
    """``config`` with ``measured``'s bands in every band field the user did not
    set (:meth:`SymmMemConfig.set_band_fields`); a collective whose band is
    ``None`` (or whose set and measured bounds do not overlap) gets ``(0, 0)``:
    no buffer with data is staged symmetric. A float32 bound not set follows the
    collective's band when the user set a bound of it, else the measured
    float32 band. Every band field of the result is set."""
    kept = set(config.set_band_fields())
    fields = {}
    for name in COLLECTIVES:
        keep = [f"{name}_{bound}_bytes" in kept for bound in ("min", "max")]
        band = _merge(config.band(name), measured.bands[name], *keep)
        keep32 = [f"{name}_fp32_{bound}_bytes" in kept for bound in ("min", "max")]
        user32 = tuple(getattr(config, f"{name}_fp32_{bound}_bytes") for bound in ("min", "max"))
        base32 = band if any(keep) else measured.bands_fp32[name]
        band32 = _merge(user32, base32, *keep32)
        for bound, lo_hi in (("min", 0), ("max", 1)):
            fields[f"{name}_{bound}_bytes"] = band[lo_hi]
            fields[f"{name}_fp32_{bound}_bytes"] = band32[lo_hi]
    assert set(fields) == set(BAND_FIELDS)
    return dataclasses.replace(config, **fields)


def _mib(nbytes: int) -> str:
    return f"{nbytes / _MIB:g}"


def describe(measured: MeasuredBands) -> str:
    """One line: the bands in MiB, where they came from, the key."""
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}

    def table(bands, names):
        return ", ".join(
            f"{short[c]} " + ("never" if bands[c] is None else f"{_mib(bands[c][0])}-{_mib(bands[c][1])} MiB")
            for c in names
        )

    if measured.source == "cache":
        source = f"from the cache {measured.path} (probed {measured.date}, {measured.seconds:.1f} s)"
    else:
        source = f"probed in {measured.seconds:.1f} s, cached in {measured.path}"
    return (
        f"probed bands for {measured.ranks} ranks: {table(measured.bands, COLLECTIVES)}; fp32 "
        f"{table(measured.bands_fp32, ('reduce_scatter', 'all_reduce'))}; {source}; key {measured.key!r}"
    )


def resolve_config(config: SymmMemConfig, group=None, device=None) -> SymmMemConfig:
    """The config to decide ``group``'s buffers with.

    ``config.bands == "probe"`` in auto mode: ``config`` with the bands of
    :func:`load_bands` in every band field the user did not set
    (:func:`apply_bands`), loaded once per group of ranks per process (so every
    bucket of a group uses one probe; the cache file is the first call's) and
    noted under the start-up report. Collective over ``group`` the first time
    for its ranks.

    ``config`` unchanged otherwise: another mode; ``bands="measured"`` (noted
    when ``group`` has another number of ranks than the bands were measured
    with: call it for groups that can stage symmetric, as staging does); every
    band field set by the user; a group the capability probe finds unavailable;
    a group of one rank (nothing to time: NCCL runs no communication kernel for
    one rank); a probe that failed (:class:`BandProbeError`, warned once).
    """
    if config.mode != "auto":
        return config
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_world_size(group)
    if config.bands == "measured":
        if ranks != DEFAULT_BANDS_RANKS and len(config.set_band_fields()) < len(BAND_FIELDS):
            REPORTER.note(
                f"the default bands were measured at {DEFAULT_BANDS_RANKS} ranks (2x H200) and this group has "
                f"{ranks}; --symm-mem-bands probe (SymmMemConfig(bands='probe')) measures them on this machine"
            )
        return config
    if len(config.set_band_fields()) == len(BAND_FIELDS):  # every band set: nothing to probe
        return config
    if not capability.probe(group).available:
        return config
    if ranks == 1:
        REPORTER.note("a group of 1 rank: no bands probed (NCCL runs no communication kernel for one rank)")
        return config
    members = tuple(dist.get_process_group_ranks(group))
    if members not in _MEMO:
        try:
            _MEMO[members] = load_bands(group, device, config.probe_cache)
            text = describe(_MEMO[members])
        except BandProbeError as exc:
            _MEMO[members] = text = f"probing the bands failed, using the configured ones: {exc}"
            if dist.get_rank(group) == 0:
                warnings.warn(f"megatron_ext.fsdp_symm: {text}", RuntimeWarning, stacklevel=2)
        if dist.get_rank(group) == 0:
            logger.info("megatron_ext.fsdp_symm: ranks %s: %s", _ranks_text(members), text)
    measured = _MEMO[members]
    if isinstance(measured, str):
        REPORTER.note(measured)
        return config
    kept = config.set_band_fields()
    REPORTER.note(describe(measured) + (f"; set by the user, kept: {', '.join(kept)}" if kept else ""))
    return apply_bands(config, measured)


def _ranks_text(members) -> str:
    return str(list(members)) if len(members) <= 8 else f"[{members[0]}, {members[1]}, ..., {members[-1]}]"
