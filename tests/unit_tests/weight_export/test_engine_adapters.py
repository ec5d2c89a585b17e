"""The engine adapters (vLLM's and SGLang's own weight-update protocols, trainer side) against
STAND-INS of the engines: megatron_ext.testing.engine_standins implements the engine side the
way vLLM's and SGLang's sources do (group creation, receive order, packed / flattened bucket
unpacking, weight version); the real engines cannot be installed here, so nothing below runs
vLLM or SGLang themselves.

One 3-rank CPU gloo job: rank 0 is a Megatron trainer exporting a tiny Qwen3 through
WeightExporter(sender=adapter); ranks 1 and 2 are the two TP ranks of every stand-in engine.
vLLM's ipc backend needs CUDA IPC: on CPU its stand-in runs inside the trainer process, the
handles made and opened by engine_standins.CudaIpcStandin (same tuple layout, no CUDA).
On 2 GPUs (NCCL) the engine has one rank on GPU 1, and the cases that exist on GPUs run: the
vLLM stand-in's group is torch NCCL behind the adapter's PyNccl wrapper, SGLang's group is NCCL
over a Megatron world bound to its device; on 1 GPU (colocated) SGLang's tensor route and vLLM's
ipc backend share the export buffers through CUDA IPC with an engine process on the same GPU.
Each case exports two versions and compares the engine's tensors with the trainer's HF
tensors, written out by hand (tests/unit_tests/weight_export/_reference.py). Closing an adapter
releases its group as NCCL requires (never one end alone): SGLang's with the engine
(destroy_weights_update_group), the vLLM stand-ins' at the end of the job on every rank
(engine_standins.release_groups); the in-process tests below check that order against a group
with NCCL's teardown rule."""

import contextlib
import faulthandler
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing import engine_standins as es
from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import free_port, run_on_ranks
from megatron_ext.weight_export.engines.adapters import make_adapter
from megatron_ext.weight_export.engines.adapters.base import Packer, aligned_requests, region, threshold_chunks
from megatron_ext.weight_export.engines.adapters.vllm import VllmIpcSender
from megatron_ext.weight_export.plan.export_plan import BucketMeta, TensorMeta
from megatron_ext.weight_export.plan.wire import align

from ._reference import reference_for, snapshot

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen3", num_layers=2)
KEY = b"engine-adapter-standin-test"
FAULT_TIMEOUT_S = 6.0
JOB_TIMEOUT_S = 300
TEARDOWN_LIMIT_S = 20.0  # gloo jobs: how long an end torn down alone waits (es.nccl_teardown_rule; NCCL: forever)

# case -> (adapter, adapter kwargs, stand-in, stand-in kwargs, how the front end merges the ranks' answers)
CASES = {
    "vllm-packed": ("vllm", dict(check_version=True), "vllm", dict(era="update_info"), "raise"),
    "vllm-packed-init-info-small-chunks": (
        "vllm",
        dict(packed_params_in="init_info", packed_buffer_size_bytes=3000),
        "vllm",
        dict(era="init_info"),
        "raise",
    ),
    "vllm-unpacked": ("vllm", dict(packed=False), "vllm", dict(era="update_info"), "raise"),
    "vllm-rpc": ("vllm-rpc", {}, "vllm-ext", {}, "raise"),
    "sglang-flattened": ("sglang-distributed", dict(backend="gloo", check_version=True), "sglang", {}, "sglang"),
    "sglang-per-tensor": ("sglang-distributed", dict(backend="gloo", flattened=False), "sglang", {}, "sglang"),
    "sglang-by-dtype-old-bucket": (
        "sglang-distributed",
        dict(backend="gloo", group_by_dtype=True),
        "sglang",
        dict(multi_dtypes=False),
        "sglang",
    ),
    "sglang-tensor": (
        "sglang-tensor",
        dict(check_version=True, publish_version="last_request"),
        "sglang",
        {},
        "sglang",
    ),
}
FAULTS = {
    # The engine refuses update_info at once (an engine whose packed flag travels in init_info):
    # the trainer, already broadcasting, must fail with the engine's error, not wait for the group.
    "fault-vllm-refuses-update-info": ("vllm", dict(timeout_s=FAULT_TIMEOUT_S), "vllm", dict(era="init_info"), "raise"),
    # The engine's model lacks lm_head.weight: it fails loading after receiving that bucket.
    "fault-vllm-unknown-name": ("vllm", dict(timeout_s=FAULT_TIMEOUT_S), "vllm", dict(era="update_info"), "raise"),
    # A NaN in the trainer's weights: every bucket reaches the engine before the hook's check refuses the
    # version, so the version must not be published.
    "fault-sglang-nan": ("sglang-distributed", dict(backend="gloo", check_version=True), "sglang", {}, "sglang"),
    # The engine's model.norm.weight has another shape: SGLang answers success=false.
    "fault-sglang-shape": (
        "sglang-distributed",
        dict(backend="gloo", timeout_s=FAULT_TIMEOUT_S),
        "sglang",
        {},
        "sglang",
    ),
}
# vLLM's ipc backend: on CPU the stand-in is in the trainer's process (CudaIpcStandin); colocated on
# one GPU it is the engine process, reached over the stand-in RPC, whose JSON needs pickled handles.
IPC_CASES = {
    # a slow engine (20 ms per request): a buffer written again before the engine answered would show
    "vllm-ipc": ("vllm-ipc", dict(check_version=True), "vllm-ipc", dict(delay_s=0.02), "raise"),
    "vllm-ipc-packed-pickled": ("vllm-ipc", dict(packed=True, pickle_handles=True), "vllm-ipc", {}, "raise"),
}
IPC_FAULTS = {
    # The engine refuses the second version's first request: the first version stays the engine's.
    "fault-vllm-ipc-refused-version": (
        "vllm-ipc",
        dict(timeout_s=FAULT_TIMEOUT_S),
        "vllm-ipc",
        dict(refuse_session=2),
        "raise",
    ),
    # Pickled handles to an engine without VLLM_ALLOW_INSECURE_SERIALIZATION=1.
    "fault-vllm-ipc-insecure": (
        "vllm-ipc",
        dict(pickle_handles=True, timeout_s=FAULT_TIMEOUT_S),
        "vllm-ipc",
        dict(allow_insecure_serialization=False),
        "raise",
    ),
}

