"""FP8 refit benchmark on one GPU: what block-FP8 costs (quantization) and saves (bytes), for a Llama preset.

    python benchmarks/fp8_refit.py --preset 3b --out fp8_refit.json      # one GPU
    (the tiny preset is refused: its 32-row heads cut 128-row blocks)

Measured (median of ``--iters`` after a warm-up), printed as a table and written as JSON:

- quantize: :meth:`Fp8Sources.refresh` of a trainer rank (the whole model at TP1; one rank's share at TP2);
- wire bytes of the plan Megatron TP2 -> engine TP2 (the cross-GPU layout of the recorded refit table),
  bf16 vs ``fp8-block``;
- a refit on one rank (trainer and engine TP1 on the same GPU: every byte a device copy), bf16 vs FP8
  (requantization included).

With one GPU there is no link to measure; the last rows project a link-bound refit as wire bytes per
rank / ``--link-gbps`` (default: the 321 GB/s point-to-point limit measured on 4xH200) plus the
quantization, and say so.

``--kernels`` times the arithmetic alone on the weights a refit quantizes (the preset's decoder-layer
linear weights, whole, as the export hook quantizes them and a bf16 engine dequantizes them; each weight
its own tensors), with CUDA events: quantize (the Triton kernel, bf16 in) and dequantize into a bf16
tensor, the PyTorch ops against the Triton kernel. One row per distinct shape (its weights one after
another), then the whole model (what an engine pays per refit). GB/s counts the bytes each call must
read and write (bf16 weight, FP8 values, float32 scales), the same for both dequantize paths.

    python benchmarks/fp8_refit.py --kernels --preset 3b --out fp8_kernels.json   # one GPU
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

from benchmarks.common import PRESETS, event_ms, provenance  # noqa: E402
from megatron_ext.sharding import fp8_layout, gpt_specs, megatron_layout  # noqa: E402
from megatron_ext.sharding.fp8 import is_quantized  # noqa: E402
from megatron_ext.weight_export import ReshardExecutor, build_reshard_plan, inference_layout  # noqa: E402
from megatron_ext.weight_export.plan import fp8  # noqa: E402
from megatron_ext.weight_export.plan.fp8 import Fp8Sources  # noqa: E402


def _specs(preset: str):
    p = PRESETS[preset]
    return gpt_specs(
        num_layers=p["num_layers"],
        hidden_size=p["hidden_size"],
        num_heads=p["num_attention_heads"],
        num_groups=p["num_query_groups"],
        head_dim=p["hidden_size"] // p["num_attention_heads"],
        ffn_hidden_size=p["ffn_hidden_size"],
        vocab_size=p["hf_vocab_size"],
        dtype=torch.bfloat16,
    )


def _timed(fn, device, iters):
    fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _kernel_rows(specs, device, iters):
    """Milliseconds and bytes of quantize (Triton) and of dequantize to bf16 (PyTorch ops, Triton kernel) per
    distinct weight shape (all weights of that shape, one after another), and for the whole model. Every
    weight has its own tensors, as in a refit: a shape's working set is not served from L2."""
    kernels = fp8._kernels()
    if kernels is None:
        raise SystemExit("--kernels: Triton is not importable; install the triton that matches torch")
    block = fp8.FP8_BLOCK
    paths = {  # dequantize writes into an existing bf16 tensor both ways, as the receiver writes an engine's weight
        "quantize": lambda w, q, s, out: fp8._quantize_triton(kernels["quantize"], w, block, (q, s)),
        "dequantize_torch": lambda w, q, s, out: fp8._dequantize_torch(q, s, torch.bfloat16, block, out),
        "dequantize_triton": lambda w, q, s, out: fp8._dequantize_triton(
            kernels["dequantize"], q, s, torch.bfloat16, block, out
        ),
    }
    weights = {}  # shape -> [(bf16 weight, fp8 values, scales, bf16 output)] in the model's order
    for spec in specs:
        if is_quantized(spec):
            w = torch.randn(spec.shape, device=device, dtype=torch.bfloat16)
            weights.setdefault(tuple(spec.shape), []).append((w, *fp8.quantize_blocks(w), torch.empty_like(w)))
    rows = []
    for shape, tensors in weights.items():
        w, q, s, _ = tensors[0]
        # every call reads and writes these: the bf16 weight, its FP8 values and its float32 scales
        nbytes = len(tensors) * (w.numel() * w.element_size() + q.numel() + s.numel() * 4)
        rows.append(dict(shape=list(shape), count=len(tensors), bytes=nbytes, tensors=tensors))
    left = {shape: iter(tensors) for shape, tensors in weights.items()}
    ordered = [next(left[tuple(spec.shape)]) for spec in specs if is_quantized(spec)]
    total = dict(shape="model", count=len(ordered), bytes=sum(r["bytes"] for r in rows), tensors=ordered)
    for r in (*rows, total):
        tensors = r.pop("tensors")
        for name, fn in paths.items():
            r[f"{name}_ms"] = event_ms(lambda fn=fn, tensors=tensors: [fn(*t) for t in tensors], iters)
            r[f"{name}_gbps"] = r["bytes"] / (r[f"{name}_ms"] * 1e-3) / 1e9
    return rows, total


