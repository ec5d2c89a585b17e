"""Rank bodies shared by the fsdp_symm multi-rank tests (CPU gloo and 2-GPU NCCL)."""

from __future__ import annotations

import contextlib
import json
import warnings

import torch
import torch.distributed as dist

from megatron_ext.testing import tiny_gpt

SPEC = tiny_gpt.TinyGPTSpec()
BUCKET = 4096  # elements: many small buckets of different sizes
GRAD_OPS = ("AllReduce", "ReduceScatter")


def assert_losses_equal(out, rtol):
    """Every rank's staged losses equal its plain baseline's within ``rtol``,
    and the baseline learned."""
    for r in out:
        assert r["base"][-1] < r["base"][0], f"baseline did not learn: {r['base']}"
        for step, (a, b) in enumerate(zip(r["staged"], r["base"])):
            assert abs(a - b) <= rtol * abs(b), f"step {step}: staged {a} vs plain {b}"


def _kernels(prof) -> list[str]:
    return [
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()
    ]


def _count(names, op):
    hits = [n for n in names if op in n]
    symk = [n for n in hits if "symk" in n.lower()]
    return len(hits), len(symk)


def _is_symmetric(buffer, bucket) -> bool:
    for seg in getattr(buffer, "grad_segments", []):
        if any(b is bucket for b in seg.buckets):
            return seg.symmetric
    return False


def _build_ddp(variant, distopt, avg, cfg):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_ext.fsdp_symm import SymmMemDistributedDataParallel, stage_ddp_buffers
    from megatron_ext.testing.symm_standins import standin_pool

    tcfg = tiny_gpt.transformer_config(SPEC)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=distopt,
        bucket_size=BUCKET,
        overlap_grad_reduce=True,
        average_in_collective=avg,
    )
    module = tiny_gpt.build_model(SPEC, tcfg, device=tiny_gpt.rank_device())
    if variant == "plain":
        return DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=module), []
    if variant == "standin":  # the staging layout with plain allocations (CPU)
        ddp = DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=module)
        with standin_pool():
            return ddp, stage_ddp_buffers(ddp, cfg)
    ddp = SymmMemDistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=module, symm_mem_config=cfg)
    return ddp, ddp.symm_mem_decisions


def _train_ddp(ddp, distopt, steps, microbatches, profile_step=None):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt = get_megatron_optimizer(
        # Adam with a large eps updates in proportion to the gradient (like SGD),
        # so a wrong AVG shows in the loss; the distributed optimizer needs Adam.
        OptimizerConfig(
            optimizer="adam", lr=0.2, adam_eps=1.0, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=distopt
        ),
        [ddp],
    )
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    dev = tiny_gpt.rank_device()
    per_rank = 2 * microbatches
    losses, kernels = [], {}
    for step in range(steps):
        tokens, labels = tiny_gpt.global_batch(SPEC, step=step, num_samples=per_rank * dp)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        prof = None
        if step == profile_step:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        total = 0.0
        for m in range(microbatches):
            rows = slice(dp_rank * per_rank + 2 * m, dp_rank * per_rank + 2 * m + 2)
            sync = contextlib.nullcontext() if m == microbatches - 1 else ddp.no_sync()
            with sync:
                loss = tiny_gpt.forward_loss(ddp, tokens[rows].to(dev), labels[rows].to(dev))
                loss = loss / microbatches
                loss.backward()
            total += loss.detach()
        ddp.finish_grad_sync()
        if prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            kernels["grad"] = _kernels(prof)
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        ok, _, _ = opt.step()
        assert ok, f"optimizer step {step} was skipped"
        if prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            kernels["param"] = _kernels(prof)
        mean = torch.as_tensor(total, device=dev).reshape(1).clone()
        dist.all_reduce(mean)
        losses.append((mean / dp).item())
    return losses, kernels