GPU_CASES = ("vllm-packed", "vllm-unpacked", "sglang-flattened", "sglang-per-tensor", "sglang-tensor")
COLOCATED_CASES = (
    "sglang-tensor",
    "sglang-flattened",
    "vllm-ipc",
    "vllm-ipc-packed-pickled",
    "fault-vllm-ipc-refused-version",
)


def _cases(backend):
    """The cases of one job: all on gloo; on NCCL the success cases that run there, SGLang's group on NCCL;
    colocated (one GPU) the CUDA IPC routes (vLLM ipc with pickled handles: the stand-in RPC is JSON)."""
    if backend == "gloo":
        return {**CASES, **FAULTS, **IPC_CASES, **IPC_FAULTS}
    if backend == "colocated":
        every = {**CASES, **IPC_CASES, **IPC_FAULTS}
        out = {case: every[case] for case in COLOCATED_CASES}
        for case, (adapter, kw, kind, standin_kw, merge) in out.items():
            if adapter == "vllm-ipc":
                out[case] = (adapter, {**kw, "pickle_handles": True}, kind, standin_kw, merge)
        return out
    out = {}
    for case in GPU_CASES:
        adapter, kw, kind, standin_kw, merge = CASES[case]
        out[case] = (adapter, {**kw, "backend": "nccl"} if "backend" in kw else kw, kind, standin_kw, merge)
    return out


def _in_trainer(kind, backend) -> bool:
    """vLLM's ipc stand-in runs in the trainer's process on CPU (no CUDA IPC between processes)."""
    return kind == "vllm-ipc" and backend == "gloo"


def _standin(kind, model, tp_rank, engine_ranks, kw):
    if kind == "vllm-ipc":
        return es.VllmIpcWorkerStandin(model, **kw)
    if kind == "vllm":
        return es.VllmNcclWorkerStandin(model, rank=tp_rank, world_size_per_dp=engine_ranks, **kw)
    if kind == "vllm-ext":
        return es.VllmWorkerExtensionStandin(model, world_rank=tp_rank)
    return es.SglangEngineStandin(model, tp_rank=tp_rank, **kw)


def _engine(rank, address, cases, device, backend):
    hf = dict(tiny_llama.build_hf(SPEC).named_parameters())
    models, engines = {}, {}
    for case, (_, _, kind, kw, _) in cases.items():
        if _in_trainer(kind, backend):
            continue
        params = dict(hf)
        if case == "fault-vllm-unknown-name":
            del params["lm_head.weight"]
        if case == "fault-sglang-shape":
            params["model.norm.weight"] = torch.zeros(SPEC.hidden_size + 8)
        models[case] = es.StandinModel(params, device)
        engines[case] = _standin(kind, models[case], rank - 1, dist.get_world_size() - 1, kw)
    es.StandinServer(engines, address, key=KEY).serve(timeout_s=240)
    out = {}
    for case, e in engines.items():
        out[case] = dict(
            state=models[case].state(),
            version=getattr(e, "weight_version", None),
            chunks=list(getattr(e, "chunks", [])),
            requests=getattr(e, "requests", None),
            cache_flushes=getattr(e, "cache_flushes", None),
            received=list(getattr(e, "received", [])),
            destroyed=list(getattr(e, "destroyed", [])),
        )
    es.release_groups()  # with the trainer's ends (see engine_standins)
    return out


