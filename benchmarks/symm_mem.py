"""Benchmark NCCL symmetric-memory staging on 2 GPUs: collectives and training steps.

    python benchmarks/symm_mem.py [--out symm_mem.json] [--quick]

Part 1, collectives: all-gather, reduce-scatter and all-reduce, bf16 and fp32,
full-buffer sizes 256 KiB .. 512 MiB. Each point times the same collective on
plain buffers, on symmetric buffers (send and receive both from the pool and
registered), and on the buffers the default policy picks, interleaved, with CUDA
events around many back-to-back calls (median of several repetitions). The
profiler records whether an ``ncclSymk`` kernel ran for each variant. From the
measurements it derives the size band per collective where symmetric memory is
not slower for either dtype (the defaults in ``megatron_ext/fsdp_symm/config.py``).

Part 2, training steps whose communication is exposed (small batch, no overlap):
experimental FSDP (upstream plain, upstream ``use_symm_mem=True``, ours) and
Megatron DDP (plain, ours), ms/step and kernel counts.

Prints tables and writes JSON. Needs 2 GPUs (NCCL_NVLS_ENABLE=0 on our 2xH200).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MIB = 1 << 20
SIZES = [MIB // 4, MIB // 2, MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB,
         64 * MIB, 128 * MIB, 256 * MIB, 512 * MIB]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def _time(fn, iters, reps):
    """Median over ``reps`` of the mean time of ``iters`` back-to-back calls (us)."""
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / iters)
    return statistics.median(out)


def _buffers(collective, nbytes, dtype, ws, symm):
    numel = nbytes // dtype.itemsize
    numel -= numel % ws
    shapes = {"all_gather": (numel // ws, numel), "reduce_scatter": (numel, numel // ws),
              "all_reduce": (numel, numel)}[collective]
    if symm is None:
        send = torch.randn(shapes[0], device="cuda").to(dtype)
        recv = torch.empty(shapes[1], device="cuda", dtype=dtype)
    else:
        send = symm.empty(shapes[0], dtype)
        send.copy_(torch.randn(shapes[0], device="cuda"))
        recv = send if collective == "all_reduce" else symm.empty(shapes[1], dtype)
    return send, recv


def _op(collective, send, recv):
    if collective == "all_gather":
        return lambda: dist.all_gather_into_tensor(recv, send)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(recv, send, op=dist.ReduceOp.SUM)
    return lambda: dist.all_reduce(send, op=dist.ReduceOp.SUM)


def _series_kernels(pairs):
    """Kernel names of one call of each (plain, symmetric) pair, from one profiler
    session; the calls are serialized, so kernels map to calls by start time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for plain, sym in pairs:
            plain()
            torch.cuda.synchronize()
            sym()
            torch.cuda.synchronize()
    names = _nccl_names(prof)
    if len(names) == 2 * len(pairs):
        return [([names[2 * i]], [names[2 * i + 1]]) for i in range(len(pairs))]
    out = []  # not one kernel per call: profile each call on its own
    for plain, sym in pairs:
        got = []
        for fn in (plain, sym):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            got.append(_nccl_names(prof))
        out.append(tuple(got))
    return out