def ddp_parity(distopt, microbatches, steps, avg, staged_variant, mode):
    """Train plain Megatron DDP, then the staged variant, from the same init.

    In ``auto`` mode the band is set to the median bucket size, so some buckets
    are symmetric and some plain. Returns losses, decisions, kernels, warnings.
    """
    from megatron.core import parallel_state as ps

    from megatron_ext.fsdp_symm import SymmMemConfig

    ps.initialize_model_parallel()
    base_ddp, _ = _build_ddp("plain", distopt, False, None)
    sizes = sorted(b.grad_data.numel() * b.grad_data.element_size() for buf in base_ddp.buffers for b in buf.buckets)
    psizes = sorted(
        b.param_data.numel() * b.param_data.element_size()
        for buf in base_ddp.buffers
        for b in buf.buckets
        if b.param_data is not None
    )
    base, _ = _train_ddp(base_ddp, distopt, steps, microbatches)
    del base_ddp
    mid = sizes[len(sizes) // 2]
    pmid = psizes[len(psizes) // 2] if psizes else 0
    cfg = SymmMemConfig(
        mode=mode,
        decide_by="bands",  # the band layout (the step A/B: test_step_ab.py)
        all_reduce_min_bytes=0,
        all_reduce_max_bytes=mid,
        reduce_scatter_min_bytes=0,
        reduce_scatter_max_bytes=mid,
        all_gather_min_bytes=0,
        all_gather_max_bytes=pmid,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp, decisions = _build_ddp(staged_variant, distopt, avg, cfg)
        # A second wrapper in the same process must not warn again.
        if staged_variant == "symm":
            _build_ddp(staged_variant, distopt, avg, cfg)
    ours = [str(w.message) for w in caught if "fsdp_symm" in str(w.message)]
    profile_step = steps - 1 if dist.get_backend() == "nccl" else None
    staged, kernels = _train_ddp(ddp, distopt, steps, microbatches, profile_step)
    buffer = ddp.buffers[0]
    offload = _offload_roundtrip(ddp) if staged_variant == "standin" else None
    layout = {
        "class": type(buffer).__name__,
        "grad_segments": [(s.start, s.end, s.symmetric) for s in getattr(buffer, "grad_segments", [])],
        "param_segments": [(s.start, s.end, s.symmetric) for s in getattr(buffer, "param_segments", [])],
        "grad_data_is_none": buffer.grad_data is None,
        # (average_in_collective, has a symmetric grad bucket) per bucket group
        "groups": [
            (g.ddp_config.average_in_collective, any(_is_symmetric(ddp.buffers[0], b) for b in g.buckets))
            for g in ddp.bucket_groups
        ],
    }
    memories = {
        id(s.memory): s.memory
        for s in getattr(buffer, "grad_segments", []) + getattr(buffer, "param_segments", [])
        if s.symmetric
    }
    rendezvous = sum(m.rendezvous_calls for m in memories.values())
    return dict(
        base=base,
        staged=staged,
        decisions=decisions,
        warnings=ours,
        kernels=kernels,
        layout=layout,
        rendezvous=rendezvous,
        offload=offload,
    )


def _offload_roundtrip(ddp):
    """Megatron's grad-buffer offload/restore on a staged buffer: storage freed,
    then restored zeroed, with ``param.main_grad`` still aliasing the segments."""
    segs = [s for b in ddp.buffers for s in b.grad_segments]
    before = [s.tensor.untyped_storage().nbytes() for s in segs]
    ddp.offload_grad_buffers()
    freed = [s.tensor.untyped_storage().nbytes() for s in segs]
    ddp.restore_grad_buffers()
    after = [s.tensor.untyped_storage().nbytes() for s in segs]
    zero = all(bool((s.tensor == 0).all()) for s in segs)
    ptrs = {s.tensor.untyped_storage().data_ptr() for s in segs}
    aliased = all(
        p.main_grad.untyped_storage().data_ptr() in ptrs
        for b in ddp.buffers
        for bucket in b.buckets
        for p in bucket.params_list
    )
    return dict(before=before, freed=freed, after=after, zero=zero, aliased=aliased)


# --------------------------------------------------------------------- FSDP
FSDP_WIDTHS = (64, 256, 64, 1024, 64)  # Linear(a, b): 64 KiB, 64 KiB, 256 KiB, 256 KiB fp32


def _fsdp_model(variant, cfg, widths=FSDP_WIDTHS, dtype=torch.float32):
    from torch.distributed.device_mesh import init_device_mesh
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import (
        Flat,
        Placements,
        fully_shard as upstream_fully_shard,
        fully_shard_optimizer,
    )
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MixedPrecisionPolicy

    from megatron_ext.fsdp_symm import fully_shard

    dev = tiny_gpt.rank_device()
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    torch.manual_seed(1234)
    layers = [torch.nn.Linear(a, b, bias=False) for a, b in zip(widths[:-1], widths[1:])]
    model = torch.nn.Sequential(*layers).to(device=dev, dtype=dtype)
    placements = Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])
    mp = MixedPrecisionPolicy(main_params_dtype=torch.float32)
    for layer in model:
        if variant == "upstream":
            upstream_fully_shard(layer, mesh=mesh, placements=placements, mixed_precision_policy=mp)
        elif variant == "upstream-symm":
            upstream_fully_shard(layer, mesh=mesh, placements=placements, mixed_precision_policy=mp, use_symm_mem=True)
        else:
            fully_shard(layer, mesh=mesh, placements=placements, mixed_precision_policy=mp, symm_mem_config=cfg)
    # SGD: the update scales with the gradient, so a wrong AVG would show in the loss.
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fully_shard_optimizer(opt)
    return model, opt


def _fsdp_batch(step, m, width_in, width_out, dtype):
    g = torch.Generator().manual_seed(100 * step + 10 * m + dist.get_rank())
    return torch.randn(8, width_in, generator=g).to(dtype), torch.randn(8, width_out, generator=g).to(dtype)


def train_fsdp(model, opt, steps, microbatches, profile_step=None, widths=FSDP_WIDTHS, dtype=torch.float32, start=0):
    dev = tiny_gpt.rank_device()
    losses, kernels = [], []
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        prof = None
        if step == profile_step:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        total = torch.zeros((), device=dev)
        for m in range(microbatches):
            x, y = _fsdp_batch(step, m, widths[0], widths[-1], dtype)
            loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).float() / microbatches
            loss.backward()
            total += loss.detach()
        opt.step()
        if prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            kernels = _kernels(prof)
        dist.all_reduce(total)
        losses.append((total / dist.get_world_size()).item())
    return losses, kernels