class CpuIpcSender(VllmIpcSender):
    """The vllm-ipc adapter with its three CUDA-bound steps (the CUDA check, the GPU's UUID, making
    the handles) done by the CPU stand-in of CUDA IPC; everything else is the adapter's."""

    def __init__(self, call, ipc: es.CudaIpcStandin, **kw):
        super().__init__(call, **kw)
        self.ipc = ipc

    def _require_cuda(self, device, what):
        pass

    def _gpu_uuid(self, device):
        return self.ipc.uuid

    def _shares(self):
        return self.ipc.shares()


def _make_adapter(client, case, spec, backend):
    """The case's adapter and, when the stand-in runs in this process, the stand-in (else None)."""
    adapter_name, kw, kind, standin_kw, merge = spec
    if _in_trainer(kind, backend):
        ipc = es.CudaIpcStandin()
        hf = dict(tiny_llama.build_hf(SPEC).named_parameters())
        standin = es.VllmIpcWorkerStandin(es.StandinModel(hf), ipc=ipc, **standin_kw)
        return CpuIpcSender(standin, ipc, **kw), standin
    if adapter_name != "vllm-ipc":
        kw = dict(kw, engine_ranks=dist.get_world_size() - 1)
    if adapter_name in ("vllm", "vllm-rpc"):
        kw = dict(kw, group=es.vllm_trainer_group, master_address="127.0.0.1")
    elif adapter_name == "sglang-distributed":
        kw = dict(kw, group_name=f"weight_update_{case}", master_address="127.0.0.1")
    return make_adapter(adapter_name, client.caller(case, merge), **kw), None


def _in_trainer_engine(standin) -> dict | None:
    if standin is None:
        return None
    return dict(state=standin.model.state(), version=standin.weight_version, received=list(standin.received))


def _export_case(model, client, case, spec, backend):
    from megatron_ext import weight_export as wx

    adapter, standin = _make_adapter(client, case, spec, backend)
    cfg = wx.RefitConfig(bucket_size_mb=0.03, vocab_size=SPEC.hf_vocab_size, timeout_s=60)
    exporter = wx.WeightExporter(model, cfg, sender=adapter)
    start = time.monotonic()
    result = {}  # close() (in finally) adds how the group was released
    poisoned = case == "fault-sglang-nan"
    if poisoned:
        norm = model.decoder.final_layernorm.weight
        saved = norm.detach().clone()
        with torch.no_grad():
            norm[3] = float("nan")
    first_expected = None
    try:
        first = exporter.export(version=1)
        if case == "fault-vllm-ipc-refused-version":
            first_expected = snapshot(reference_for(SPEC, model))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5).add_(0.125)
        start = time.monotonic()
        second = exporter.export(version=2)
        result.update(
            applied=(first.applied, second.applied),
            expected=snapshot(reference_for(SPEC, model)),
            buckets=len(exporter.plan.buckets),
            copied=adapter.packer.copies,
            engine=_in_trainer_engine(standin),
        )
        return result
    except Exception as exc:  # noqa: BLE001 - the fault cases report what the trainer saw
        result.update(error=f"{type(exc).__name__}: {exc}", elapsed=time.monotonic() - start, expected=first_expected)
        try:
            exporter.export(version=3)
            result["again"] = "exported"
        except Exception as again:  # noqa: BLE001
            result["again"] = f"{type(again).__name__}: {again}"
        result["engine"] = _in_trainer_engine(standin)
        return result
    finally:
        closing = time.monotonic()
        exporter.close()
        result.update(release_error=adapter.release_error, close_s=time.monotonic() - closing)
        if poisoned:
            with torch.no_grad():
                norm.copy_(saved)


def _trainer(addresses, cases, device, backend):
    from megatron_ext.testing import tiny_llama as tl

    model = tl.build_model(SPEC, tl.transformer_config(SPEC), device=device)
    client = es.StandinClient(addresses, key=KEY, timeout_s=120)
    try:
        return {case: _export_case(model, client, case, spec, backend) for case, spec in cases.items()}
    finally:
        client.close()
        es.release_groups()  # with the engine ranks' ends (see engine_standins)


def _job(backend):
    # A rank still running shortly before the job's limit prints where each of its threads is.
    faulthandler.dump_traceback_later(JOB_TIMEOUT_S - 30, exit=False, file=sys.stderr)
    # gloo: tearing down one end of a trainer-engine group waits for its other ends, as on NCCL
    rule = es.nccl_teardown_rule(TEARDOWN_LIMIT_S) if backend != "nccl" else contextlib.nullcontext()
    try:
        with rule:
            return _job_body(backend)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _job_body(backend):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend != "gloo" else torch.device("cpu")
    addresses = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, f"127.0.0.1:{free_port()}" if rank else None)
    if rank == 0:
        return _trainer(addresses[1:], _cases(backend), device, backend)
    return _engine(rank, addresses[rank], _cases(backend), device, backend)


