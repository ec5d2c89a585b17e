"""NCCL point-to-point throughput per receiving GPU against the bytes each op carries.

The reshard refit moves a version in rounds: one ``batch_isend_irecv`` per round, one op per peer
and bucket (staged) or per zero-copy run. Within a memory budget the buckets shrink, so the rounds
carry smaller ops. This measures what that costs NCCL alone, with no packing: the first half of the
ranks send ``--total-mib`` to the second half in groups of ops of ``--sizes-mib`` each, posted back
to back (``--inflight`` groups before the oldest is waited on), in two patterns:

* ``pair``: sender ``j`` to receiver ``j`` (one peer each);
* ``cross``: every sender to every receiver in each group (the non-colocated TP2 -> TP2 refit);
* ``ops<N>``: ``cross`` with each op cut into ``N`` ops (zero-copy rounds: one op per tensor run).

    python benchmarks/p2p_rounds.py --world 4 --sizes-mib 16,64,256,1024 --out p2p_rounds.json

Prints GB/s per receiver (the slowest) and writes the JSON (machine, date, command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import provenance  # noqa: E402
from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402

MiB = 1 << 20


def _pattern(name: str, rank: int, world: int) -> tuple[list[int], list[int], int]:
    """(peers this rank sends to, peers it receives from, ops per peer per group)."""
    half = world // 2
    senders, receivers = list(range(half)), list(range(half, 2 * half))
    if name == "pair":
        sends = [rank + half] if rank in senders else []
        recvs = [rank - half] if rank in receivers else []
        return sends, recvs, 1
    cut = int(name[3:]) if name.startswith("ops") else 1
    return (receivers if rank in senders else []), (senders if rank in receivers else []), cut


def _rank(patterns: list[str], sizes: list[int], total: int, inflight: int, iters: int) -> list[dict]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=dev)
    for pattern in patterns:
        sends, recvs, cut = _pattern(pattern, rank, world)
        for size in sizes:
            peers_in = max(len(_pattern(pattern, r, world)[1]) for r in range(world))
            groups = max(1, total // (size * max(peers_in, 1)))
            piece = size // cut

            def one_pass():
                posted = []
                for _ in range(groups):
                    ops = [
                        dist.P2POp(dist.isend, buf[j * piece : (j + 1) * piece], p) for p in sends for j in range(cut)
                    ]
                    ops += [
                        dist.P2POp(dist.irecv, buf[j * piece : (j + 1) * piece], p) for p in recvs for j in range(cut)
                    ]
                    if len(posted) == inflight:
                        for req in posted.pop(0):
                            req.wait()
                    posted.append(dist.batch_isend_irecv(ops) if ops else [])
                for reqs in posted:
                    for req in reqs:
                        req.wait()

            times = []
            for i in range(iters + 1):
                dist.barrier()
                torch.cuda.synchronize(dev)
                start = time.perf_counter()
                one_pass()
                torch.cuda.synchronize(dev)
                if i:  # the first pass: warm-up (connections)
                    times.append(time.perf_counter() - start)
            got = len(recvs) * groups * cut * piece
            s = statistics.median(times)
            out.append(
                dict(
                    pattern=pattern,
                    size=size,
                    groups=groups,
                    seconds=s,
                    recv_bytes=got,
                    gbps=got / s / 1e9 if got else None,
                )
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=0, help="ranks (default: all GPUs; even)")
    p.add_argument("--patterns", default="pair,cross,ops16", help="comma-separated pair|cross|ops<N>")
    p.add_argument("--sizes-mib", default="16,32,64,128,256,512")
    p.add_argument("--total-mib", type=int, default=3584, help="bytes each receiver gets per pass")
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default="p2p_rounds.json")
    a = p.parse_args(argv)
    world = a.world or torch.cuda.device_count()
    if world < 2 or world % 2 or torch.cuda.device_count() < world:
        p.error(f"--world must be even, >= 2 and at most the GPUs ({torch.cuda.device_count()}); got {world}")
    patterns = [x.strip() for x in a.patterns.split(",")]
    for x in patterns:
        if x not in ("pair", "cross") and not (x.startswith("ops") and x[3:].isdigit() and int(x[3:]) > 0):
            p.error(f"--patterns: {x!r} is not pair, cross or ops<N>")
    try:
        sizes = [int(float(x) * MiB) for x in a.sizes_mib.split(",")]
    except ValueError:
        p.error(f"--sizes-mib must be comma-separated numbers of MiB, got {a.sizes_mib!r}")
    cuts = [int(x[3:]) for x in patterns if x.startswith("ops")]
    if any(s < max(cuts, default=1) for s in sizes):
        p.error(f"--sizes-mib must be > 0 and at least one byte per op ({max(cuts, default=1)} ops per peer)")
    if a.inflight < 1 or a.iters < 1 or a.total_mib < 1:
        p.error("--inflight, --iters and --total-mib must be >= 1")
    res = run_on_ranks(
        _rank, world, args=(patterns, sizes, a.total_mib * MiB, a.inflight, a.iters), backend="nccl", timeout=540
    )
    rows = []
    for i, r in enumerate(res[0]):
        got = [rk[i] for rk in res if rk[i]["gbps"] is not None]
        rows.append(
            dict(pattern=r["pattern"], size_mib=r["size"] / MiB, groups=r["groups"], gbps=min(g["gbps"] for g in got))
        )
    print(
        f"NCCL p2p, {world} ranks, {a.total_mib} MiB per receiver, {a.inflight} groups in flight, median of {a.iters}"
    )
    print(f"{'pattern':8} {'MiB/op':>8} {'groups':>7} {'GB/s/receiver':>14}")
    for r in rows:
        print(f"{r['pattern']:8} {r['size_mib']:8.0f} {r['groups']:7d} {r['gbps']:14.1f}")
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    with open(a.out, "w") as f:
        json.dump(
            dict(
                benchmark="p2p_rounds",
                **provenance("benchmarks/p2p_rounds.py", argv),
                nccl_env=env,
                rows=rows,
                ranks=res,
            ),
            f,
            indent=2,
        )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