def _fsdp_groups(model):
    from megatron_ext.fsdp_symm.fsdp import SymmFsdpModule

    return [g for layer in model if isinstance(layer, SymmFsdpModule) for g in layer.parameter_groups]


def fsdp_parity(microbatches, steps, mode, max_bytes):
    """Upstream plain experimental FSDP vs ours with ``mode`` and an AG/RS band
    ``[0, max_bytes]``. Returns losses, decisions, kernels, windows, warnings."""
    from megatron_ext.fsdp_symm import SymmMemConfig

    model, opt = _fsdp_model("upstream", None)
    base, _ = train_fsdp(model, opt, steps, microbatches)
    del model, opt
    cfg = SymmMemConfig(
        mode=mode,
        decide_by="bands",
        all_gather_min_bytes=0,
        all_gather_max_bytes=max_bytes,
        reduce_scatter_min_bytes=0,
        reduce_scatter_max_bytes=max_bytes,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _fsdp_model("ours", cfg)
        groups = _fsdp_groups(model)
        decisions = [(g.all_gather_decision, g.reduce_scatter_decision) for g in groups]
        ours, _ = train_fsdp(model, opt, 1, microbatches)
        after_first = sum(g.symm.rendezvous_calls for g in groups if g.symm is not None)
        profile_step = steps - 1 if dist.get_backend() == "nccl" else None
        more, kernels = train_fsdp(model, opt, steps - 1, microbatches, profile_step, start=1)
    after_last = sum(g.symm.rendezvous_calls for g in groups if g.symm is not None)
    warned = [str(w.message) for w in caught if "fsdp_symm" in str(w.message)]
    return dict(
        base=base,
        staged=ours + more,
        decisions=decisions,
        kernels=kernels,
        windows=(after_first, after_last),
        warnings=warned,
    )


def fsdp_standin_parity(microbatches, steps, max_bytes):
    """The symmetric code paths of our FSDP groups on CPU: the probe reports
    available and plain allocations stand in for the pool (``standin_pool``:
    test-only patches of our own module). Returns upstream and staged losses
    and the decisions."""
    from megatron_ext.fsdp_symm import SymmMemConfig
    from megatron_ext.testing.symm_standins import standin_pool

    model, opt = _fsdp_model("upstream", None)
    base, _ = train_fsdp(model, opt, steps, microbatches)
    del model, opt
    cfg = SymmMemConfig(
        mode="auto",
        decide_by="bands",
        all_gather_min_bytes=0,
        all_gather_max_bytes=max_bytes,
        reduce_scatter_min_bytes=0,
        reduce_scatter_max_bytes=max_bytes,
    )
    with standin_pool():
        model, opt = _fsdp_model("ours", cfg)
    groups = _fsdp_groups(model)
    staged, _ = train_fsdp(model, opt, steps, microbatches)
    decisions = [(g.all_gather_decision, g.reduce_scatter_decision) for g in groups]
    scratch = [g._reduce_scratch is not None for g in groups]
    from megatron_ext.fsdp_symm import release_symmetric_memory

    pooled = [t for g in groups for t in g.symm_release_tensors()]
    total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pooled}.values())
    freed = release_symmetric_memory(model)
    after = [t.untyped_storage().nbytes() for t in pooled]
    return dict(base=base, staged=staged, decisions=decisions, scratch=scratch, release=(total, freed, after))


