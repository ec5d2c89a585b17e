"""What travels with the bytes of a reshard refit: the bucket layout and its header.

Each bucket a rank sends a peer starts with a :data:`HEADER_BYTES` header (int64
x 5: version, wire id, sender rank, bucket index, and whether the bucket carries a
NaN or Inf, raised by the copies that pack it) that the receiver checks
before it keeps the bucket, so a stale, foreign or non-finite source is refused by name
(:func:`header_rows` writes them, :func:`header_refusals` reads them). The wire
id hashes what every rank's cut of its pairs depends on (each rank's slot size and pairs'
digest, the pairs' phases, the zero-copy size) and the check flag (:func:`wire_id`); before the first refit
every rank also reports its wire id or a refusal code (:data:`NO_STAGING`, :data:`BAD_TENSORS`; :mod:`..exec.agreement`)
so that all ranks agree before a byte moves. :func:`bucketize` lays a peer's
transfers out behind the header, cutting transfers larger than a bucket into rows.

Also the dtype names that the control channel and the export plan spell dtypes with
(:func:`dtype_name`, :func:`dtype_of`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from .errors import ControlError
from .reshard_plan import Run, Transfer

__all__ = [
    "ALIGN",
    "BAD_TENSORS",
    "HEADER_BYTES",
    "HEADER_WORDS",
    "NONFINITE_WORD",
    "NO_STAGING",
    "NO_VERSION",
    "PAYLOAD_OFFSET",
    "align",
    "bucket_nbytes",
    "bucketize",
    "dtype_name",
    "dtype_of",
    "header_refusals",
    "header_rows",
    "wire_id",
]

ALIGN = 256  # byte alignment of every tensor or transfer in a bucket (export and reshard): aligned views
# for vectorised copies and NCCL
HEADER_WORDS = 5  # int64: version, wire id, sender rank, bucket index, non-finite flag
NONFINITE_WORD = 4  # its low int32 half is raised by the packing copies (CopyBatch also_flag)
HEADER_BYTES = 8 * HEADER_WORDS
NO_VERSION = -1  # what a rank that holds no valid version sends
NO_STAGING = 0  # the wire id a rank reports when its staging buffers could not be allocated
BAD_TENSORS = 1  # ... and when its tensors are not the layout's (its note says which and how)


def align(n: int) -> int:
    """``n`` bytes rounded up to :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


PAYLOAD_OFFSET = align(HEADER_BYTES)  # where a reshard bucket's first transfer starts


def wire_id(fingerprint: str, buckets: str, check_finite: bool) -> int:
    """The int64 every rank of one refit must share: the plan (``fingerprint``: every rank's slot size and pairs'
    digest, the phases), how pairs are cut (``buckets``: the zero-copy size) and checks."""
    v = int(hashlib.sha256(f"{fingerprint}:{buckets}:{check_finite}".encode()).hexdigest()[:16], 16)
    return v - (1 << 64) if v >= 1 << 63 else v


def _rows(run: Run, rows: int, r0: int, r1: int) -> Run:
    """Rows ``[r0, r1)`` of a run that covers ``rows`` rows of a box."""
    if run.count == 1:  # the rows lie back to back
        per_row = run.length // rows
        return Run(run.local, run.offset + r0 * per_row, (r1 - r0) * per_row, (r1 - r0) * per_row, 1)
    return Run(run.local, run.offset + r0 * run.stride, run.length, run.stride, r1 - r0)


def _pieces(t: Transfer, max_bytes: int) -> list[Transfer]:
    """``t`` cut along dim 0 of its box into pieces of at most ``max_bytes`` (at least one row each)."""
    rows = t.box.shape[0]
    per = max(1, max_bytes // (t.nbytes // rows))
    if per >= rows:
        return [t]
    a = t.box.ranges[0][0]
    return [
        t._replace(
            box=t.box.replace(0, a + r0, a + min(rows, r0 + per)),
            src_run=_rows(t.src_run, rows, r0, min(rows, r0 + per)),
            dst_run=_rows(t.dst_run, rows, r0, min(rows, r0 + per)),
        )
        for r0 in range(0, rows, per)
    ]


def bucketize(transfers: list[Transfer], bucket_bytes: int) -> list[list[tuple[Transfer, int]]]:
    """``(transfer, byte offset)`` per bucket, from :data:`PAYLOAD_OFFSET` (after the
    header) at :data:`ALIGN` offsets; a transfer larger than a bucket is cut into rows
    (a single row larger than a bucket fills one alone)."""
    cap = bucket_bytes - PAYLOAD_OFFSET
    out, cur, used = [], [], PAYLOAD_OFFSET
    for whole in transfers:
        n = whole.nbytes
        for t in (whole,) if n <= cap else _pieces(whole, cap):  # (one that fits a bucket is never cut)
            if t is not whole:
                n = t.nbytes
            if cur and used + n > bucket_bytes:
                out.append(cur)
                cur, used = [], PAYLOAD_OFFSET
            cur.append((t, used))
            used = align(used + n)
    if cur:
        out.append(cur)
    return out


def bucket_nbytes(bucket: list[tuple[Transfer, int]]) -> int:
    """Bytes of a bucket on the wire; an empty one is its header alone (a pair whose bytes all go zero-copy
    still sends one before and one after them, :mod:`.direct`)."""
    if not bucket:
        return HEADER_BYTES
    t, off = bucket[-1]
    return off + t.nbytes


def header_rows(
    buckets: dict[tuple[int, int], list[str]], holds: Callable[[str], int | None], version: int, wire: int, rank: int
) -> list[list[int]]:
    """The header of each send bucket (``(peer, k)`` -> the local tensors it carries): the version its
    tensors hold (``holds``; one that holds another version, or none, marks the whole bucket), the wire
    id, the sender, the bucket index and a cleared non-finite flag."""
    rows = []
    for (_peer, k), names in buckets.items():
        held = {holds(n) for n in names}
        v = version if held == {version} else next(iter(held - {version}))
        rows.append([NO_VERSION if v is None else v, wire, rank, k, 0])
    return rows


def header_refusals(
    headers: list[tuple[int, int, torch.Tensor]],
    version: int,
    wire: int,
    names: Callable[[int, int], str] | None = None,
) -> list[str]:
    """Why a receiver refuses the buckets whose headers (``(k, peer, header)``) say another version or
    plan, or that they carry a NaN or Inf (empty: none); one device-to-host read for all of them.
    ``names(peer, k)``: what bucket ``k`` from ``peer`` holds, for the message."""
    refused = []
    got = torch.stack([h for _, _, h in headers]).tolist()
    for (k, peer, _), (v, wire_got, sender, index, nonfinite) in zip(headers, got):
        if v != version:
            refused.append(f"version: rank {peer} serves {'no valid version' if v == NO_VERSION else f'version {v}'}")
        elif (wire_got, sender, index) != (wire, peer, k):
            refused.append(f"plan: rank {peer} runs another plan or bucket size (bucket {k})")
        elif nonfinite:
            held = f" ({names(peer, k)})" if names is not None else ""
            refused.append(f"nonfinite: rank {peer} sent a NaN or Inf in bucket {k}{held}")
    return refused


# ---------------------------------------------------------------------- dtype names
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot go over the control channel; allowed: {sorted(_DTYPES)}")
    return name


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ControlError(f"unknown dtype {name!r} on the control channel; allowed: {sorted(_DTYPES)}")
    return _DTYPES[name]