@pytest.fixture(
    scope="module",
    params=[
        "gloo",
        pytest.param("nccl", marks=pytest.mark.gpus(2)),
        # trainer and engine on one GPU (gloo world): SGLang's tensor route over CUDA IPC, gloo on CUDA tensors
        pytest.param("colocated", marks=pytest.mark.gpus(1)),
    ],
)
def job(request):
    world = 3 if request.param == "gloo" else 2  # NCCL: one GPU per rank
    backend = "nccl" if request.param == "nccl" else "gloo"
    return run_on_ranks(_job, world, args=(request.param,), backend=backend, timeout=JOB_TIMEOUT_S)


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_delivers_exact_tensors_and_version_to_the_standin(job, case):
    if case not in job[0]:
        pytest.skip(f"{case} does not run in this job (see _cases)")
    trainer, engines = job[0][case], [r[case] for r in job[1:]]
    assert "error" not in trainer, trainer.get("error")
    assert trainer["applied"] == ((1,), (2,))
    assert trainer["buckets"] > 4
    for engine in engines:
        assert engine["state"].keys() == trainer["expected"].keys()
        for name, ref in trainer["expected"].items():
            assert torch.equal(engine["state"][name], ref), f"{case}: {name}"
    adapter, _, kind, standin_kw, _ = CASES[case]
    if kind in ("vllm", "sglang"):
        assert engines[0]["version"] == "2", engines[0]["version"]
    if kind == "sglang":
        # one request per bucket (per dtype group: one dtype here), the cache flushed once per version
        assert engines[0]["requests"] == 2 * trainer["buckets"] and engines[0]["cache_flushes"] == 2
    # close() released the group: SGLang's two ends together, the others' left to release_groups
    assert trainer["release_error"] is None, trainer["release_error"]
    assert trainer["close_s"] < TEARDOWN_LIMIT_S / 2, f"close() waited {trainer['close_s']:.1f}s for the engine's end"
    group = [f"weight_update_{case}"] if adapter == "sglang-distributed" else []
    assert all(engine["destroyed"] == group for engine in engines), [e["destroyed"] for e in engines]
    if case == "vllm-packed-init-info-small-chunks":
        chunks = engines[0]["chunks"]
        assert len(chunks) > 2 * trainer["buckets"], "3000-byte chunks cut buckets into several broadcasts"
    # qk-norm weights (16 fp32 = 64 bytes) break the 256-byte aligned layout: some tensors were
    # packed by a copy, the rest went out as views of the export buffer.
    if adapter != "vllm-rpc" and CASES[case][1].get("flattened", True) and CASES[case][1].get("packed", True):
        assert trainer["copied"] > 0


def _faults_ran(job):
    if "fault-sglang-shape" not in job[0]:
        pytest.skip("the fault cases run on CPU (gloo) only")


def test_engine_call_that_raises_surfaces_on_the_trainer_without_a_hang(job):
    _faults_ran(job)
    trainer = job[0]["fault-vllm-refuses-update-info"]
    assert "ReceiverError" in trainer["error"], trainer
    assert "update_weights" in trainer["error"] and "unexpected keyword argument 'packed'" in trainer["error"]
    assert trainer["elapsed"] < FAULT_TIMEOUT_S, trainer["elapsed"]
    assert "cannot send another version" in trainer["again"] and "new adapter" in trainer["again"]
    assert all(r["fault-vllm-refuses-update-info"]["version"] is None for r in job[1:])


def test_engine_that_does_not_know_a_tensor_is_reported_by_name(job):
    _faults_ran(job)
    trainer = job[0]["fault-vllm-unknown-name"]
    assert "ReceiverError" in trainer["error"] and "'lm_head.weight'" in trainer["error"], trainer
    assert "no such parameter" in trainer["error"] and "bucket" in trainer["error"]
    assert trainer["elapsed"] < FAULT_TIMEOUT_S
    assert all(r["fault-vllm-unknown-name"]["version"] is None for r in job[1:])


def test_sglang_shape_mismatch_is_refused_with_the_engines_message(job):
    _faults_ran(job)
    trainer = job[0]["fault-sglang-shape"]
    assert "the SGLang engine refused update_weights_from_distributed" in trainer["error"], trainer
    assert "Attempted to load weight (torch.Size([64])) into parameter (torch.Size([72]))" in trainer["error"]
    assert "model.norm.weight" in trainer["error"], "the failing bucket's tensors are named"
    assert all(r["fault-sglang-shape"]["version"] is None for r in job[1:])
    # the adapter refuses further versions, but its group still goes down with the engine's end
    assert trainer["release_error"] is None, trainer["release_error"]
    assert all(r["fault-sglang-shape"]["destroyed"] == ["weight_update_fault-sglang-shape"] for r in job[1:])


def test_version_refused_by_the_hooks_nan_check_is_not_published(job):
    _faults_ran(job)
    trainer = job[0]["fault-sglang-nan"]
    assert trainer["error"].startswith("NonFiniteWeights") and "model.norm.weight" in trainer["error"], trainer
    assert trainer["again"].startswith("NonFiniteWeights"), "the adapter stays usable: nothing went out of step"
    for engine in job[1:]:
        assert engine["fault-sglang-nan"]["version"] is None