# ------------------------------------------------------------- release, placement
def ddp_fallback_and_release(distopt, steps):
    """Plain DDP, then the staging layout where the first symmetric segment's
    placement check fails (it must fall back to plain, say so, and still train
    like plain), then release_symmetric_memory frees every staged segment."""
    from megatron.core import parallel_state as ps

    from megatron_ext.fsdp_symm import SymmMemConfig, release_symmetric_memory, stage_ddp_buffers
    from megatron_ext.testing.symm_standins import MismatchStandIn, standin_pool

    ps.initialize_model_parallel()
    base_ddp, _ = _build_ddp("plain", distopt, False, None)
    base, _ = _train_ddp(base_ddp, distopt, steps, 1)
    del base_ddp
    cfg = SymmMemConfig(mode="on", report=False)
    ddp, _ = _build_ddp("plain", distopt, False, None)
    MismatchStandIn.raised = False
    with warnings.catch_warnings(record=True) as caught, standin_pool(MismatchStandIn):
        warnings.simplefilter("always")
        decisions = stage_ddp_buffers(ddp, cfg)
    staged, _ = _train_ddp(ddp, distopt, steps, 1)
    segments = [s for b in ddp.buffers for s in b.grad_segments + b.param_segments]
    total = sum(s.tensor.untyped_storage().nbytes() for s in segments)
    freed = release_symmetric_memory(ddp)
    after = [s.tensor.untyped_storage().nbytes() for s in segments]
    return dict(
        base=base,
        staged=staged,
        decisions=decisions,
        total=total,
        freed=freed,
        after=after,
        warnings=[str(w.message) for w in caught],
        segments=[(s.symmetric, s.fallback) for s in segments],
    )


def placement_check():
    """SymmetricMemory's cross-rank placement check over the group: silent when
    every rank has the same placement, SymmetricPlacementMismatch on every rank
    when one differs."""
    from megatron_ext.fsdp_symm.memory import SymmetricMemory, SymmetricPlacementMismatch

    mem = SymmetricMemory.__new__(SymmetricMemory)
    mem.group = dist.group.WORLD
    out = {}
    for case, mine in (("same", (0, 1 << 21, 0, 4096)), ("differ", (dist.get_rank() - 1, 1 << 21, 0, 4096))):
        mem.placement = lambda tensor, mine=mine: mine
        try:
            mem._check_placement(torch.empty(1))
            out[case] = "ok"
        except SymmetricPlacementMismatch as exc:
            out[case] = str(exc)
    return out


def _windows_by_group():
    from megatron_ext.fsdp_symm import memory

    return {group: len(wins) for (_, group), wins in memory._WINDOWS.items()}