def _kernel_us(fn, iters=20):
    """Median device duration (us) of the NCCL kernels of ``iters`` back-to-back
    calls, from the profiler: the collective's own cost, without the host
    launch overhead that dominates CUDA-event timings of small collectives."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    durations = [e.time_range.elapsed_us() for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()]
    return statistics.median(durations) if durations else float("nan")


def _nccl_names(prof):
    events = sorted((e for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()),
                    key=lambda e: e.time_range.start)
    return [e.name.split("(")[0] for e in events]


def bench_collectives(quick):
    from megatron_ext.fsdp_symm import SymmMemConfig, decide
    from megatron_ext.fsdp_symm.capability import probe
    from megatron_ext.fsdp_symm.memory import SymmetricMemory

    ws = dist.get_world_size()
    group = dist.group.WORLD
    cap = probe(group)
    _log(f"capability: {cap}")
    symm = SymmetricMemory(torch.device("cuda", torch.cuda.current_device()), group)
    policy = SymmMemConfig()
    sizes = SIZES[::3] if quick else SIZES
    rows = []
    for collective in COLLECTIVES:
        for dname, dtype in DTYPES.items():
            series = []
            for nbytes in sizes:
                iters = 50 if nbytes <= 8 * MIB else (20 if nbytes <= 64 * MIB else 8)
                plain = _op(collective, *_buffers(collective, nbytes, dtype, ws, None))
                sym = _op(collective, *_buffers(collective, nbytes, dtype, ws, symm))
                d = decide(collective, nbytes, policy)
                pol = sym if d.symmetric else plain
                for fn in (plain, sym):
                    for _ in range(3):
                        fn()
                torch.cuda.synchronize()
                t = {"plain": [], "symmetric": [], "policy": []}
                for _ in range(5):  # interleave the variants against drift
                    t["plain"].append(_time(plain, iters, 1))
                    t["symmetric"].append(_time(sym, iters, 1))
                    t["policy"].append(_time(pol, iters, 1))
                t = {k: statistics.median(v) for k, v in t.items()}
                row = dict(collective=collective, dtype=dname, nbytes=nbytes,
                           plain_us=t["plain"], symmetric_us=t["symmetric"], policy_us=t["policy"],
                           policy_symmetric=d.symmetric,
                           plain_kernel_us=_kernel_us(plain), symmetric_kernel_us=_kernel_us(sym))
                rows.append(row)
                series.append((row, plain, sym))
            # Which kernels ran: one profiler session per series, one call each.
            names = _series_kernels([(p, s_) for _, p, s_ in series])
            for (row, _, _), (kp, ks) in zip(series, names):
                row.update(plain_kernels=kp, symmetric_kernels=ks,
                           symk_engaged=any("symk" in k.lower() for k in ks),
                           plain_symk=any("symk" in k.lower() for k in kp))
                t = row
                _log(f"{collective:<15}{dname:<5}{row['nbytes'] / MIB:>9.2f} MiB  plain {t['plain_us']:9.1f} us"
                     f"  symm {t['symmetric_us']:9.1f} us ({t['plain_us'] / t['symmetric_us']:.2f}x, "
                     f"symk={row['symk_engaged']})  policy[{'S' if row['policy_symmetric'] else 'P'}] "
                     f"{t['policy_us']:9.1f} us ({t['plain_us'] / t['policy_us']:.3f}x)  "
                     f"kernel plain {t['plain_kernel_us']:8.1f} symm {t['symmetric_kernel_us']:8.1f} us "
                     f"({t['plain_kernel_us'] / t['symmetric_kernel_us']:.2f}x)  {ks[:1]}")
            del series
            torch.cuda.synchronize()
    return rows, symm


def recommend_bands(rows, tolerance=0.01, key="us"):
    """Per collective: the longest run of consecutive measured sizes where the
    symmetric kernel ran and was not slower than plain by more than
    ``tolerance`` for every dtype, as ``(min_bytes, max_bytes)`` (min 0 when the
    run starts at the smallest size); ``None`` when there is no such size.
    ``key``: ``"us"`` compares CUDA-event times of back-to-back calls,
    ``"kernel_us"`` the profiler's kernel durations."""
    bands = {}
    for collective in COLLECTIVES:
        sizes = sorted({r["nbytes"] for r in rows if r["collective"] == collective})
        good = []
        for s in sizes:
            pts = [r for r in rows if r["collective"] == collective and r["nbytes"] == s]
            good.append(all(r["symk_engaged"]
                            and r[f"symmetric_{key}"] <= r[f"plain_{key}"] * (1 + tolerance)
                            for r in pts))
        best, run = None, None
        for i, ok in enumerate(good):
            if ok:
                run = (run[0], i) if run else (i, i)
                if best is None or run[1] - run[0] > best[1] - best[0]:
                    best = run
            else:
                run = None
        bands[collective] = None if best is None else (
            0 if best[0] == 0 else sizes[best[0]], sizes[best[1]])
    return bands