def _kernels_main(args, argv, specs, device):
    rows, total = _kernel_rows(specs, device, args.iters)
    name = torch.cuda.get_device_name(device)
    print(f"FP8 block arithmetic, preset {args.preset} (decoder-layer linear weights, bf16 <-> FP8), {name}")
    head = f"{'weight':>14} {'count':>5} {'MB':>9}"
    for what in ("quantize", "dequant torch", "dequant triton"):
        head += f" {what + ' ms':>19} {'GB/s':>7}"
    print(head)
    for r in (*rows, total):
        shape = "x".join(map(str, r["shape"])) if r is not total else "whole model"
        line = f"{shape:>14} {r['count']:>5} {r['bytes'] / 1e6:>9.1f}"
        for key in ("quantize", "dequantize_torch", "dequantize_triton"):
            line += f" {r[f'{key}_ms']:>19.3f} {r[f'{key}_gbps']:>7.0f}"
        print(line)
    torch_ms, triton_ms = total["dequantize_torch_ms"], total["dequantize_triton_ms"]
    print(f"whole model dequantize: PyTorch {torch_ms:.2f} ms, Triton {triton_ms:.2f} ms ({torch_ms / triton_ms:.2f}x)")
    record = {
        **provenance("benchmarks/fp8_refit.py", argv),
        "device": name,
        "preset": args.preset,
        "mode": "kernels",
        "note": "a row: every quantized weight of that shape (the model row: all of them, in the model's order), "
        "one call each, back to back; ms: median of --iters after a warm-up (CUDA events); bytes: read and "
        "written by those calls (bf16 weight, FP8 values, float32 scales)",
        "shapes": rows,
        "model": total,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return record


def _locals(layout, rank, device):
    return {n: torch.randn(lt.shape, dtype=lt.dtype, device=device) for n, lt in layout.tensors[rank].items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--link-gbps", type=float, default=321.0, help="link bandwidth per GPU for the projection")
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", action="store_true", help="time quantize / dequantize alone (see the module doc)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/fp8_refit.py measures CUDA kernels and copies, and this machine has no CUDA device "
            "(torch.cuda.is_available() is False): run it on a GPU machine"
        )
    if args.kernels and device.type != "cuda":
        raise SystemExit(f"--kernels times the Triton kernels with CUDA events: give a CUDA --device, not {device}")
    torch.manual_seed(0)
    specs = _specs(args.preset)
    if args.kernels:
        return _kernels_main(args, argv, specs, device)
    rows = {}

    # quantization per trainer rank
    for tp in (1, 2):
        src = fp8_layout(megatron_layout(specs, tp=tp))
        sources = Fp8Sources(_locals(src.base, 0, device), src, 0)
        rows[f"quantize_tp{tp}_rank_s"] = _timed(sources.refresh, device, args.iters)
        rows[f"quantize_tp{tp}_rank_bytes_in"] = sum(t.numel() * 2 for _, t, _, _ in sources._jobs)
        del sources

    # wire bytes, Megatron TP2 -> engine TP2 on other ranks
    src, dst = megatron_layout(specs, tp=2), inference_layout(specs, tp=2, ranks=[2, 3])
    bf16_plan, fp8_plan = build_reshard_plan(src, dst), build_reshard_plan(fp8_layout(src), fp8_layout(dst))
    rows["wire_bytes_bf16"] = sum(t.nbytes for t in bf16_plan.transfers)
    rows["wire_bytes_fp8"] = sum(t.nbytes for t in fp8_plan.transfers)
    rows["wire_ratio"] = rows["wire_bytes_fp8"] / rows["wire_bytes_bf16"]

    # a refit on one rank (device copies only)
    for name, wire in (("bf16", lambda lay: lay), ("fp8", fp8_layout)):
        s, d = wire(megatron_layout(specs, ranks=[0])), wire(inference_layout(specs, ranks=[0]))
        trainer = _locals(s.base or s, 0, device)
        refresh = None
        if s.base is not None:
            sources = Fp8Sources(trainer, s, 0)
            trainer, refresh = sources.tensors, sources.refresh
        engine = {n: torch.empty(lt.shape, dtype=lt.dtype, device=device) for n, lt in d.tensors[0].items()}
        ex = ReshardExecutor(build_reshard_plan(s, d), 0, {**trainer, **engine}, refresh=refresh)
        version = iter(range(1, 1000))
        rows[f"local_refit_{name}_s"] = _timed(lambda ex=ex: ex.refit(next(version)), device, args.iters)
        del ex, trainer, engine

    # projection for a link-bound refit (not measured: one GPU has no link)
    per_rank = {k: rows[f"wire_bytes_{k}"] / 2 for k in ("bf16", "fp8")}  # two engine ranks receive in parallel
    link = args.link_gbps * 1e9
    rows["projected_link_bf16_s"] = per_rank["bf16"] / link
    rows["projected_link_fp8_s"] = per_rank["fp8"] / link + rows["quantize_tp2_rank_s"]
    rows["projected_speedup"] = rows["projected_link_bf16_s"] / rows["projected_link_fp8_s"]

    print(f"FP8 refit, preset {args.preset}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"{'what':<44} {'value':>14}")
    for k, v in rows.items():
        unit = f"{v * 1e3:11.2f} ms" if k.endswith("_s") else f"{v / 1e9:11.3f} GB" if "bytes" in k else f"{v:14.3f}"
        print(f"{k:<44} {unit:>14}")
    record = {
        **provenance("benchmarks/fp8_refit.py", argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset,
        "link_gbps_assumed": args.link_gbps,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return record


if __name__ == "__main__":
    main()