def _ipc_engines(job, case) -> list[dict]:
    """The vLLM ipc stand-in's results: from the trainer's process on CPU, the engine ranks on a GPU."""
    if case not in job[0]:
        pytest.skip(f"{case} does not run in this job (see _cases)")
    engine = job[0][case].get("engine")
    return [engine] if engine is not None else [r[case] for r in job[1:]]


@pytest.mark.parametrize("case", list(IPC_CASES))
def test_vllm_ipc_delivers_exact_tensors_and_version_to_the_standin(job, case):
    engines = _ipc_engines(job, case)
    trainer = job[0][case]
    assert "error" not in trainer, trainer.get("error")
    assert trainer["applied"] == ((1,), (2,))
    assert trainer["buckets"] > 4
    kw = CASES.get(case, IPC_CASES[case])[1]
    for engine in engines:
        assert engine["version"] == "2", engine["version"]
        assert engine["state"].keys() == trainer["expected"].keys()
        for name, ref in trainer["expected"].items():
            assert torch.equal(engine["state"][name], ref), f"{case}: {name}"
        received = engine["received"]
        # an engine process (GPU) is reached over the stand-in RPC, whose JSON needs pickled handles
        pickled = kw.get("pickle_handles", False) or trainer.get("engine") is None
        assert {r["pickled"] for r in received} == {pickled}
        assert {r["packed"] for r in received} == {kw.get("packed", False)}
        for r in received:
            assert len(r["names"]) == len(r["dtype_names"]) == len(r["shapes"]) > 0
        # one request per bucket (one dtype, fp32, in this model)
        assert len(received) == 2 * trainer["buckets"]
        if kw.get("packed", False):
            # one handle per request: the bucket's tensors back to back, cut by tensor_sizes; the qk-norm
            # weights (64 bytes) break the 256-byte aligned layout, so some buckets were packed by a copy
            assert all(r["ipc_handles"] == 1 and len(r["tensor_sizes"]) == len(r["names"]) for r in received)
            assert trainer["copied"] > 0
        else:
            # one handle per tensor, each a view of the export buffer: nothing copied
            assert all(r["ipc_handles"] == len(r["names"]) and r.get("tensor_sizes") is None for r in received)
            assert trainer["copied"] == 0


def test_vllm_ipc_refused_version_leaves_the_engine_on_the_previous_one(job):
    case = "fault-vllm-ipc-refused-version"
    engines = _ipc_engines(job, case)
    trainer = job[0][case]
    assert "ReceiverError" in trainer.get("error", ""), trainer
    assert "update_weights" in trainer["error"] and "refused (stand-in fault injection)" in trainer["error"]
    assert "bucket 0" in trainer["error"], "the failing bucket is named"
    assert trainer["elapsed"] < FAULT_TIMEOUT_S, trainer["elapsed"]
    assert "cannot send another version" in trainer["again"] and "new adapter" in trainer["again"]
    for engine in engines:
        # refused at the version's first request: nothing of version 2 was loaded, version 1 is kept
        assert engine["version"] == "1", engine["version"]
        for name, ref in trainer["expected"].items():
            assert torch.equal(engine["state"][name], ref), name


def test_vllm_ipc_pickled_handles_are_refused_without_insecure_serialization(job):
    case = "fault-vllm-ipc-insecure"
    engines = _ipc_engines(job, case)
    trainer = job[0][case]
    assert "ReceiverError" in trainer.get("error", ""), trainer
    want = "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
    assert want in trainer["error"], trainer["error"]
    assert all(engine["version"] is None and engine["received"] == [] for engine in engines)


# ------------------------------------------------------------------------ in-process layout checks
def _bucket(shapes_dtypes):
    """A bucket laid out as the export plan lays it out (256-byte aligned offsets), and its tensors."""
    gen = torch.Generator().manual_seed(0)
    tensors, metas, offset = [], [], 0
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        t = (torch.randn(shape, generator=gen) * 10).to(dtype)
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(f"t{i}", dtype, tuple(shape), offset, nbytes))
        tensors.append(t)
        offset += align(nbytes)
    buf = torch.zeros(offset, dtype=torch.uint8)
    for m, t in zip(metas, tensors):
        buf[m.offset : m.offset + m.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return BucketMeta(0, 0, offset, tuple(metas)), buf, tensors


MIXED = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 3), torch.float16), ((64,), torch.float32)]