def staged_models_lifecycle(builds, steps):
    """Build, train and release ``builds`` staged DDP models (distributed
    optimizer, every bucket symmetric) and two staged FSDP models in one
    process, recording the NCCL windows after each build; then build one more
    DDP model after releasing the previous one on rank 0 only (the ranks' pools
    diverge: its placement check must make both ranks fall back, not fail)."""
    from megatron.core import parallel_state as ps

    from megatron_ext.fsdp_symm import SymmMemConfig, release_symmetric_memory

    ps.initialize_model_parallel()
    cfg = SymmMemConfig(mode="on", report=False)
    ddp_losses, ddp_windows, freed = [], [], []
    for _ in range(builds):
        ddp, decisions = _build_ddp("symm", True, True, cfg)
        assert all(d.symmetric for _, d in decisions), decisions
        losses, _ = _train_ddp(ddp, True, steps, 1)
        ddp_losses.append(losses)
        ddp_windows.append(_windows_by_group())
        freed.append(release_symmetric_memory(ddp))
        del ddp
    fsdp_windows = []  # (group, windows before construction, after it, after training)
    for _ in range(2):
        before = _windows_by_group()
        model, opt = _fsdp_model("ours", SymmMemConfig(mode="on", report=False))
        group = _fsdp_groups(model)[0].symm.group_name
        built = _windows_by_group()[group]
        train_fsdp(model, opt, steps, 1)
        fsdp_windows.append((group, before.get(group, 0), built, _windows_by_group()[group]))
        release_symmetric_memory(model)
        del model, opt
    kept, _ = _build_ddp("symm", True, True, cfg)
    if dist.get_rank() == 0:
        release_symmetric_memory(kept)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp, decisions = _build_ddp("symm", True, True, cfg)
    diverged, _ = _train_ddp(ddp, True, steps, 1)
    return dict(
        ddp_losses=ddp_losses,
        ddp_windows=ddp_windows,
        freed=freed,
        fsdp_windows=fsdp_windows,
        diverged=diverged,
        decisions=decisions,
        warnings=[str(w.message) for w in caught if "fsdp_symm" in str(w.message)],
    )


# ------------------------------------------------------------- probed bands
MIB = 1 << 20
FAKE_BANDS = {"all_gather": (MIB, 32 * MIB), "reduce_scatter": None, "all_reduce": (0, 4 * MIB)}
FAKE_BANDS_FP32 = {"all_gather": (MIB, 32 * MIB), "reduce_scatter": (2 * MIB, 16 * MIB), "all_reduce": (0, 8 * MIB)}


def _fake_measure(calls):
    """A stand-in for probe.measure_bands (no GPU): fixed bands, counts its calls."""
    from megatron_ext.fsdp_symm.probe import MeasuredBands

    def measure(group=None, device=None, **kwargs):
        calls.append(dist.get_world_size(group))
        return MeasuredBands(
            bands=dict(FAKE_BANDS),
            bands_fp32=dict(FAKE_BANDS_FP32),
            ranks=dist.get_world_size(group),
            seconds=1.5,
            date="2026-01-01T00:00:00+00:00",
            rows=({"nbytes": MIB},),
        )

    return measure


def band_cache_and_resolve(path):
    """The band cache over a gloo group, with a stand-in measurement: a miss
    measures on every rank and rank 0 writes; a hit measures nothing; a corrupt
    file warns once and counts as a miss; resolve_config leaves an unavailable
    group's config alone, and (with the capability probe standing in as
    available) applies the bands once per group of ranks."""
    import json
    from unittest import mock

    from megatron_ext.fsdp_symm import SymmMemConfig, probe as probe_mod
    from megatron_ext.fsdp_symm.capability import Capability
    from megatron_ext.fsdp_symm.policy import REPORTER

    calls, out = [], {}
    world = dist.group.WORLD
    cpu = torch.device("cpu")
    with mock.patch.object(probe_mod, "measure_bands", _fake_measure(calls)):
        first = probe_mod.load_bands(world, cpu, path)
        out["miss"] = (first.source, first.bands, first.bands_fp32, len(calls))
        dist.barrier()
        with open(path) as f:
            out["file_after_miss"] = json.load(f)
        second = probe_mod.load_bands(world, cpu, path)
        out["hit"] = (second.source, second.bands, second.bands_fp32, second.seconds, second.key, len(calls))
        dist.barrier()
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                f.write("{not json")
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            third = probe_mod.load_bands(world, cpu, path)
        out["corrupt"] = (third.source, len(calls), [str(w.message) for w in caught])
        dist.barrier()
        with open(path) as f:
            out["file_after_corrupt"] = json.load(f)

        # A timed run is repeated on every rank when any rank's host was late (rank 0 here), on none otherwise.
        out["late"] = (probe_mod._any_late(dist.get_rank() == 0, world, cpu), probe_mod._any_late(False, world, cpu))

        # gloo: the real capability probe says unavailable, so nothing is probed.
        cfg = SymmMemConfig(bands="probe", probe_cache=path)
        before = len(calls)
        out["gloo_resolve"] = (probe_mod.resolve_config(cfg, world, cpu) is cfg, len(calls) - before)

        # The capability stands in as available: bands applied, loaded once per ranks.
        one = dist.new_group([0])
        with mock.patch.object(probe_mod.capability, "probe", lambda group=None: Capability(True, "stand-in")):
            os_path = path + ".resolve"
            cfg = SymmMemConfig(bands="probe", probe_cache=os_path, all_reduce_max_bytes=2 * MIB)
            resolved = [probe_mod.resolve_config(cfg, world, cpu) for _ in range(3)]
            out["resolved"] = (resolved[0], all(r == resolved[0] for r in resolved), len(calls) - before)
            # A 1-rank group is not probed (rank 0 alone: collective over [0] only).
            out["one_rank"] = probe_mod.resolve_config(cfg, one, cpu) is cfg if dist.get_rank() == 0 else None
            # bands="measured" on a group of another size: a note, the config as is.
            plain = SymmMemConfig()
            out["measured_other_size"] = (
                probe_mod.resolve_config(plain, one, cpu) is plain if dist.get_rank() == 0 else None
            )
        out["notes"] = list(REPORTER.notes)
        REPORTER.notes = []
    return out


