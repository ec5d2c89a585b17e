"""Refit benchmark: stream a Llama-shaped bf16 Megatron model to HF receivers.

    # GPU machine (2 GPUs for the cross-GPU rows; 1 GPU runs the colocated ones)
    python benchmarks/refit.py --preset 3b --out refit.json
    # CPU smoke test of the same code paths (gloo, shared-memory files)
    python benchmarks/refit.py --preset tiny --device cpu --out /tmp/refit_cpu.json
    # reshard refit vs gather-then-broadcast + simulator (benchmarks/refit_reshard.py)
    python benchmarks/refit.py --reshard --preset 3b --out refit_reshard.json

Measured in one run and printed as a table (and written as JSON):

- limits: device-to-device copy bandwidth on GPU 0 (colocated) and NCCL
  broadcast bandwidth between GPU 0 and GPU 1 (cross-GPU), 1 GiB payloads;
- naive baseline: per-parameter materialisation and per-tensor transfer (one
  CUDA IPC handle + round trip per tensor; one metadata message + broadcast per
  tensor);
- ours: ``WeightExporter`` over CUDA IPC (receiver on GPU 0; ``ipc-direct``:
  the engine copies straight from the trainer's mapped weights; ``ipc-push``:
  the trainer writes straight into the engine's mapped weights; ``ipc``:
  two shared export buffers) and NCCL broadcast (receiver on GPU 1): time per refit (median of ``--iters``
  after a warm-up),
  GB/s of HF payload, fraction of the limit, peak extra trainer memory in units
  of one export buffer, and the verifier's KL.

Every refit ends when the receiver reports the version applied (its copies done).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import GiB, PRESETS, megatron_config, provenance, spec_for  # noqa: E402
from megatron_ext import copy_check  # noqa: E402
from megatron_ext.testing import tiny_llama  # noqa: E402
from megatron_ext.testing.multirank import run_on_ranks  # noqa: E402
from megatron_ext.testing.receiver_proc import start_hf_receiver  # noqa: E402


def build_receiver_model(spec, device):
    """HF LlamaForCausalLM in bf16, initialised directly on ``device``."""
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        return tiny_llama.build_hf(spec, dtype=torch.bfloat16)


# ------------------------------------------------------------------ limits
def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    _sync(device)
    return nbytes * iters / (time.perf_counter() - start) / 1e9


def _broadcast_rank(nbytes, iters):
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        dist.broadcast(buf, 0)
    _sync(torch.device(device))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.broadcast(buf, 0)
    _sync(torch.device(device))
    return nbytes * iters / (time.perf_counter() - start) / 1e9


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------ naive baseline
_NAIVE_PLANS: dict[int, list] = {}


def _naive_plan(model, spec) -> list:
    """``(tensor meta, its transfers)`` of every HF tensor at TP=1, planned once per model (outside the
    timed refits: the naive baseline times the per-tensor copies and messages, not planning)."""
    from megatron_ext.sharding import specs_from_model
    from megatron_ext.weight_export.plan.export_plan import build_plan

    if id(model) not in _NAIVE_PLANS:
        plan = build_plan(specs_from_model(model, vocab_size=spec.hf_vocab_size), 1 << 30)
        by_name: dict[str, list] = {}
        for bucket in plan.buckets:
            for t in bucket.transfers:
                by_name.setdefault(t.name, []).append(t)
        _NAIVE_PLANS[id(model)] = [(meta, by_name[meta.name]) for meta in plan.tensors()]
    return _NAIVE_PLANS[id(model)]


def _naive_tensors(model, spec):
    """Per HF tensor: materialise it as a new contiguous tensor from its pieces."""
    from megatron_ext.sharding import megatron_tensors
    from megatron_ext.weight_export.plan.reshard_plan import run_view

    tensors = megatron_tensors(model)
    device = next(iter(tensors.values())).device
    for meta, transfers in _naive_plan(model, spec):
        out = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        for t in transfers:
            out[t.box.slices] = run_view(tensors[t.src_run.local], t.src_run).view(t.box.shape)
        yield meta.name, out


def _naive_share(t):
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(t)  # CUDA: the naive ipc rows run on GPUs only


def naive_export(model, spec, conn, pg, mode):
    """One naive refit: per-tensor IPC handle + ack, or per-tensor metadata + broadcast."""
    for name, t in _naive_tensors(model, spec):
        if mode == "ipc":
            _sync(t.device)
            conn.send(("tensor", name, t.dtype, tuple(t.shape), _naive_share(t)))
            assert conn.recv() == ("done", name)
        else:
            conn.send(("tensor", name, t.dtype, tuple(t.shape), None))
            pg.broadcast(t, 0).wait()
    conn.send(("end",))
    assert conn.recv()[0] == "applied"


def _naive_open(handle):
    fn, args = handle
    return fn(*args)


def _no_delay(conn):
    """Nagle off on a multiprocessing connection: the same control-channel latency as ours."""
    import socket

    sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()
    return conn


def _naive_connect(address, timeout_s, key):
    from multiprocessing.connection import Client

    from megatron_ext.weight_export.config import parse_address

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _no_delay(Client(parse_address(address), authkey=key))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def naive_receiver(spec, address, device, mode, key):
    """Engine side of the naive baseline: per-tensor messages (pickles over a multiprocessing
    connection with this run's random key), HF model updates."""
    import datetime
    from multiprocessing.connection import Listener

    import torch.distributed as dist

    from megatron_ext.weight_export import HFModelConsumer
    from megatron_ext.weight_export.config import parse_address
    from megatron_ext.weight_export.control.refit_group import make_group

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    consumer = HFModelConsumer(build_receiver_model(spec, device))
    with Listener(parse_address(address), authkey=key) as listener:
        conn = _no_delay(listener.accept())
    pg = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "join":
            _, host, port, rank, world, backend, t = msg
            store = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=t))
            pg = make_group(store, rank, world, backend, t)
        elif msg[0] == "tensor":
            _, name, dtype, shape, handle = msg
            if handle is not None:
                buf = _naive_open(handle)
                t = buf.view(dtype).view(shape) if buf.dtype == torch.uint8 else buf
            else:
                t = torch.empty(shape, dtype=dtype, device=device)
                pg.broadcast(t, 0).wait()
            consumer.load_weights([(name, t)])
            if mode == "ipc":
                _sync(device)
                conn.send(("done", name))
        elif msg[0] == "end":
            _sync(device)
            conn.send(("applied", 0))
        elif msg[0] == "close":
            break


