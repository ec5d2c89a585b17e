"""The NaN/Inf check fused into the copy vs the copy alone vs the copy and a separate check.

The refit's copies of a 3B Llama (the HF tensors of ``--preset``, bf16): whole tensors (what the
gather places and ``ipc-push`` writes) and the attention weights as views of Megatron's fused QKV
(per query group, what ``ipc-direct`` copies out of the trainer). Per case it times
``CopyBatch(pairs).run()`` (copy), the same then ``finite_flags`` over the destinations (the
check as a second read, the path without the fused kernel) and ``CopyBatch(pairs, check=True)``
(fused), checks that a NaN in the last element is flagged, and prints a table. Then the check
alone, as the zero-copy refit's sender runs it (its sources are read, not copied): ``finite_flags``
with a reduction per large tensor and with one multi-tensor reduction (``large=None``), device
and host milliseconds::

    python benchmarks/copy_check.py --preset 3b --out copy_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import PRESETS, event_ms, provenance  # noqa: E402
from megatron_ext.copies import LARGE, CopyBatch, finite_flags  # noqa: E402
from megatron_ext.copy_check import prewarm  # noqa: E402


def hf_shapes(p: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = p["hidden_size"], p["ffn_hidden_size"], p["vocab_size"]
    d = h // p["num_attention_heads"]
    kv = d * p["num_query_groups"]
    out = [("embed", (v, h)), ("lm_head", (v, h)), ("norm", (h,))]
    for i in range(p["num_layers"]):
        out += [
            (f"{i}.q", (h, h)),
            (f"{i}.k", (kv, h)),
            (f"{i}.v", (kv, h)),
            (f"{i}.o", (h, h)),
            (f"{i}.gate", (f, h)),
            (f"{i}.up", (f, h)),
            (f"{i}.down", (h, f)),
            (f"{i}.ln1", (h,)),
            (f"{i}.ln2", (h,)),
        ]
    return out


def whole_pairs(p: dict, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.empty(s, dtype=torch.bfloat16, device=device), torch.randn(s, device=device).to(torch.bfloat16))
        for _, s in hf_shapes(p)
    ]


def qkv_pairs(p: dict, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """q, k, v of every layer as views of a fused [groups, (heads/group + 2) * d, h] weight."""
    h, g = p["hidden_size"], p["num_query_groups"]
    d = h // p["num_attention_heads"]
    per = p["num_attention_heads"] // g
    pairs = []
    for _ in range(p["num_layers"]):
        fused = torch.randn(g, (per + 2) * d, h, device=device).to(torch.bfloat16)
        for lo, hi in ((0, per * d), (per * d, (per + 1) * d), ((per + 1) * d, (per + 2) * d)):
            src = fused[:, lo:hi]
            pairs.append((torch.empty(src.shape, dtype=torch.bfloat16, device=device), src))
    return pairs


def measure(name: str, pairs, iters: int) -> dict:
    # the kernel compiled first (until then CopyBatch(check=True) checks by a second read)
    prewarm(pairs[0][0].device, {d.dtype for d, _ in pairs}, wait=True)
    plain, fused = CopyBatch(pairs), CopyBatch(pairs, check=True)
    dsts = [d for d, _ in pairs]

    def separate():
        plain.run()
        return [f for _, f in finite_flags(dsts)]

    nbytes = sum(s.numel() * s.element_size() for _, s in pairs)
    times = {
        "copy": event_ms(plain.run, iters),
        "copy + check": event_ms(separate, iters),
        "fused": event_ms(fused.run, iters),
    }
    # the fused flags are right: none now, the last pair's last element once it is NaN
    clean = int(fused.run().sum())
    src = pairs[-1][1]
    keep = src.reshape(-1)[-1:].clone() if src.is_contiguous() else None
    src[(-1,) * src.dim()] = float("nan")
    flags = fused.run().tolist()
    src[(-1,) * src.dim()] = keep[0] if keep is not None else 0
    row = {
        "case": name,
        "pairs": len(pairs),
        "fused_launches": sum(len(f.launches) for f in fused.fused),
        "bytes": nbytes,
        "flags_clean": clean,
        "nan_flagged": flags[-1] != 0 and sum(flags[:-1]) == 0,
    }
    for method, t in times.items():
        row[f"{method} ms"] = t
        row[f"{method} GB/s (read+write)"] = 2 * nbytes / t / 1e6
    row["check overhead, separate"] = row["copy + check ms"] / row["copy ms"] - 1
    row["check overhead, fused"] = row["fused ms"] / row["copy ms"] - 1
    srcs = [s for _, s in pairs]
    for label, large in (("check alone", LARGE), ("check alone, one reduction", None)):
        row[f"{label} ms"] = event_ms(lambda large=large: finite_flags(srcs, large=large), iters)
        start = time.perf_counter()
        for _ in range(iters):
            finite_flags(srcs, large=large)
        row[f"{label} host ms"] = (time.perf_counter() - start) / iters * 1e3
        torch.cuda.synchronize()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="3b")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_check benchmark: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    p = PRESETS[args.preset]
    rows = []
    for name, build in (("whole HF tensors", whole_pairs), ("q/k/v views of fused QKV", qkv_pairs)):
        pairs = build(p, device)
        rows.append(measure(name, pairs, args.iters))
        del pairs
        torch.cuda.empty_cache()
    head = f"{'case':28} {'pairs':>5} {'GB':>6} {'copy ms':>8} {'+check ms':>9} {'fused ms':>8}"
    print(f"{head} {'sep %':>6} {'fused %':>7} nan")
    for r in rows:
        print(
            f"{r['case']:28} {r['pairs']:5d} {r['bytes'] / 1e9:6.2f} {r['copy ms']:8.2f} {r['copy + check ms']:9.2f} "
            f"{r['fused ms']:8.2f} {100 * r['check overhead, separate']:6.1f} {100 * r['check overhead, fused']:7.1f} "
            f"{'flagged' if r['nan_flagged'] else 'MISSED'}"
        )
    print(f"\n{'check alone (no copy)':28} {'per-large ms':>12} {'host ms':>8} {'one-reduction ms':>16} {'host ms':>8}")
    for r in rows:
        print(
            f"{r['case']:28} {r['check alone ms']:12.2f} {r['check alone host ms']:8.2f} "
            f"{r['check alone, one reduction ms']:16.2f} {r['check alone, one reduction host ms']:8.2f}"
        )
    ok = all(r["nan_flagged"] and r["flags_clean"] == 0 for r in rows)
    if args.out:
        result = provenance("benchmarks/copy_check.py", argv)
        result.update(preset=args.preset, iters=args.iters, rows=rows)
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