def _first_collectives(dev):
    """The collectives the probe uses, once, so that what their first calls
    keep allocated is not counted as the probe's."""
    dist.broadcast_object_list([None], src=0)
    dist.all_reduce(torch.ones(1, device=dev))
    torch.cuda.synchronize()


def probe_on_gpus(path):
    """The real probe over NCCL: bands measured and cached, a second load hits
    the cache without timing anything, a DDP staged with bands="probe" decides
    with the probed bands; and a probe with the kernel check (its rows)."""
    import json
    from unittest import mock

    from megatron.core import parallel_state as ps

    from megatron_ext.fsdp_symm import SymmMemConfig, decide, probe as probe_mod
    from megatron_ext.fsdp_symm.memory import window_stats

    world = dist.group.WORLD
    dev = tiny_gpt.rank_device()
    _first_collectives(dev)
    before = torch.cuda.memory_allocated(dev)
    measured = probe_mod.load_bands(world, dev, path)
    out = dict(
        source=measured.source,
        bands=measured.bands,
        bands_fp32=measured.bands_fp32,
        seconds=measured.seconds,
        allocated_delta=torch.cuda.memory_allocated(dev) - before,
        windows=window_stats(dev, world.group_name),
    )
    # With the kernel check (off in staging: it costs a profiler start-up).
    checked = probe_mod.measure_bands(world, dev, check_kernels=True)
    out["rows"] = [{k: v for k, v in r.items() if not k.endswith("runs_us")} for r in checked.rows]
    dist.barrier()
    with open(path) as f:
        out["file"] = json.load(f)

    def no_timing(*args, **kwargs):
        raise AssertionError("a cache hit must not time anything")

    with mock.patch.object(probe_mod, "measure_bands", no_timing):
        again = probe_mod.load_bands(world, dev, path)
        out["again"] = (again.source, again.bands, again.bands_fp32)
        # Staging with bands="probe": the DDP's group gets the cached bands.
        ps.initialize_model_parallel()
        cfg = SymmMemConfig(bands="probe", probe_cache=path, all_gather_min_bytes=0, decide_by="bands")
        ddp, decisions = _build_ddp("symm", True, True, cfg)
    resolved = probe_mod.apply_bands(cfg, again)
    expected = []
    for buffer in ddp.buffers:
        for bucket in buffer.buckets:
            grad = bucket.grad_data
            expected.append(decide("reduce_scatter", grad.numel() * grad.element_size(), resolved, None, grad.dtype))
            param = bucket.param_data
            expected.append(decide("all_gather", param.numel() * param.element_size(), resolved, None, param.dtype))
    out["decisions"] = [d for _, d in decisions]
    out["expected"] = expected
    from megatron_ext.fsdp_symm.policy import REPORTER

    out["report"] = REPORTER.last_report
    from megatron_ext.fsdp_symm import release_symmetric_memory

    release_symmetric_memory(ddp)
    return out