# ---------------------------------------------------------------- training steps
def _step_time(step, steps=10, warmup=3, reps=5):
    """Median over ``reps`` of the mean ms/step of ``steps`` steps."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    return _time(step, steps, reps) / 1e3


def _count_kernels(step):
    names = []
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower():
            names.append(e.name.split("(")[0])
    return {"nccl_kernels": len(names), "symk_kernels": sum("symk" in n.lower() for n in names)}


def bench_fsdp(width, layers, batch=4):
    from torch.distributed.device_mesh import init_device_mesh
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MixedPrecisionPolicy
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import (
        Flat, Placements, fully_shard as upstream_fully_shard, fully_shard_optimizer)

    from megatron_ext.fsdp_symm import SymmMemConfig, fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    placements = Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])
    out = {}
    for variant in ("upstream plain", "upstream use_symm_mem", "ours (auto)", "ours (on)"):
        torch.manual_seed(1234)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        model = model.to(device="cuda", dtype=torch.bfloat16)
        mp = MixedPrecisionPolicy(main_params_dtype=torch.float32)
        for m in model:
            if variant.startswith("ours"):
                mode = "on" if variant == "ours (on)" else "auto"
                fully_shard(m, mesh=mesh, placements=placements, mixed_precision_policy=mp,
                            symm_mem_config=SymmMemConfig(mode=mode, report=False))
            else:
                upstream_fully_shard(m, mesh=mesh, placements=placements, mixed_precision_policy=mp,
                                     use_symm_mem=variant == "upstream use_symm_mem")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        fully_shard_optimizer(opt)
        x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
        y = torch.randn_like(x)
        losses = []

        def step():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())

        ms = _step_time(step)
        out[variant] = dict(ms_per_step=ms, **_count_kernels(step),
                            final_loss=losses[-1].float().item())
        del model, opt
        torch.cuda.synchronize()
    return out


def bench_ddp(hidden, layers, bucket_mib, distopt):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.fsdp_symm import SymmMemConfig, SymmMemDistributedDataParallel
    from megatron_ext.testing import tiny_gpt

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    spec = tiny_gpt.TinyGPTSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=16,
                                ffn_hidden_size=4 * hidden, vocab_size=8192, seq_length=128,
                                micro_batch_size=1)
    out = {}
    for variant in ("plain", "ours (auto)", "ours (on)"):
        cfg = tiny_gpt.transformer_config(spec)  # fp32 params and grads
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distopt,
            overlap_grad_reduce=True, bucket_size=bucket_mib * MIB // 4)
        module = tiny_gpt.build_model(spec, cfg, device="cuda")
        if variant == "plain":
            ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=module)
        else:
            mode = "on" if variant == "ours (on)" else "auto"
            ddp = SymmMemDistributedDataParallel(config=cfg, ddp_config=ddp_config, module=module,
                                                 symm_mem_config=SymmMemConfig(mode=mode, report=False))
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=distopt), [ddp])
        tokens, labels = tiny_gpt.global_batch(spec, step=dist.get_rank(), num_samples=1)
        tokens, labels = tokens.cuda(), labels.cuda()

        def step():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            tiny_gpt.forward_loss(ddp, tokens, labels).backward()
            ddp.finish_grad_sync()
            opt.step()

        ms = _step_time(step)
        decisions = getattr(ddp, "symm_mem_decisions", [])
        out[variant] = dict(ms_per_step=ms, **_count_kernels(step),
                            buckets=len(ddp.buffers[0].buckets),
                            symmetric_buffers=sum(d.symmetric for _, d in decisions))
        del ddp, opt, module
        torch.cuda.synchronize()
    return out


def main_rank(quick):
    import socket

    rows = [] if os.environ.get("SYMM_BENCH_SKIP_COLLECTIVES") else bench_collectives(quick)[0]
    _partial = os.environ.get("SYMM_BENCH_PARTIAL")
    if _partial and dist.get_rank() == 0:
        with open(_partial, "w") as f:
            json.dump(rows, f)
    bands = recommend_bands(rows)
    kernel_bands = recommend_bands(rows, key="kernel_us")
    result = dict(
        machine=f"{socket.gethostname()}: {dist.get_world_size()}x {torch.cuda.get_device_name()}",
        torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())),
        nvls=os.environ.get("NCCL_NVLS_ENABLE"), collectives=rows, recommended_bands=bands,
        recommended_bands_kernel_time=kernel_bands,
    )
    _log("recommended bands (MiB):", {k: v and (v[0] / MIB, v[1] / MIB) for k, v in bands.items()})
    _log("recommended bands by kernel time (MiB):",
         {k: v and (v[0] / MIB, v[1] / MIB) for k, v in kernel_bands.items()})
    worst = max((r["policy_us"] / r["plain_us"] for r in rows), default=0)
    result["policy_worst_vs_plain"] = worst
    _log(f"policy worst vs plain: {worst:.3f}x time")
    if os.environ.get("SYMM_BENCH_SKIP_STEPS"):
        return result
    result["fsdp"] = {}
    for width, layers in ([(1024, 8)] if quick else [(1024, 8), (2048, 8), (4096, 4)]):
        try:
            r = bench_fsdp(width, layers)
        except Exception as exc:  # noqa: BLE001 - keep the other results
            import traceback
            result["fsdp"][f"w{width}xL{layers}"] = {"error": traceback.format_exc()}
            _log(f"FSDP w={width} failed: {exc!r}")
            continue
        result["fsdp"][f"w{width}xL{layers}"] = r
        for k, v in r.items():
            _log(f"FSDP w={width} L={layers} {k:<22} {v['ms_per_step']:.3f} ms/step  "
                 f"nccl {v['nccl_kernels']} symk {v['symk_kernels']}")
    result["ddp"] = {}
    for distopt in (False, True):
        try:
            r = bench_ddp(hidden=1024, layers=4, bucket_mib=8, distopt=distopt)
        except Exception as exc:  # noqa: BLE001 - keep the other results
            import traceback
            result["ddp"]["distopt" if distopt else "allreduce"] = {"error": traceback.format_exc()}
            _log(f"DDP distopt={distopt} failed: {exc!r}")
            continue
        result["ddp"]["distopt" if distopt else "allreduce"] = r
        for k, v in r.items():
            _log(f"DDP distopt={distopt} {k:<12} {v['ms_per_step']:.3f} ms/step  nccl {v['nccl_kernels']} "
                 f"symk {v['symk_kernels']} buckets {v['buckets']} symmetric {v['symmetric_buffers']}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="symm_mem.json")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and models")
    parser.add_argument("--collectives-only", action="store_true", help="skip the training steps")
    args = parser.parse_args()
    if args.collectives_only:
        os.environ["SYMM_BENCH_SKIP_STEPS"] = "1"
    from megatron_ext.testing.multirank import run_on_ranks

    t0 = time.time()
    res = run_on_ranks(main_rank, 2, args=(args.quick,), backend="nccl", timeout=590)[0]
    res["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
