"""Run a function on N ranks of a fresh ``torch.distributed`` job.

Used by the multi-rank tests, the demo and the benchmarks::

    results = run_on_ranks(body, world_size=2, args=(cfg,), timeout=120)

Each rank is a fresh process (forked from a forkserver that imported torch and
megatron-core once, for gloo jobs on a machine without a GPU; spawned otherwise)
with the caller's environment, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and a
free ``MASTER_PORT`` set, a process group already initialised (gloo on CPU,
NCCL when ``backend='nccl'``), and, on CPU, the test-only Megatron shims of
:mod:`megatron_ext.testing.cpu_compat` installed. ``body(*args, **kwargs)``
runs on every rank; its return value comes back in rank order.

Failures never hang the caller: an exception on any rank, a rank that dies, or a
job that outlives ``timeout`` seconds raises :class:`RankFailure` with every
rank's status and traceback; the remaining ranks are killed. So does a process
the job depends on that dies (``watch``, e.g. a receiver the ranks send to).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import random
import socket
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any
from collections.abc import Callable, Sequence

import torch

__all__ = ["RankFailure", "free_port", "run_on_ranks", "run_two_jobs"]

# After one rank fails, how long the others get to report their own error
# (a peer blocked in a collective usually fails fast once its partner is gone).
_GRACE_AFTER_FAILURE_S = 5.0


class RankFailure(RuntimeError):
    """A multi-rank job failed: raised in the launching process."""


_PORTS = random.SystemRandom()  # not the seeded module RNG: processes seeded alike would pick alike


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, below the kernel's ephemeral range: a port
    picked now may be bound much later (a job started after others), and one from that range (bind
    to 0) can meanwhile become the local end of any outgoing connection (gloo, torchrun), making
    that bind fail with EADDRINUSE."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = _PORTS.randrange(10000, max(low, 10001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000..{low - 1}")


def _write_result(path: str, payload: dict) -> None:
    buf = io.BytesIO()
    torch.save(payload, buf)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)


def _rank_main(fn, args, kwargs, rank, world_size, port, backend, pg_timeout_s, env, out_dir, exact_env=False):
    if exact_env:  # forked from the forkserver: its environment is the server's, not the caller's now
        os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    # Third-party start-up chatter (no Apex/TE, deprecations) would drown test output.
    warnings.filterwarnings("ignore", module=r"(megatron|torch)(\.|$)")
    try:
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            from megatron_ext.testing import cpu_compat

            cpu_compat.install()
        kw = {}
        if backend == "nccl":
            kw["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
            **kw,
        )
        try:
            value = fn(*args, **kwargs)
        finally:
            _teardown()
        _write_result(result_path, {"ok": True, "value": value})
    except BaseException:  # noqa: BLE001 - every failure goes back to the launcher
        _write_result(result_path, {"ok": False, "error": traceback.format_exc()})
        os._exit(1)


def _teardown():
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - megatron may not be in use
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


# What every CPU rank imports (megatron-core alone takes about 5 s of a core): the forkserver imports it once
# and forks each rank from there, instead of each spawned rank importing it again.
_PRELOAD = ["torch", "torch.distributed", "megatron.core"]


def _context(backend: str):
    """The start method of a job's ranks and whether they are forked: gloo jobs on a machine without a
    visible GPU fork from a forkserver that preloaded :data:`_PRELOAD` (nothing in it touches CUDA);
    everything else is spawned (NCCL ranks must not inherit a process that imported CUDA libraries)."""
    if backend == "gloo" and torch.cuda.device_count() == 0 and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
        return ctx, True
    return multiprocessing.get_context("spawn"), False


def _read_result(path: str):
    if not os.path.exists(path):
        return None
    return torch.load(path, weights_only=False)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    *,
    backend: str | None = None,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    watch: Callable[[], str | None] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return each
    rank's return value in rank order.

    ``fn`` must be importable by the spawned processes (a module-level function).
    ``backend`` defaults to NCCL when there are at least ``world_size`` GPUs,
    else gloo. Collectives time out after 75% of ``timeout`` so a hung one
    surfaces as an error on its rank; the whole job is killed at ``timeout``.
    ``watch()`` is polled while the ranks run: a message (e.g. "the receiver
    process exited with code 1: ...") kills the ranks and heads the
    :class:`RankFailure`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend is None:
        backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"backend='nccl' with world_size={world_size} needs {world_size} GPUs "
            f"(NCCL refuses two ranks on one GPU); found {torch.cuda.device_count()}"
        )
    ctx, forked = _context(backend)
    # a spawned rank inherits the caller's environment; a forked one gets all of it passed
    child_env = dict(os.environ) if forked else {}
    child_env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    child_env.update(env or {})
    pg_timeout_s = max(5.0, 0.75 * timeout)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="megatron_ext_ranks_") as out_dir:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    fn,
                    tuple(args),
                    dict(kwargs or {}),
                    r,
                    world_size,
                    port,
                    backend,
                    pg_timeout_s,
                    child_env,
                    out_dir,
                    forked,
                ),
                name=f"rank{r}",
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at = None
        timed_out = False
        watched = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if watch is not None and (watched := watch()) is not None:
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > _GRACE_AFTER_FAILURE_S:
                break
            if now > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        still_running = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        results = [_read_result(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]

    if not timed_out and watched is None and all(res is not None and res["ok"] for res in results):
        return [res["value"] for res in results]

    lines = [f"{world_size}-rank job ({backend}) of {getattr(fn, '__qualname__', fn)} failed"]
    if timed_out:
        lines[0] += f": timed out after {timeout:.0f}s"
    if watched is not None:
        lines[0] += f", stopped because {watched}"
    for r, (p, res) in enumerate(zip(procs, results)):
        if res is not None and res["ok"]:
            status = "ok"
        elif res is not None:
            status = "raised"
        elif r in still_running:
            status = "killed (still running)" if watched is not None else "killed (still running: hung?)"
        else:
            status = f"died with exit code {p.exitcode} before reporting"
        lines.append(f"--- rank {r}: {status}")
        if res is not None and not res["ok"]:
            lines.append(res["error"].rstrip())
    raise RankFailure("\n".join(lines))


def run_two_jobs(first: dict, second: dict) -> tuple[list[Any], list[Any]]:
    """Two independent jobs at the same time, each its own :func:`run_on_ranks` world (e.g. a trainer
    job and an engine job that meet in a refit group): ``first`` / ``second`` are ``run_on_ranks``
    keyword arguments (``fn``, ``world_size``, ``args``, ``backend``, ``timeout``, ``env``). Returns both
    jobs' results; if either fails, raises AssertionError with both jobs' errors (the first to fail is
    often the other's cause)."""
    out: dict[str, Any] = {}

    def run(key, job):
        try:
            out[key] = run_on_ranks(**job)
        except BaseException as e:  # noqa: BLE001 - reported below with the other job's
            out[f"{key} error"] = e

    thread = threading.Thread(target=run, args=("second", second))
    thread.start()
    try:
        run("first", first)
    finally:
        thread.join()
    jobs = (("second", second), ("first", first))
    failed = [f"{k} job ({job['fn'].__name__}): {out[k + ' error']}" for k, job in jobs if k + " error" in out]
    if failed:
        raise AssertionError("\n\n".join(failed))
    return out["first"], out["second"]