def probe_on_one_gpu(path):
    """One GPU, one rank: the probe's machinery runs (buffers, timed runs, the
    cache) and returns its symmetric buffers to the pool; resolve_config leaves a
    1-rank group's config alone."""
    from megatron_ext.fsdp_symm import SymmMemConfig, probe as probe_mod
    from megatron_ext.fsdp_symm.policy import REPORTER

    dev = tiny_gpt.rank_device()
    _first_collectives(dev)
    before = torch.cuda.memory_allocated(dev)
    measured = probe_mod.load_bands(dist.group.WORLD, dev, path)
    cfg = SymmMemConfig(bands="probe", probe_cache=path)
    same = probe_mod.resolve_config(cfg, dist.group.WORLD, dev) is cfg
    notes = list(REPORTER.notes)
    REPORTER.notes = []
    return dict(
        source=measured.source,
        seconds=measured.seconds,
        rows=[{k: v for k, v in r.items() if not k.endswith("runs_us")} for r in measured.rows],
        allocated_delta=torch.cuda.memory_allocated(dev) - before,
        same=same,
        notes=notes,
        again=probe_mod.load_bands(dist.group.WORLD, dev, path).source,
    )


# ------------------------------------------------------------- auto by the step (the A/B)
class FakeClock:
    """Step times for the step A/B without a device: a step lasts ``cost(arm, n)`` ms,
    ``arm`` the one in effect when it ends (the A/B marks a step's end before it
    switches arms), ``n`` the mark's number."""

    def __init__(self, ab, cost):
        self.ab, self.cost, self.t, self.n = ab, cost, 0.0, 0

    def mark(self):
        if self.n:
            self.t += self.cost(self.ab.arm, self.n)
        self.n += 1
        return self.t

    def elapsed_ms(self, start, end):
        return end - start

    def sync(self):
        pass


# Per arm, ms per step: "on" clearly fastest; "noise": on 0.6% faster than plain but the steps
# jitter by +-2 ms, far more than that (a rule without a noise threshold would take it).
STEP_COSTS = {
    "on_wins": {"plain": 100.0, "bands": 90.0, "on": 80.0},
    "noise": {"plain": 100.0, "bands": 100.3, "on": 99.4},
}
JITTER = (2.0, -2.0, 1.5, -1.5, 0.0)


def _cost(case):
    base = STEP_COSTS[case]

    def cost(arm, n):
        # Rank 1 is slower on odd steps: the agreed time is the slowest rank's.
        return base[arm] + JITTER[n % len(JITTER)] + (0.7 if dist.get_rank() == 1 and n % 2 else 0.0)

    return cost


AB = dict(ab_warmup_steps=1, ab_steps=3, ab_rounds=1)


def _ab_config(path, mid, pmid):
    from megatron_ext.fsdp_symm import SymmMemConfig

    return SymmMemConfig(
        mode="auto",
        report=False,
        probe_cache=path,
        all_reduce_min_bytes=0,
        all_reduce_max_bytes=mid,
        reduce_scatter_min_bytes=0,
        reduce_scatter_max_bytes=mid,
        all_gather_min_bytes=0,
        all_gather_max_bytes=pmid,
        **AB,
    )


def _segments(ddp):
    return [
        s.symmetric for b in ddp.buffers for s in getattr(b, "grad_segments", []) + getattr(b, "param_segments", [])
    ]


