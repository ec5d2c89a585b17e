"""A one-rank trainer that exports to an engine, as a command of its own (fault-injection tests).

    python -m megatron_ext.testing.export_trainer --target 127.0.0.1:PORT --out result.pt \\
        [--spec '{"arch": "qwen3"}'] [--versions 2] [--transport broadcast] [--timeout-s 60] \\
        [--kill-in-version 2 --kill-after-buckets 3] [--nan-in-version 2] [--verify] [--device cuda] \\
        [--hold-until FILE]

It builds the tiny Llama-shaped Megatron model (:mod:`.tiny_llama`) on one gloo
rank (on ``--device``; ``cuda`` for the same-GPU IPC transports), exports
versions ``1..--versions`` (each a changed copy of the weights), and writes what
it sent (HF tensors per version, from an in-process reference receiver), the
versions the engine applied and any error to ``--out``. Faults:
``--kill-in-version V --kill-after-buckets K`` SIGKILLs this process after it
sent ``K`` buckets of version ``V`` (``K=0``: after all of its bytes, before it
is committed; the in-place transports send no buckets); ``--nan-in-version V``
puts a NaN into one weight before version ``V``.

``--transport p2p``: ``--target`` is the refit group's store (this process hosts
it as refit rank 0 of 2; the engine command joins as rank 1 with
``--refit-store``), and ``--kill-after-buckets K`` counts rounds of point-to-point
transfers instead of buckets. ``--hold-until FILE``: once connected (p2p: once its
store is up and the engine joined), wait until ``FILE`` exists before the first
version (a test's cue, e.g. after it knocked at the store), at most ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import traceback
import types

import torch

from ..weight_export.config import memory_budget
from . import tiny_llama


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m megatron_ext.testing.export_trainer")
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--spec", default="{}", help="TinyLlamaSpec fields as JSON")
    p.add_argument("--versions", type=int, default=2)
    p.add_argument("--transport", default="broadcast")
    p.add_argument("--bucket-size-mb", type=float, default=0.03)
    p.add_argument("--memory-budget-mb", type=memory_budget, default="auto", help="p2p: --refit-memory-budget-mb")
    p.add_argument("--zero-copy-mb", type=float, default=None, help="p2p: --refit-zero-copy-mb")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--kill-in-version", type=int, default=None)
    p.add_argument("--kill-after-buckets", type=int, default=1)
    p.add_argument("--nan-in-version", type=int, default=None)
    p.add_argument("--verify", action="store_true", help="run the verifier (engine logits) after version 1")
    p.add_argument("--device", default="cpu", help="where the model lives (cuda: the ipc transports)")
    p.add_argument("--hold-until", default=None, help="wait for this file before the first version")
    return p.parse_args(argv)


class _KillAfter:
    """Wraps a sender: SIGKILLs this process after ``n`` buckets of version ``version``."""

    def __init__(self, sender, version: int, n: int):
        self.sender, self.version, self.n, self.current = sender, version, n, None

    def __getattr__(self, name):
        return getattr(self.sender, name)

    def start(self, plan, buffers, version):
        self.current = version
        return self.sender.start(plan, buffers, version)

    def send(self, bucket, buf):
        work = self.sender.send(bucket, buf)
        if self.current == self.version and self.n > 0:
            work.wait()  # the bucket has left
            self.n -= 1
            if self.n == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        return work

    def finish(self, version):
        if version == self.version and self.n == 0:  # every byte written, the version not yet committed
            os.kill(os.getpid(), signal.SIGKILL)
        return self.sender.finish(version)


class _P2P:
    """The p2p refit as this command drives an exporter: export(version).applied, close()."""

    def __init__(self, model, spec, args):
        from megatron_ext import weight_export as wx

        cfg = wx.RefitConfig(
            transport="p2p",
            store=args.target,
            bucket_size_mb=args.bucket_size_mb,
            memory_budget_mb=args.memory_budget_mb,
            zero_copy_mb=args.zero_copy_mb,
            timeout_s=args.timeout_s,
        )
        self.refit = wx.TrainerRefit.from_model(model, cfg, vocab_size=spec.hf_vocab_size)
        self.version = None
        if args.kill_in_version is not None:  # SIGKILL after K rounds of that version have been posted
            group, left = self.refit.group, [args.kill_after_buckets]
            post = group.post

            def counting(ops):
                if self.version == args.kill_in_version:
                    if left[0] == 0:
                        os.kill(os.getpid(), signal.SIGKILL)
                    left[0] -= 1
                return post(ops)

            group.post = counting

    def export(self, version):
        self.version = version
        self.refit.refit(version)
        return types.SimpleNamespace(applied=tuple(self.refit.engine_versions().values()))

    def close(self):
        self.refit.close()
        self.refit.group.close()


def _reference(model, spec):
    """The HF tensors an export sends, captured in this process."""
    from megatron_ext import weight_export as wx

    got = {}
    consumer = wx.LoadWeightsConsumer(lambda ws: got.update({n: t.detach().cpu().clone() for n, t in ws}))
    ref = wx.WeightExporter(
        model,
        wx.RefitConfig(vocab_size=spec.hf_vocab_size, check_finite=False),
        receiver=wx.WeightReceiver(consumer),
    )
    ref.export()
    return got


def main(argv=None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    out = {"applied": [], "sent": {}, "error": None, "error_type": None, "kl": None, "logit_diff": None}
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_ext import weight_export as wx
        from megatron_ext.testing import cpu_compat
        from megatron_ext.testing.multirank import free_port

        cpu_compat.install()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        ps.initialize_model_parallel()
        spec = dataclasses.replace(tiny_llama.TinyLlamaSpec(), **json.loads(args.spec))
        device = torch.device(args.device)
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
            torch.cuda.set_device(device)
        model = tiny_llama.build_model(spec, tiny_llama.transformer_config(spec), device=device)
        if args.transport == "p2p":
            exporter = _P2P(model, spec, args)
        else:
            exporter = wx.WeightExporter(
                model,
                wx.RefitConfig(
                    target=args.target,
                    transport=args.transport,
                    bucket_size_mb=args.bucket_size_mb,
                    vocab_size=spec.hf_vocab_size,
                    timeout_s=args.timeout_s,
                ),
            )
        if args.kill_in_version is not None and args.transport != "p2p":
            exporter._sender = _KillAfter(exporter.sender, args.kill_in_version, args.kill_after_buckets)
        if args.hold_until is not None:
            deadline = time.monotonic() + args.timeout_s
            while not os.path.exists(args.hold_until):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"--hold-until {args.hold_until}: not created within {args.timeout_s:g}s")
                time.sleep(0.05)
        for v in range(1, args.versions + 1):
            if v > 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-0.5).add_(0.01 * v)
            if v == args.nan_in_version:
                with torch.no_grad():
                    next(iter(model.parameters())).view(-1)[3] = float("nan")
            out["sent"][v] = _reference(model, spec)
            torch.save(out, args.out)  # what was sent so far survives a kill
            out["applied"].append(exporter.export(version=v).applied)
            if v == 1 and args.verify:
                checked = exporter.verify(tiny_llama.tokens(spec).to(device))
                out["kl"], out["logit_diff"] = checked.kl, checked.max_abs_diff
        exporter.close()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"], out["error_type"] = f"{exc}\n{traceback.format_exc()}", type(exc).__name__
    torch.save(out, args.out)
    return 0 if out["error"] is None else 3


if __name__ == "__main__":
    sys.exit(main())