def start_naive_receiver(spec, device, mode, key):
    import multiprocessing

    from megatron_ext.testing.multirank import free_port

    address = f"127.0.0.1:{free_port()}"
    proc = multiprocessing.get_context("spawn").Process(
        target=naive_receiver, args=(spec, address, str(device), mode, key), daemon=True
    )
    proc.start()
    return proc, address


# ------------------------------------------------------------------ trainer
def _trainer(spec, scenarios, bucket_mb, iters, timeout_s, check_finite=True):
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.weight_export.control.refit_group import make_group

    ps.initialize_model_parallel()
    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    from megatron.core.transformer.module import Float16Module

    config = megatron_config(spec, gpu)
    model = Float16Module(config, tiny_llama.build_model(spec, config, device=device))  # bf16 like training
    nparams = sum(p.numel() for p in model.parameters())
    tokens = tiny_llama.tokens(spec, batch=1)
    rows = []
    for sc in scenarios:
        row = dict(name=sc["name"], kind=sc["kind"], params=nparams)
        if gpu:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        if sc["kind"] == "ours":
            exporter = wx.WeightExporter(
                model,
                wx.RefitConfig(
                    target=sc["address"],
                    transport=sc["transport"],
                    backend="nccl" if gpu else "gloo",
                    bucket_size_mb=bucket_mb,
                    vocab_size=spec.hf_vocab_size,
                    timeout_s=timeout_s,
                    quantize=sc.get("quantize", "none"),
                    check_finite=check_finite,
                ),
            )
            first = exporter.export()
            # the steady state: the trainer's checked-copy kernel compiled (it compiles in the background from
            # the exporter's construction; the first export checks by a second read until then)
            copy_check.prewarm(device, {p.dtype for p in model.parameters()}, wait=True)
            for _ in range(iters):
                times.append(exporter.export().seconds)
            if gpu:
                row["peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - base
            verify = exporter.verify(tokens)
            row.update(
                nbytes=exporter.plan.total_bytes,
                buffer_bytes=exporter.plan.buffer_bytes,
                buckets=len(exporter.plan.buckets),
                first_s=first.seconds,
                applied=list(exporter.last_result.applied),
                kl=verify.kl,
                max_abs_logit_diff=verify.max_abs_diff,
            )
            exporter.close()
        else:
            conn = _naive_connect(sc["address"], timeout_s, sc["key"])
            pg = None
            if sc["transport"] == "broadcast":
                store = dist.TCPStore(
                    "127.0.0.1",
                    0,
                    2,
                    is_master=True,
                    timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False,
                )
                conn.send(("join", "127.0.0.1", store.port, 1, 2, "nccl" if gpu else "gloo", timeout_s))
                pg = make_group(store, 0, 2, "nccl" if gpu else "gloo", timeout_s)
            mode = "ipc" if sc["transport"] == "ipc" else "broadcast"
            naive_export(model, spec, conn, pg, mode)  # warm-up
            for _ in range(iters):
                start = time.perf_counter()
                naive_export(model, spec, conn, pg, mode)
                times.append(time.perf_counter() - start)
            if gpu:
                row["peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - base
            row.update(nbytes=sum(t.numel() * t.element_size() for _, t in _naive_tensors(model, spec)))
            conn.send(("close",))
        row["seconds"] = statistics.median(times)
        row["gbps"] = row["nbytes"] / row["seconds"] / 1e9
        rows.append(row)
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--reshard" in argv:  # reshard refit vs gather-then-broadcast: benchmarks/refit_reshard.py
        from benchmarks import refit_reshard

        return refit_reshard.main([a for a in argv if a != "--reshard"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="3b")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--bucket-size-mb", type=float, default=512)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--limit-gib", type=float, default=1.0, help="payload of the limit measurements")
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--no-naive", action="store_true", help="skip the naive baseline")
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="add rows of the same transports with --refit-quantize fp8-block (the bf16 engine loads dequantized)",
    )
    parser.add_argument(
        "--no-check-finite",
        action="store_true",
        help="ours without the NaN/Inf check before each version is published (shows the check's cost)",
    )
    parser.add_argument("--out", default="refit.json")
    args = parser.parse_args(argv)

    gpus = torch.cuda.device_count()
    gpu = args.device == "cuda" or (args.device == "auto" and gpus >= 1)
    if gpu and gpus < 1:
        parser.error("--device cuda needs a GPU")
    spec = spec_for(args.preset)
    backend = "nccl" if gpu else "gloo"
    colocated = torch.device("cuda", 0) if gpu else torch.device("cpu")
    cross = torch.device("cuda", 1) if gpu and gpus >= 2 else (None if gpu else torch.device("cpu"))
    limit_bytes = int(args.limit_gib * GiB)

    print(
        f"refit benchmark: preset {args.preset}, device {'cuda' if gpu else 'cpu'} ({gpus} GPUs), "
        f"bucket {args.bucket_size_mb} MiB, {args.iters} timed refits each"
        + (", NaN/Inf check off" if args.no_check_finite else ""),
        flush=True,
    )
    limits = {"copy_gbps": copy_bandwidth(colocated, limit_bytes)}
    print(f"limit: device copy {limits['copy_gbps']:.1f} GB/s", flush=True)
    if cross is not None:
        limits["broadcast_gbps"] = run_on_ranks(
            _broadcast_rank, 2, args=(limit_bytes, 10), backend=backend, timeout=args.timeout_s
        )[1]
        print(f"limit: broadcast {limits['broadcast_gbps']:.1f} GB/s", flush=True)

    procs, scenarios = [], []
    receivers = []
    # (where, transport, receiver device, with a naive baseline row); ipc-direct needs CUDA.
    plan = [("colocated", "ipc-direct", colocated, False), ("colocated", "ipc-push", colocated, False)] if gpu else []
    if gpu:  # CUDA IPC; on CPU only the broadcast rows run
        plan.append(("colocated", "ipc", colocated, True))
    if cross is not None:
        plan.append(("cross-gpu", "broadcast", cross, True))
    if args.fp8:  # FP8 goes through buckets: not ipc-push / ipc-direct
        plan += [
            (where, transport, device, False, "fp8-block")
            for where, transport, device, _ in plan
            if transport in ("ipc", "broadcast")
        ]
    for where, transport, device, with_naive, *quantize in plan:
        rec = start_hf_receiver(
            build_receiver_model, (spec, str(device)), device=device, timeout_s=args.timeout_s, keep_state=False
        )
        receivers.append(rec)
        quantize = quantize[0] if quantize else "none"
        label = transport if quantize == "none" else f"{transport}, {quantize}"
        scenarios.append(
            dict(
                name=f"{where} ours ({label})",
                kind="ours",
                transport=transport,
                address=rec.address,
                where=where,
                quantize=quantize,
            )
        )
        if with_naive and not args.no_naive:
            key = secrets.token_bytes(16)
            proc, address = start_naive_receiver(spec, device, transport, key)
            procs.append(proc)
            scenarios.append(
                dict(
                    name=f"{where} naive (per-tensor {transport})",
                    kind="naive",
                    transport=transport,
                    address=address,
                    where=where,
                    key=key,
                )
            )
    try:
        rows = run_on_ranks(
            _trainer,
            1,
            args=(spec, scenarios, args.bucket_size_mb, args.iters, args.timeout_s, not args.no_check_finite),
            backend=backend,
            timeout=max(600, args.timeout_s * 2),
            watch=lambda: next(filter(None, (r.failure() for r in receivers)), None),
        )[0]
        for rec in receivers:
            res = rec.result(timeout=args.timeout_s)
            if not res["ok"]:
                raise RuntimeError(res["error"])
    finally:
        for rec in receivers:
            rec.__exit__(None, None, None)
        for p in procs:
            p.kill()

    for row, sc in zip(rows, scenarios):
        limit = limits["copy_gbps"] if sc["where"] == "colocated" else limits.get("broadcast_gbps")
        row["where"], row["quantize"] = sc["where"], sc.get("quantize", "none")
        row["fraction_of_limit"] = row["gbps"] / limit if limit else None
        if "buffer_bytes" in row and "peak_extra_bytes" in row:
            row["peak_extra_buffers"] = row["peak_extra_bytes"] / row["buffer_bytes"]
    for row in rows:
        naive = [r for r in rows if r["kind"] == "naive" and r["where"] == row["where"]]
        if row["kind"] == "ours" and naive:
            row["speedup_vs_naive"] = naive[0]["seconds"] / row["seconds"]
        bf16 = [
            r
            for r in rows
            if r is not row and r.get("quantize") == "none" and r["name"] == row["name"].split(",")[0] + ")"
        ]
        if row.get("quantize", "none") != "none" and bf16:
            row["bytes_vs_bf16"] = row["nbytes"] / bf16[0]["nbytes"]
            row["speedup_vs_bf16"] = bf16[0]["seconds"] / row["seconds"]

    header = f"{'scenario':38} {'time ms':>9} {'GB/s':>8} {'of limit':>8} {'vs naive':>8} {'extra mem':>12} {'KL':>9}"
    print(f"\nmodel: {rows[0]['params'] / 1e9:.2f}B params, {rows[0]['nbytes'] / GiB:.2f} GiB bf16 payload")
    print(
        f"limits: copy {limits['copy_gbps']:.1f} GB/s"
        + (f", broadcast {limits['broadcast_gbps']:.1f} GB/s" if "broadcast_gbps" in limits else "")
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        frac = f"{r['fraction_of_limit']:.0%}" if r.get("fraction_of_limit") is not None else "-"
        speed = f"{r['speedup_vs_naive']:.1f}x" if "speedup_vs_naive" in r else "-"
        mem = f"{r['peak_extra_bytes'] / (1 << 20):.0f}MiB" if "peak_extra_bytes" in r else "-"
        if "peak_extra_buffers" in r:
            mem += f"/{r['peak_extra_buffers']:.1f}b"
        kl = f"{r['kl']:.1e}" if "kl" in r else "-"
        print(f"{r['name']:38} {r['seconds'] * 1e3:9.2f} {r['gbps']:8.2f} {frac:>8} {speed:>8} {mem:>12} {kl:>9}")
    targets = []
    for r in rows:
        if r["kind"] != "ours":
            continue
        need = 0.5 if r["where"] == "colocated" else 0.8
        if r.get("fraction_of_limit") is not None:
            targets.append(
                (
                    f"{r['name']}: >= {need:.0%} of the {r['where']} limit",
                    r["fraction_of_limit"] >= need,
                    f"{r['fraction_of_limit']:.0%}",
                )
            )
        if "speedup_vs_naive" in r:
            targets.append(
                (
                    f"{r['name']}: >= 10x the naive baseline",
                    r["speedup_vs_naive"] >= 10,
                    f"{r['speedup_vs_naive']:.1f}x",
                )
            )
        if "peak_extra_buffers" in r:
            targets.append(
                (
                    f"{r['name']}: extra trainer memory <= 2 buffers",
                    r["peak_extra_buffers"] <= 2.0,
                    f"{r['peak_extra_buffers']:.2f} buffers",
                )
            )
    for r in rows:
        if "speedup_vs_bf16" in r:
            print(
                f"{r['name']}: {r['bytes_vs_bf16']:.3f}x the bytes of bf16, {r['speedup_vs_bf16']:.2f}x its speed "
                f"(KL vs the bf16 trainer {r['kl']:.2e})"
            )
    print("\ntargets:")
    for what, ok, value in targets:
        print(f"  {'PASS' if ok else 'FAIL'}  {what} ({value})")
    result = dict(
        **provenance("benchmarks/refit.py", argv),
        preset=args.preset,
        spec=dataclasses.asdict(spec),
        bucket_size_mb=args.bucket_size_mb,
        iters=args.iters,
        check_finite=not args.no_check_finite,
        limits=limits,
        rows=rows,
        targets=[dict(target=w, met=ok, value=v) for w, ok, v in targets],
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