def ddp_step_ab(path, steps):
    """The step A/B of a staged DDP on gloo (plain allocations stand in for the pool, a
    fake clock for the device): per case, plain Megatron DDP's losses, then ours with
    ``auto`` deciding by the step; the arms it ran, what it chose, the final layout,
    the losses and the cache; then a second model of the same layout (a cache hit)."""
    from megatron.core import parallel_state as ps

    from megatron_ext.fsdp_symm import release_symmetric_memory, step_ab_of
    from megatron_ext.testing.symm_standins import standin_pool

    ps.initialize_model_parallel()
    base_ddp, _ = _build_ddp("plain", True, False, None)
    sizes = sorted(b.grad_data.numel() * b.grad_data.element_size() for buf in base_ddp.buffers for b in buf.buckets)
    psizes = sorted(b.param_data.numel() * b.param_data.element_size() for buf in base_ddp.buffers for b in buf.buckets)
    base, _ = _train_ddp(base_ddp, True, steps, 1)
    del base_ddp
    out = dict(base=base)
    for case in STEP_COSTS:
        cfg = _ab_config(f"{path}.{case}", sizes[len(sizes) // 2], psizes[len(psizes) // 2])
        with standin_pool():
            ddp, start = _build_ddp("symm", True, True, cfg)
        ab = step_ab_of(ddp)
        ab.clock = FakeClock(ab, _cost(case))
        start_layout = _segments(ddp)
        staged, _ = _train_ddp(ddp, True, steps, 1)
        out[case] = dict(
            staged=staged,
            start=[d.symmetric for _, d in start],
            start_layout=start_layout,
            arms=ab.arms,
            state=ab.state,
            arm=ab.arm,
            switches=list(ab.switches),
            total_steps=ab.total_steps,
            choice=ab.choice.as_dict(),
            durations=list(ab.durations_ms),
            layout=_segments(ddp),
            decisions=[(d.symmetric, d.reason) for _, d in ddp.symm_mem_decisions],
        )
        release_symmetric_memory(ddp)
        del ddp
        dist.barrier()
        with open(f"{path}.{case}") as f:
            out[case]["file"] = json.load(f)
        # The same layout again: the cached arm from construction on, nothing timed.
        with standin_pool():
            ddp, decisions = _build_ddp("symm", True, True, cfg)
        ab = step_ab_of(ddp)
        ab.clock = None  # a timed step would fail here
        again, _ = _train_ddp(ddp, True, 3, 1)
        out[case]["cached"] = dict(
            state=ab.state,
            arm=ab.arm,
            layout=_segments(ddp),
            decisions=[d.symmetric for _, d in decisions],
            staged=again,
        )
        release_symmetric_memory(ddp)
        del ddp
    return out


def fsdp_step_ab(path, steps, microbatches):
    """The step A/B of our FSDP on gloo (stand-in pool, fake clock): upstream plain FSDP's
    losses, then ours deciding by the step (four roots, one A/B over all their groups):
    what it chose, the groups' final decisions, the losses; then a cache hit."""
    from megatron_ext.fsdp_symm import release_symmetric_memory, step_ab_of
    from megatron_ext.testing.symm_standins import standin_pool

    model, opt = _fsdp_model("upstream", None)
    base, _ = train_fsdp(model, opt, steps, microbatches)
    del model, opt
    cfg = _ab_config(path, 128 << 10, 128 << 10)
    out = dict(base=base)
    with standin_pool():
        model, opt = _fsdp_model("ours", cfg)
    first, _ = train_fsdp(model, opt, 1, microbatches)  # the first forward builds the A/B
    ab = step_ab_of(model)
    ab.clock = FakeClock(ab, _cost("on_wins"))
    more, _ = train_fsdp(model, opt, steps - 1, microbatches, start=1)
    groups = _fsdp_groups(model)
    out.update(
        staged=first + more,
        arms=ab.arms,
        state=ab.state,
        arm=ab.arm,
        switches=list(ab.switches),
        total_steps=ab.total_steps,
        steps_seen=ab.steps_seen,
        one_ab=all(g._symm_ab is ab for g in groups),
        decisions=[(g.all_gather_decision.symmetric, g.reduce_scatter_decision.symmetric) for g in groups],
        on=[(g._arms["on"][0].symmetric, g._arms["on"][1].symmetric) for g in groups],
        scratch=[g._reduce_scratch is not None for g in groups],
    )
    release_symmetric_memory(model)
    del model, opt
    with standin_pool():
        model, opt = _fsdp_model("ours", cfg)
    again, _ = train_fsdp(model, opt, 2, microbatches)
    ab = step_ab_of(model)
    out["cached"] = dict(
        state=ab.state,
        arm=ab.arm,
        decisions=[(g.all_gather_decision.symmetric, g.reduce_scatter_decision.symmetric) for g in _fsdp_groups(model)],
        staged=again,
    )
    release_symmetric_memory(model)
    return out