def test_flattened_buckets_match_sglangs_layout_with_mixed_dtypes_and_odd_sizes():
    bucket, buf, tensors = _bucket(MIXED)
    want = dict(zip((m.name for m in bucket.tensors), tensors))
    requests = aligned_requests(bucket.tensors)
    # The fp32 after 14 bytes of bf16 could not be viewed by the engine: it starts a new request.
    assert [[t.name for t in r] for r in requests] == [["t0", "t1", "t2"], ["t3"]]
    packer, at, got = Packer(), 0, {}
    for request in requests:
        packed = packer.pack(request, buf, 0, at=at)
        at += region(packed.numel())
        # The engine builds its bucket from empty tensors of the request's names/dtypes/shapes and receives into it.
        engine = es.FlattenedTensorBucketStandin(
            named_tensors=[(m.name, torch.empty(m.shape, dtype=m.dtype)) for m in request]
        )
        assert engine.flattened_tensor.dtype == torch.uint8 and engine.flattened_tensor.shape == packed.shape
        engine.flattened_tensor.copy_(packed)
        got.update(engine.reconstruct_tensors())
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("limit", [8, 60, 1 << 30])
def test_packed_chunks_unpack_as_vllm_unpacks_them_with_mixed_dtypes(limit):
    bucket, buf, tensors = _bucket(MIXED + list(reversed(MIXED)))
    want = dict(zip((m.name for m in bucket.tensors), tensors))
    packer, at, got = Packer(), 0, {}
    for request in aligned_requests(bucket.tensors, limit):
        packed = packer.pack(request, buf, 1, at=at)
        at += region(packed.numel())
        starts = [0]
        for t in request:
            starts.append(starts[-1] + t.nbytes)
        for first, end in threshold_chunks([t.nbytes for t in request], limit):
            chunk = torch.empty(starts[end] - starts[first], dtype=torch.uint8)  # what the worker receives into
            chunk.copy_(packed[starts[first] : starts[end]])
            got.update(es.unpack_chunk(chunk, [(t.name, list(t.shape), t.dtype) for t in request[first:end]]))
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_aligned_buckets_go_out_without_a_copy():
    bucket, buf, _ = _bucket([((64,), torch.float32), ((8, 16), torch.bfloat16), ((3,), torch.float32)])
    packer = Packer()
    packed = packer.pack(bucket.tensors, buf, 1)
    assert packed.data_ptr() == buf.data_ptr() and packer.copies == 0 and packer.staging_bytes == 0


@pytest.mark.parametrize("limit", [1, 40, 100, 3000, 1 << 30])
def test_packed_chunks_are_cut_where_vllms_consumer_cuts_them(limit):
    sizes = [60, 4, 256, 28, 1024, 12, 12, 300]
    assert [sum(sizes[a:b]) for a, b in threshold_chunks(sizes, limit)] == es.packed_chunk_sizes(sizes, limit)


