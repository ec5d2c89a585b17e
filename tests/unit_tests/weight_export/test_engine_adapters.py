"""The engine adapters (vLLM's and SGLang's own weight-update protocols, trainer side) against
STAND-INS of the engines: megatron_ext.testing.engine_standins implements the engine side the
way vLLM's and SGLang's sources do (group creation, receive order, packed / flattened bucket
unpacking, weight version); the real engines cannot be installed here, so nothing below runs
vLLM or SGLang themselves.

One 3-rank CPU gloo job: rank 0 is a Megatron trainer exporting a tiny Qwen3 through
WeightExporter(sender=adapter); ranks 1 and 2 are the two TP ranks of every stand-in engine.
On 2 GPUs (NCCL) the engine has one rank on GPU 1, and the cases that exist on GPUs run: the
vLLM stand-in's group is torch NCCL behind the adapter's PyNccl wrapper, SGLang's group is NCCL
over a Megatron world bound to its device; on 1 GPU (colocated) SGLang's tensor route shares the
export buffers through CUDA IPC.
Each case exports two versions and compares the engine's tensors with the trainer's HF
tensors, written out by hand (tests/unit_tests/weight_export/_reference.py)."""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_ext.testing import engine_standins as es
from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import free_port, run_on_ranks
from megatron_ext.weight_export.adapters import make_adapter
from megatron_ext.weight_export.adapters.base import Packer, aligned_requests, region, threshold_chunks
from megatron_ext.weight_export.plan import BucketMeta, TensorMeta
from megatron_ext.weight_export.wire import align

from ._reference import reference_for, snapshot

SPEC = tiny_llama.TinyLlamaSpec(arch="qwen3", num_layers=2)
KEY = b"engine-adapter-standin-test"
FAULT_TIMEOUT_S = 6.0

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


GPU_CASES = ("vllm-packed", "vllm-unpacked", "sglang-flattened", "sglang-per-tensor", "sglang-tensor")
COLOCATED_CASES = ("sglang-tensor", "sglang-flattened")


def _cases(backend):
    """The cases of one job: all on gloo; on NCCL the success cases that run there, SGLang's group on NCCL."""
    if backend == "gloo":
        return {**CASES, **FAULTS}
    if backend == "colocated":
        return {case: CASES[case] for case in COLOCATED_CASES}
    out = {}
    for case in GPU_CASES:
        adapter, kw, kind, standin_kw, merge = CASES[case]
        out[case] = (adapter, {**kw, "backend": "nccl"} if "backend" in kw else kw, kind, standin_kw, merge)
    return out


def _standin(kind, model, tp_rank, engine_ranks, kw):
    if kind == "vllm":
        return es.VllmNcclWorkerStandin(model, rank=tp_rank, world_size_per_dp=engine_ranks, **kw)
    if kind == "vllm-ext":
        return es.VllmWorkerExtensionStandin(model, world_rank=tp_rank)
    return es.SglangEngineStandin(model, tp_rank=tp_rank, **kw)


def _engine(rank, address, cases, device):
    hf = dict(tiny_llama.build_hf(SPEC).named_parameters())
    models, engines = {}, {}
    for case, (_, _, kind, kw, _) in cases.items():
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
        )
    return out


def _export_case(model, client, case, spec):
    from megatron_ext import weight_export as wx

    adapter_name, kw, _, _, merge = spec
    kw = dict(kw, engine_ranks=dist.get_world_size() - 1)
    if adapter_name.startswith("vllm"):
        kw = dict(kw, group=es.vllm_trainer_group, master_address="127.0.0.1")
    elif adapter_name == "sglang-distributed":
        kw = dict(kw, group_name=f"weight_update_{case}", master_address="127.0.0.1")
    adapter = make_adapter(adapter_name, client.caller(case, merge), **kw)
    cfg = wx.RefitConfig(bucket_size_mb=0.03, vocab_size=SPEC.hf_vocab_size, timeout_s=60)
    exporter = wx.WeightExporter(model, cfg, sender=adapter)
    start = time.monotonic()
    poisoned = case == "fault-sglang-nan"
    if poisoned:
        norm = model.decoder.final_layernorm.weight
        saved = norm.detach().clone()
        with torch.no_grad():
            norm[3] = float("nan")
    try:
        first = exporter.export(version=1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5).add_(0.125)
        second = exporter.export(version=2)
        return dict(
            applied=(first.applied, second.applied),
            expected=snapshot(reference_for(SPEC, model)),
            buckets=len(exporter.plan.buckets),
            copied=adapter.packer.copies,
        )
    except Exception as exc:  # noqa: BLE001 - the fault cases report what the trainer saw
        out = dict(error=f"{type(exc).__name__}: {exc}", elapsed=time.monotonic() - start)
        try:
            exporter.export(version=3)
            out["again"] = "exported"
        except Exception as again:  # noqa: BLE001
            out["again"] = f"{type(again).__name__}: {again}"
        return out
    finally:
        exporter.close()
        if poisoned:
            with torch.no_grad():
                norm.copy_(saved)


def _trainer(addresses, cases, device):
    from megatron_ext.testing import tiny_llama as tl

    model = tl.build_model(SPEC, tl.transformer_config(SPEC), device=device)
    client = es.StandinClient(addresses, key=KEY, timeout_s=120)
    try:
        return {case: _export_case(model, client, case, spec) for case, spec in cases.items()}
    finally:
        client.close()


def _job(backend):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend != "gloo" else torch.device("cpu")
    addresses = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, f"127.0.0.1:{free_port()}" if rank else None)
    if rank == 0:
        return _trainer(addresses[1:], _cases(backend), device)
    return _engine(rank, addresses[rank], _cases(backend), device)


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
    return run_on_ranks(_job, world, args=(request.param,), backend=backend, timeout=300)


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


def test_version_refused_by_the_hooks_nan_check_is_not_published(job):
    _faults_ran(job)
    trainer = job[0]["fault-sglang-nan"]
    assert trainer["error"].startswith("NonFiniteWeights") and "model.norm.weight" in trainer["error"], trainer
    assert trainer["again"].startswith("NonFiniteWeights"), "the adapter stays usable: nothing went out of step"
    for engine in job[1:]:
        assert engine["fault-sglang-nan"]["version"] is None


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


def test_adapter_arguments_are_checked_by_name():
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
