"""A Hugging Face receiver in its own process, for tests, the demo and benchmarks.

:func:`start_hf_receiver` spawns a process that builds a ``transformers`` model
from a :class:`~megatron_ext.testing.tiny_llama.TinyLlamaSpec`-like config and
serves weight exports at ``address`` (``megatron_ext.weight_export.serve``) until
the trainer closes; :meth:`ReceiverProcess.result` returns what it saw.

A receiver that dies is reported with its own error within seconds, not after
the trainer's connect timeout: ``run_on_ranks(..., watch=receiver.failure)``
ends the trainer job as soon as the receiver is gone, with the receiver's exit
code and the end of its traceback (:meth:`ReceiverProcess.failure`).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import traceback

import torch

from .multirank import free_port


class _DieAfter:
    """Consumer wrapper that kills the process after ``n`` buckets (dead-receiver tests)."""

    def __init__(self, consumer, n):
        self.consumer, self.n = consumer, n

    def expected_tensors(self):
        return self.consumer.expected_tensors()

    def load_weights(self, weights):
        self.consumer.load_weights(weights)
        self.n -= 1
        if self.n <= 0:
            os._exit(3)

    def logits(self, tokens):
        return self.consumer.logits(tokens)


# How much of a dead receiver's traceback its error message quotes.
_TRACEBACK_LINES = 12


def _main(build, build_args, address, device, out_path, die_after, timeout_s, keep_state):
    try:
        from megatron_ext import weight_export as wx

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = build(*build_args).to(device)
        consumer = wx.HFModelConsumer(model)
        if die_after:
            consumer = _DieAfter(consumer, die_after)
        versions = []
        receiver = wx.serve(consumer, address, device=device, timeout_s=timeout_s, on_version=versions.append)
        state = {n: p.detach().cpu().clone() for n, p in model.named_parameters()} if keep_state else None
        result = {"ok": True, "applied": versions, "state": state, "plans": receiver.plans_received}
    except BaseException:  # noqa: BLE001
        result = {"ok": False, "error": traceback.format_exc()}
    torch.save(result, out_path)
    if not result["ok"]:
        sys.exit(1)


class ReceiverProcess:
    def __init__(self, proc, address, out_dir):
        self.proc, self.address, self._dir = proc, address, out_dir

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def _saved(self) -> dict | None:
        path = os.path.join(self._dir.name, "result.pt")
        return torch.load(path, weights_only=False) if os.path.exists(path) else None

    def failure(self) -> str | None:
        """``None`` while the process runs or after it exited cleanly; else what
        killed it: exit code and the last lines of its traceback."""
        code = self.proc.exitcode
        if code is None or code == 0:
            return None
        saved = self._saved()
        head = f"the HF receiver process for {self.address} exited with code {code}"
        if saved is None or "error" not in saved:
            return head + " without writing an error (killed or crashed; its stderr, above, may say more)"
        tail = saved["error"].rstrip().splitlines()[-_TRACEBACK_LINES:]
        return head + "; the end of its traceback:\n" + "\n".join(tail)

    def result(self, timeout: float = 120.0) -> dict:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
            raise RuntimeError(f"receiver at {self.address} did not exit within {timeout:.0f}s")
        res = self._saved() or {"ok": False, "error": f"exited with code {self.proc.exitcode} before reporting"}
        res["exitcode"] = self.proc.exitcode
        self._dir.cleanup()
        return res


def start_hf_receiver(
    build,
    build_args=(),
    *,
    device="cpu",
    die_after: int | None = None,
    timeout_s: float = 120.0,
    keep_state: bool = True,
) -> ReceiverProcess:
    """Spawn a receiver serving at a fresh ``127.0.0.1:port``; ``build(*build_args)``
    returns the HF model (a module-level function)."""
    address = f"127.0.0.1:{free_port()}"
    out_dir = tempfile.TemporaryDirectory(prefix="megatron_ext_receiver_")
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=_main,
        args=(
            build,
            tuple(build_args),
            address,
            str(device),
            os.path.join(out_dir.name, "result.pt"),
            die_after,
            timeout_s,
            keep_state,
        ),
        name="hf-receiver",
        daemon=True,
    )
    proc.start()
    return ReceiverProcess(proc, address, out_dir)