class _Recorder:
    """Records every engine call (method, keyword arguments) and forwards it to ``engine``."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __call__(self, method, *args, **kwargs):
        self.calls.append((method, kwargs))
        return getattr(self.engine, method)(*args, **kwargs)


@pytest.mark.parametrize(
    "packed, pickle_handles, packed_params_in",
    [
        (False, False, "init_info"),
        (False, True, "update_info"),
        (True, False, "init_info"),
        (True, True, "engine_config"),
        (True, False, "update_info"),
    ],
)
def test_vllm_ipc_messages_have_vllms_layout_and_unpack_exactly(packed, pickle_handles, packed_params_in):
    """The fields of every call (vLLM's IPCWeightTransferInitInfo / IPCWeightTransferUpdateInfo), the
    handles ({gpu uuid: rebuild_cuda_tensor args}) and, through the stand-in worker, the exact tensors
    of a mixed-dtype bucket with odd sizes, over two versions (CPU: CudaIpcStandin for CUDA IPC)."""
    import base64
    import pickle

    bucket, buf, tensors = _bucket(MIXED)
    want = dict(zip((m.name for m in bucket.tensors), tensors))
    ipc = es.CudaIpcStandin()
    era = {"engine_config": dict(era="engine_config", packed=packed)}.get(packed_params_in, dict(era=packed_params_in))
    model = es.StandinModel({name: t for name, t in want.items()})
    worker = es.VllmIpcWorkerStandin(model, ipc=ipc, **era)
    recorder = _Recorder(worker)
    adapter = CpuIpcSender(
        recorder, ipc, packed=packed, pickle_handles=pickle_handles, packed_params_in=packed_params_in,
        check_version=True,
    )  # fmt: skip
    for version in (1, 2):
        adapter.start(None, [buf], version)
        adapter.send(bucket, buf).wait()
        assert adapter.finish(version) == [version]
        assert worker.weight_version == str(version)
        for name, t in want.items():
            assert model.params[name].dtype == t.dtype and torch.equal(model.params[name], t), name
        buf.zero_()  # the next version must be read again, not kept from the first
        for m, t in zip(bucket.tensors, tensors):
            buf[m.offset : m.offset + m.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    adapter.close()

    methods = [m for m, _ in recorder.calls]
    requests = [kw for m, kw in recorder.calls if m == "update_weights"]
    per_version = len(requests) // 2
    assert methods == ["init_weight_transfer_engine"] + 2 * (
        ["start_weight_update"] + ["update_weights"] * per_version + ["finish_weight_update", "get_weight_version"]
    )
    init = recorder.calls[0][1]
    assert init == {"init_info": {"packed": packed} if packed_params_in == "init_info" else {}}
    finishes = [kw for m, kw in recorder.calls if m == "finish_weight_update"]
    assert finishes == [{"weight_version": "1"}, {"weight_version": "2"}]
    expected_requests = aligned_requests(bucket.tensors) if packed else [list(bucket.tensors)]
    assert per_version == len(expected_requests)
    for kw, metas in zip(requests, 2 * expected_requests):
        info = kw["update_info"]
        handle_key = "ipc_handles_pickled" if pickle_handles else "ipc_handles"
        keys = ["names", "dtype_names", "shapes", handle_key] + (["tensor_sizes"] if packed else [])
        assert list(info) == keys + (["packed"] if packed_params_in == "update_info" else [])
        if packed_params_in == "update_info":
            assert info["packed"] is packed
        assert info["names"] == [m.name for m in metas]
        assert info["dtype_names"] == [str(m.dtype).removeprefix("torch.") for m in metas]
        assert info["shapes"] == [list(m.shape) for m in metas]
        handles = info[handle_key]
        if pickle_handles:
            assert isinstance(handles, str)
            handles = pickle.loads(base64.b64decode(handles))
        one = [handles] if packed else handles
        assert isinstance(handles, dict if packed else list) and len(one) == (1 if packed else len(metas))
        for h, m in zip(one, metas):
            assert list(h) == [ipc.uuid]
            args = h[ipc.uuid]
            assert len(args) == 15  # rebuild_cuda_tensor's parameters
            assert args[5] == (torch.uint8 if packed else m.dtype)
            if not packed:
                assert tuple(args[1]) == m.shape
        if packed:
            assert info["tensor_sizes"] == [m.nbytes for m in metas]
            assert tuple(one[0][ipc.uuid][1]) == (sum(m.nbytes for m in metas),)
    # unpacked: every handle is a view of the export buffer; packed: the odd sizes needed a staging copy
    assert (adapter.packer.copies > 0) == packed


def test_vllm_ipc_refuses_tensors_that_are_not_on_a_cuda_device():
    adapter = make_adapter("vllm-ipc", lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"through CUDA IPC, which needs CUDA tensors; got the export buffers on cpu"):
        adapter.allocate(1024, "cpu")
    bucket, buf, _ = _bucket(MIXED)
    with pytest.raises(ValueError, match="needs CUDA tensors; got the export buffers on cpu"):
        adapter.start(None, [buf], 1)
    with pytest.raises(ValueError, match="needs CUDA tensors; got the export buffers on cpu"):
        adapter.send(bucket, buf)
    adapter.close()


def test_adapter_arguments_are_checked_by_name():
    with pytest.raises(ValueError, match=r"packed must be True or False, got 'yes'"):
        make_adapter("vllm-ipc", lambda *a, **k: None, packed="yes")
    with pytest.raises(
        ValueError, match=r"packed_params_in must be one of \('update_info', 'init_info', 'engine_config'\), got 'http'"
    ):
        make_adapter("vllm-ipc", lambda *a, **k: None, packed_params_in="http")
    with pytest.raises(ValueError, match=r"pickle_handles must be True or False, got 1"):
        make_adapter("vllm-ipc", lambda *a, **k: None, pickle_handles=1)
    with pytest.raises(ValueError, match=r"timeout_s must be > 0"):
        make_adapter("vllm-ipc", lambda *a, **k: None, timeout_s=0)
    with pytest.raises(TypeError, match="master_address"):  # no group: a group argument is a mistake
        make_adapter("vllm-ipc", lambda *a, **k: None, master_address="127.0.0.1")
    with pytest.raises(
        ValueError, match=r"packed_params_in must be one of \('update_info', 'init_info', 'engine_config'\)"
    ):
        make_adapter("vllm", lambda *a, **k: None, master_address="127.0.0.1", packed_params_in="http")
    with pytest.raises(ValueError, match="engine_ranks"):
        make_adapter("sglang-distributed", lambda *a, **k: None, master_address="127.0.0.1", engine_ranks=0)
    with pytest.raises(ValueError, match=r"update_kwargs must not set \['load_format'\]"):
        make_adapter("sglang-tensor", lambda *a, **k: None, update_kwargs={"load_format": "direct"})
    with pytest.raises(ValueError, match="unknown engine adapter 'trtllm'; choose one of"):
        make_adapter("trtllm", lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"release_group must be True or False, got 'yes'"):
        make_adapter("sglang-distributed", lambda *a, **k: None, master_address="127.0.0.1", release_group="yes")


# ------------------------------------------------------------------- releasing a group at close()
class _NcclTeardown:
    """The two ends (trainer, engine) of one group with NCCL's teardown rule: destroying an end
    returns only once the other end is being destroyed too (NCCL's proxy thread serves the peer's
    connection until the peer tears its end down; gloo's teardown is local, so the CPU jobs cannot
    show it). Here a lone end gives up after ``limit_s`` instead of waiting forever."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.down = {"trainer": threading.Event(), "engine": threading.Event()}
        self.events: list[str] = []
        self.lone: list[str] = []  # ends that were destroyed alone

    def end(self, name: str):
        other = "engine" if name == "trainer" else "trainer"
        group = self

        class End:
            def destroy(self):
                group.events.append(f"{name} destroys")
                group.down[name].set()
                if not group.down[other].wait(group.limit_s):
                    group.lone.append(name)
                    raise TimeoutError(f"the {name}'s end was destroyed alone (NCCL: blocks until the {other}'s goes)")

            def close(self):
                group.events.append(f"{name} forgets")

        return End()


def _sglang_sender(group, answer, limit_s, **kw):
    """An SGLang adapter already joined to ``group``'s trainer end; its engine destroys the engine end
    when asked (``answer``: its reply to destroy_weights_update_group, None: it destroys its end)."""
    calls, engine_end = [], group.end("engine")

    def call(method, **kwargs):
        calls.append((method, kwargs))
        if method == "destroy_weights_update_group":
            if answer is not None:
                return answer
            engine_end.destroy()
            return {"success": True, "message": "Succeeded to destroy custom process group."}
        return {"success": True, "message": ""}

    adapter = make_adapter(
        "sglang-distributed", call, master_address="127.0.0.1", group_name="g", timeout_s=limit_s, **kw
    )
    adapter.group, adapter.connected = group.end("trainer"), True
    return adapter, calls


def _close_within(adapter, limit_s: float) -> float:
    start = time.monotonic()
    closer = threading.Thread(target=adapter.close, daemon=True)
    closer.start()
    closer.join(limit_s)
    assert not closer.is_alive(), f"close() still blocked after {limit_s:g}s"
    return time.monotonic() - start


def test_sglang_close_destroys_both_ends_of_the_group_together():
    """The NCCL job hung in exporter.close(): the trainer destroyed its end of the engine's group
    alone (and the vLLM stand-in's trainer group aborted when dropped), which on NCCL blocks until
    the engine's end goes, while the engine waited for the trainer's next call. close() now asks
    the engine to destroy its end while the trainer destroys its own."""
    group = _NcclTeardown(limit_s=10.0)
    adapter, calls = _sglang_sender(group, None, 10.0)
    took = _close_within(adapter, 15.0)
    assert calls == [("destroy_weights_update_group", {"group_name": "g"})]
    assert sorted(group.events) == ["engine destroys", "trainer destroys"] and group.lone == []
    assert adapter.release_error is None and adapter.group is None
    assert took < 5.0, took


def test_sglang_close_does_not_hang_when_the_engine_refuses_to_destroy_its_end():
    group = _NcclTeardown(limit_s=4.0)
    refusal = {"success": False, "message": "The group to be destroyed does not exist."}
    adapter, calls = _sglang_sender(group, refusal, 4.0)
    took = _close_within(adapter, 3.0)  # answered at once: close() does not wait for its own end
    assert took < 2.0, took
    assert "refused destroy_weights_update_group: The group to be destroyed does not exist" in adapter.release_error
    assert "left to a background thread" in adapter.release_error


def test_sglang_close_without_release_group_leaves_both_ends_up():
    group = _NcclTeardown(limit_s=2.0)
    adapter, calls = _sglang_sender(group, None, 2.0, release_group=False)
    _close_within(adapter, 2.0)
    assert calls == [] and group.events == ["trainer forgets"] and adapter.release_error is None


def test_sglang_group_is_not_split_from_a_device_bound_default_group(monkeypatch):
    """With the default group bound to a device (init_process_group(device_id=...)), torch builds a
    new NCCL group by splitting the default group's communicator: collective over the default group,
    whose other ranks never join a trainer-engine group, so rank 0 would block in it. The trainer's
    end (and the stand-in engine's) is created while the default group looks unbound, then the
    binding is restored."""
    from torch.distributed import distributed_c10d as c10d

    from megatron_ext.weight_export.engines.adapters.sglang import join_sglang_group

    seen, real = [], c10d._new_process_group_helper

    def spy(*args, **kwargs):
        if dist.is_initialized():
            seen.append(c10d._get_default_group().bound_device_id)
        return real(*args, **kwargs)

    monkeypatch.setattr(c10d, "_new_process_group_helper", spy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        default = c10d._get_default_group()
        default.bound_device_id = torch.device("cuda", 0)  # as a launcher passing device_id sets it (no CUDA needed)
        assert c10d._get_split_source(default) is not None, "torch would split from the default group"
        pg = join_sglang_group("127.0.0.1", free_port(), 1, "weight_update_split_check", "gloo", 10.0)
        assert seen == [None], seen
        assert default.bound_device_id == torch.device("cuda", 0)
        t = torch.ones(3)
        pg.broadcast(t, 0).wait()
        dist.destroy_process_group(pg)
    finally:
        dist.destroy_process_group()
