"""Summarise chrome traces written by ``benchmarks/refit_vs_swap.py --profile-dir``: per CUDA stream its
busy time, the kernels that are NCCL's, long (> 0.2 ms) or after a gap (> 0.2 ms) with their start,
duration and the gap before them (ms), its kernels by total time; then the host's long synchronisations.

    python tools/trace_sum.py DIR/nc-tp2-tp2_ours-stream_rank0.json [...]   (.json or .json.gz)
"""

import collections
import gzip
import json
import sys

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
LONG_US = 200


def summarise(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in DEVICE and "dur" in e]
    if not kernels:
        print(f"== {path}: no device events")
        return
    t0 = min(e["ts"] for e in kernels)
    t1 = max(e["ts"] + e["dur"] for e in kernels)
    print(f"== {path}: device span {(t1 - t0) / 1e3:.2f} ms, {len(kernels)} device events")
    streams = collections.defaultdict(list)
    for e in kernels:
        streams[e["tid"]].append(e)
    for tid, es in sorted(streams.items()):
        es.sort(key=lambda e: e["ts"])
        print(f"  stream {tid}: {len(es)} events, busy {sum(e['dur'] for e in es) / 1e3:.2f} ms")
        end, totals = None, collections.Counter()
        counts = collections.Counter()
        for e in es:
            name = e["name"][:60]
            gap = e["ts"] - end if end is not None else 0
            end = e["ts"] + e["dur"]
            if "nccl" in e["name"].lower() or e["dur"] > LONG_US or gap > LONG_US:
                at, dur = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
                print(f"    +{at:8.3f}  dur {dur:7.3f}  gap {gap / 1e3:7.3f}  {name}")
            totals[name] += e["dur"]
            counts[name] += 1
        for name, us in totals.most_common(6):
            print(f"      {counts[name]:5d}x {us / 1e3:8.3f} ms  {name}")
    syncs = [
        e
        for e in events
        if e.get("cat") == "cuda_runtime" and "ynchronize" in e.get("name", "") and e.get("dur", 0) > LONG_US / 2
    ]
    for e in syncs:
        print(f"  host {e['name']} at +{(e['ts'] - t0) / 1e3:.3f} ms for {e['dur'] / 1e3:.3f} ms")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        summarise(p)
