"""Reproduce the NCCL window-registration failure of staged models built one
after another in one process, and show what the placement check does instead.

    NCCL_DEBUG=WARN python benchmarks/symm_mem_window_repro.py [--out repro.json]

Needs 2 GPUs. Three 2-rank jobs:

1. ``gc``: a staged DDP model (every bucket symmetric) is dropped with ``del``;
   its symmetric segments stay in use until Python's cyclic GC runs (Megatron's
   DDP holds reference cycles), which happens at different times on different
   ranks. Reports the pool's active bytes per rank before and after
   ``gc.collect()``.
2. ``mismatch``: the consequence, without our placement check: rank 0 frees a
   registered 258 MiB pool buffer, rank 1 still holds it; both allocate 258 MiB
   (rank 0 reuses the registered segment, rank 1 needs a new one and calls the
   collective ``ncclCommWindowRegister``), then 64 MiB (rank 0 now registers a
   new segment too). The two registrations pair up across ranks with different
   sizes: expected "Failed to window register segment ... size 270532608".
3. ``checked``: the same sequence through ``SymmetricMemory.register(check=True)``:
   both ranks raise ``SymmetricPlacementMismatch`` before registering.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MIB = 1 << 20


def _active_bytes(pool) -> int:
    return sum(seg.get("active_size", 0) for seg in pool.snapshot())


def gc_body():
    from megatron.core import parallel_state as ps

    from megatron_ext.fsdp_symm import SymmMemConfig
    from megatron_ext.fsdp_symm.memory import _POOLS
    from tests.unit_tests.fsdp_symm._bodies import _build_ddp, _train_ddp

    ps.initialize_model_parallel()
    ddp, _ = _build_ddp("symm", True, True, SymmMemConfig(mode="on", report=False))
    _train_ddp(ddp, True, 1, 1)
    pool = _POOLS[torch.device("cuda", torch.cuda.current_device())]
    torch.cuda.synchronize()
    held = _active_bytes(pool)
    del ddp
    after_del = _active_bytes(pool)
    unreachable = gc.collect()
    torch.cuda.synchronize()
    after_gc = _active_bytes(pool)
    return dict(
        active_while_held=held, active_after_del=after_del, gc_unreachable_objects=unreachable, active_after_gc=after_gc
    )


def mismatch_body(check):
    from megatron_ext.fsdp_symm.capability import probe
    from megatron_ext.fsdp_symm.memory import SymmetricMemory

    group = dist.group.WORLD
    assert probe(group).available
    mem = SymmetricMemory(torch.device("cuda", torch.cuda.current_device()), group)
    a = mem.empty(258 * MIB // 4, torch.float32, check=check)
    torch.cuda.synchronize()
    if dist.get_rank() == 0:
        del a
    events = []
    try:
        b = mem.empty(258 * MIB // 4, torch.float32, check=check)
        events.append(("258 MiB", mem.placement(b)))
        c = mem.empty(64 * MIB // 4, torch.float32, check=check)
        events.append(("64 MiB", mem.placement(c)))
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the point of the experiment
        events.append(("raised", f"{type(exc).__name__}: {exc}"))
        if not check:
            # The peer is stuck inside NCCL's registration: report and leave now
            # (a normal teardown would wait for it).
            print(f"rank {dist.get_rank()}: {events}", flush=True)
            os._exit(3)
    return events


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="symm_mem_window_repro.json")
    args = parser.parse_args()
    from megatron_ext.testing.multirank import RankFailure, run_on_ranks

    result = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    for name, fn, fargs, timeout in (
        ("gc", gc_body, (), 120),
        ("checked", mismatch_body, (True,), 60),
        ("mismatch", mismatch_body, (False,), 45),
    ):
        try:
            result[name] = run_on_ranks(fn, 2, args=fargs, backend="nccl", timeout=timeout)
        except RankFailure as exc:
            result[name] = {"rank_failure": str(exc)[-4000:]}
        print(name, json.dumps(result[name], default=str)[:3000], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
