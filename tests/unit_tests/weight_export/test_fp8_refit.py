"""FP8 refit on CPU, without spawned ranks.

- The block quantizer is within FP8 rounding of its input, with the bound derived below, and puts a NaN or
  Inf into its block's scale.
- Planned over trainer shards (Megatron TP2, TP1 x DP2, TP2 x PP2, and a Qwen3-MoE TP2 x DP2 x EP2 x expert-TP2)
  and applied, the engine receives exactly the checkpoint an FP8 converter makes from the whole HF tensors
  (``quantize_blocks`` on each full tensor, experts included), in the bytes the format says: 1 per weight
  element plus 4 per block.
- A shard that does not cover whole blocks is refused when the layout is built, naming the tensor.
- Through the executor (trainer and engine TP1 on one rank: every byte is a local copy), each refit
  requantizes the current weights, and a NaN is refused before a byte moves, naming the weight.
- ``dequantize_blocks(..., out=)`` writes a strided view exactly as a new tensor; scales of another shape
  are refused. On a GPU both Triton kernels store the PyTorch path's bits.
"""

import pytest
import torch

from megatron_ext.sharding import fp8_layout, gpt_specs, megatron_layout
from megatron_ext.sharding.fp8 import scale_shape
from megatron_ext.weight_export import RefitRejected, ReshardExecutor, build_reshard_plan, inference_layout
from megatron_ext.weight_export.plan.fp8 import FP8_MAX, Fp8Sources, dequantize_blocks, dequantized, quantize_blocks
from megatron_ext.weight_export.plan.reshard_plan import check_reshard_plan

from .test_reshard_plan import _apply, _engine_locals, _hf_weights, _mcore_expert_coords, _megatron_locals

# every TP shard of this model (TP <= 2) covers whole 128 x 128 blocks; an engine at TP4 cuts gate/up in 64 rows
ALIGNED = dict(
    num_layers=2,
    hidden_size=256,
    num_heads=4,
    num_groups=2,
    head_dim=128,
    ffn_hidden_size=256,
    vocab_size=64,
    dtype=torch.bfloat16,
)


def _weights(specs, seed=0):
    return {n: t.to(torch.bfloat16) for n, t in _hf_weights(specs, seed).items()}


def test_quantizer_is_within_fp8_rounding():
    """e4m3 has 3 mantissa bits: a normal value rounds to within 2^-4 of itself (relative), a subnormal one
    (below 2^-6) to within half its spacing 2^-9, i.e. 2^-10. A block is scaled by s = amax / 448 before
    rounding, so in the weight's units |dequantized - x| <= 2^-4 |x| + 2^-10 s (the fp32 division and
    product add ~2^-24 relative, far below)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=g)  # partial last blocks in both dims
    x[:128, :128] *= 1e-3  # blocks of very different magnitude
    x[128:, 128:256] = 0  # an all-zero block
    x[5, 7] = 50.0  # one outlier sets its block's scale
    q, s = quantize_blocks(x)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 3)
    blocks_amax = torch.stack(
        [torch.stack([x[i : i + 128, j : j + 128].abs().max() for j in (0, 128, 256)]) for i in (0, 128)]
    )
    nonzero = blocks_amax > 0
    torch.testing.assert_close(s[nonzero], blocks_amax[nonzero] / FP8_MAX, rtol=0, atol=0)
    deq = dequantize_blocks(q, s, torch.float32)
    per_elem_s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    bound = 2**-4 * x.abs() + 2**-10 * per_elem_s
    assert ((deq - x).abs() <= bound).all(), float(((deq - x).abs() - bound).max())
    assert float(deq[128:, 128:256].abs().max()) == 0.0
    assert float(q.float().abs().max()) == FP8_MAX  # the outlier maps to the top of the range
    # a NaN or Inf lands in its block's scale (the refit's finite check reads the scales)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[130, 10] = bad
        _, sy = quantize_blocks(y)
        assert not torch.isfinite(sy[1, 0]) and torch.isfinite(sy[torch.arange(2) != 1]).all()


# Qwen3-MoE experts of two blocks: whole blocks in every expert-TP2 shard and engine TP2 shard
ALIGNED_MOE = dict(ALIGNED, num_experts=4, moe_ffn_hidden_size=256)
CASES = {  # name: (spec kwargs, megatron kwargs, engine kwargs)
    "tp2_to_tp1": (ALIGNED, dict(tp=2), dict(tp=1)),
    "tp1dp2_to_tp2": (ALIGNED, dict(tp=1, dp=2), dict(tp=2)),
    "tp2pp2_to_tp2dp2": (ALIGNED, dict(tp=2, pp=2), dict(tp=2, dp=2)),
    "moe_tp2dp2ep2etp2_to_tp2": (ALIGNED_MOE, dict(tp=2, dp=2, ep=2, etp=2), dict(tp=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_receives_the_fp8_checkpoint_of_the_whole_tensors(case):
    spec_kw, mkw, ekw = CASES[case]
    specs = gpt_specs(**spec_kw)
    src = megatron_layout(specs, **mkw)
    world = len(src.ranks)
    dst = inference_layout(specs, **ekw, ranks=range(world, world + ekw["tp"] * ekw.get("dp", 1)))
    fsrc, fdst = fp8_layout(src), fp8_layout(dst)
    plan = build_reshard_plan(fsrc, fdst)
    check_reshard_plan(plan)
    weights = _weights(specs)
    ep, etp = mkw.get("ep", 1), mkw.get("etp", 1)
    coords = _mcore_expert_coords(tp=mkw["tp"], dp=mkw.get("dp", 1), pp=mkw.get("pp", 1), ep=ep, etp=etp)
    trainer = _megatron_locals(src, weights, specs, mkw["tp"], coords=coords, ep=ep, etp=etp)
    sources = {r: Fp8Sources(trainer[r], fsrc, r).tensors for r in fsrc.ranks}
    got = _apply(plan, sources, fdst)
    # independently: an FP8 converter's checkpoint of the whole HF tensors, stacked as the engine holds them
    checkpoint = {}
    for name, w in weights.items():
        if fsrc.specs[name].dtype == torch.float8_e4m3fn:
            checkpoint[name], checkpoint[name + "_scale_inv"] = quantize_blocks(w)
        else:
            checkpoint[name] = w
    want = _engine_locals(fdst, {n: t.float() for n, t in checkpoint.items()})
    for r in fdst.ranks:
        assert got[r].keys() == want[r].keys()
        for n in want[r]:
            torch.testing.assert_close(got[r][n], want[r][n], rtol=0, atol=0, msg=f"rank {r} {n}")
    # bytes on the wire: 1 per FP8 element and 4 per block scale instead of 2 per bf16 element
    fp8_bytes = sum(t.nbytes for t in plan.transfers)
    bf16_bytes = sum(t.nbytes for t in build_reshard_plan(src, dst).transfers)
    quantized = [s for s in specs if fsrc.specs[s.name].dtype == torch.float8_e4m3fn]
    saved = sum(s.nbytes // 2 - 4 * -(-s.shape[0] // 128) * -(-s.shape[1] // 128) for s in quantized)
    experts = [s for s in quantized if s.expert is not None]
    assert len(experts) == 3 * spec_kw.get("num_experts", 0) * spec_kw["num_layers"]  # the FP8 rule takes experts
    assert fp8_bytes == bf16_bytes - saved * ekw.get("dp", 1)  # every engine replica receives the model
    assert fp8_bytes <= 0.52 * bf16_bytes


def test_shards_that_cut_a_block_are_refused_naming_the_tensor():
    specs = gpt_specs(**ALIGNED)
    fp8_layout(megatron_layout(specs, tp=2))  # whole blocks: fine
    with pytest.raises(ValueError, match=r"gate_proj.weight\[0:64\].*--refit-quantize none"):
        fp8_layout(inference_layout(specs, tp=4, ranks=range(4)))


def test_executor_requantizes_every_refit_and_refuses_nan():
    specs = gpt_specs(**ALIGNED)
    src, dst = fp8_layout(megatron_layout(specs, ranks=[0])), fp8_layout(inference_layout(specs, ranks=[0]))
    weights = _weights(specs)
    trainer = {n: t.clone() for n, t in _megatron_locals(src.base, weights, specs, 1)[0].items()}
    sources = Fp8Sources(trainer, src, 0)
    engine = {n: torch.zeros(lt.shape, dtype=lt.dtype) for n, lt in dst.tensors[0].items()}
    ex = ReshardExecutor(
        build_reshard_plan(src, dst), 0, {**sources.tensors, **engine}, bucket_bytes=1 << 16, refresh=sources.refresh
    )
    current = {n: w.clone() for n, w in weights.items()}  # the HF weights, updated as the trainer's are
    for version, scale in ((1, 1.0), (2, -3.0)):
        for t in (*trainer.values(), *current.values()):
            t.mul_(scale)
        ex.refit(version)
        # what the engine loads after dequantizing equals the trainer's weights up to FP8 rounding (2^-4 of
        # the largest element bounds every element's error, see the quantizer's test); the rest is exact
        loaded = dict(dequantized(dst.hf_tensors(0, engine), torch.float32))
        assert set(loaded) == {s.name for s in specs}
        for name, w in current.items():
            want = w.float()
            if src.specs[name].dtype == torch.float8_e4m3fn:
                assert float((loaded[name] - want).abs().max()) <= 2**-4 * float(want.abs().max()), name
            else:
                assert torch.equal(loaded[name], want), name
    held = {n: t.clone() for n, t in engine.items()}
    trainer["decoder.layers.0.mlp.linear_fc2.weight"][3, 3] = float("nan")
    with pytest.raises(RefitRejected, match=r"model.layers.0.mlp.down_proj.weight_scale_inv") as err:
        ex.refit(3)
    assert err.value.reason == "nonfinite" and ex.version == 2
    assert all(torch.equal(held[n].view(torch.uint8), engine[n].view(torch.uint8)) for n in held)
    assert sources.nbytes < sum(t.nbytes for t in trainer.values()) // 2 + 4096


def test_engine_job_takes_the_trainers_fp8_and_loads_it_dequantized():
    """Across jobs (a RefitGroup; the two refit ranks are threads here): the engine builds its layout from the
    trainer's published specs in the model's dtype; the trainer's FP8 recipe makes the plan FP8 on both sides,
    and ``dequantize=True`` hands ``load_weights`` exactly the dequantized FP8 checkpoint (no scales)."""
    import threading

    from megatron_ext.testing.multirank import free_port
    from megatron_ext.weight_export import EngineRefit, RefitGroup, TrainerRefit

    specs = gpt_specs(**ALIGNED)
    weights = _weights(specs)
    src = fp8_layout(megatron_layout(specs, ranks=[0]))
    sources = Fp8Sources(_megatron_locals(src.base, weights, specs, 1)[0], src, 0)
    port, out, loaded = free_port(), {}, {}

    def trainer():
        group = RefitGroup.join("127.0.0.1", port, 0, 2, timeout_s=30)
        dst = fp8_layout(inference_layout(specs, ranks=[1]))
        refit = TrainerRefit(group, src, dst, sources.tensors, bucket_bytes=1 << 16, refresh=sources.refresh)
        refit.refit(7)
        out["acks"] = refit.engine_versions()
        refit.close()

    def engine():
        group = RefitGroup.join("127.0.0.1", port, 1, 2, timeout_s=30)
        refit = EngineRefit(
            group,
            None,
            lambda published, trainer: inference_layout(published, ranks=[1]),
            load_weights=lambda pairs: loaded.update((n, t.clone()) for n, t in pairs),
            expected={s.name: (s.shape, s.dtype) for s in specs},
            dequantize=True,
            bucket_bytes=1 << 16,
        )
        out["engine_held"] = refit.serve(timeout_s=30)

    threads = [threading.Thread(target=f) for f in (trainer, engine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a refit rank hung"
    assert out == {"acks": {1: 7}, "engine_held": 7}
    assert set(loaded) == {s.name for s in specs}
    for name, w in weights.items():
        want = dequantize_blocks(*quantize_blocks(w)) if src.specs[name].dtype == torch.float8_e4m3fn else w
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], want), name


@pytest.mark.gpus(1)
def test_cuda_kernel_gives_the_same_bits_as_the_pytorch_path():
    """On CUDA the quantizer is one Triton kernel; it must store exactly what the PyTorch ops compute (the
    same max, the same correctly rounded division, the same saturating e4m3 conversion), partial blocks,
    zero blocks, NaN and Inf included."""
    from megatron_ext.weight_export.plan import fp8

    assert fp8._triton_kernel() is not None, "Triton is not usable on this GPU machine"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(520, 700, generator=g)
    x[:128, :128] *= 1e-30  # tiny values: subnormal after scaling
    x[128:256, 128:256] = 0
    x[300, 600] = float("nan")
    x[400, 10] = float("inf")
    for dtype in (torch.bfloat16, torch.float32):
        xc = x.to(dtype).cuda()
        q1, s1 = fp8._quantize_triton(fp8._triton_kernel(), xc, 128, None)
        q2, s2 = fp8._quantize_torch(xc, 128, None)
        assert torch.equal(s1.isnan(), s2.isnan()) and torch.equal(s1.nan_to_num(), s2.nan_to_num()), dtype
        finite = torch.isfinite(s2).repeat_interleave(128, 0).repeat_interleave(128, 1)[:520, :700]
        assert torch.equal(q1.view(torch.uint8)[finite], q2.view(torch.uint8)[finite]), dtype


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (same-size integers): equal bits, not only equal values (-0.0 is not 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def test_dequantize_into_out_and_wrong_scales_refused():
    """``out=`` (here a transposed view of a larger tensor, as an engine's fused weight gives) gets exactly
    what a new tensor gets and nothing around it changes; scales of another shape are refused (a broadcast
    would silently scale whole rows with one block's scale)."""
    g = torch.Generator().manual_seed(3)
    q, s = quantize_blocks(torch.randn(200, 300, generator=g))
    want = dequantize_blocks(q, s, torch.bfloat16)
    base = torch.full((310, 200), float("nan"), dtype=torch.bfloat16)
    got = dequantize_blocks(q, s, torch.bfloat16, out=base[5:305].t())
    assert got.data_ptr() == base[5].data_ptr() and torch.equal(_bits(got), _bits(want))
    assert base[:5].isnan().all() and base[305:].isnan().all()
    with pytest.raises(ValueError, match=r"scale_inv has shape \(1, 3\).*has \(2, 3\)"):
        dequantize_blocks(q, s[:1], torch.bfloat16)
    with pytest.raises(ValueError, match=r"out is .* torch.float32.*dtype torch.bfloat16"):
        dequantize_blocks(q, s, torch.bfloat16, out=torch.empty(200, 300))


# dequantize kernel cases: shapes (whole blocks, ragged edges, smaller than one block) and scales
DEQUANTIZE_SHAPES = [(384, 256), (1024, 128), (200, 300), (129, 257), (64, 1000), (5, 7), (1, 1)]


def _dequantize_inputs(shape, g):
    """FP8 values and float32 scales over the whole ranges both take: every finite e4m3 bit pattern (both
    zeros and subnormals included), scales from 2^-140 (an fp32 subnormal) to 2^100 (products past fp16's
    range, and fp32 subnormals that a flush-to-zero would lose)."""
    patterns = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    patterns[(patterns & 0x7F) == 0x7F] = 0x7E  # 0x7F / 0xFF are e4m3fn's NaNs
    exponents = torch.randint(-140, 101, scale_shape(shape), generator=g).float()
    scale = torch.randn(scale_shape(shape), generator=g).abs().add(0.5) * torch.exp2(exponents)
    return patterns.view(torch.float8_e4m3fn), scale


@pytest.mark.gpus(1)
def test_cuda_dequantize_kernel_gives_the_same_bits_as_the_pytorch_path():
    """On CUDA the dequantizer is one Triton kernel per call (named ``dequantize`` in the profiler); it must
    store exactly what the PyTorch ops compute (e4m3 widened to float32, one float32 product, one rounding
    to the output dtype), on the GPU and on the CPU, into a new tensor or a strided ``out``."""
    from megatron_ext.weight_export.plan import fp8

    assert fp8._dequantize_kernel() is not None, "Triton is not usable on this GPU machine"
    g = torch.Generator().manual_seed(4)
    cases = []  # (shape, dtype, q, s, PyTorch path on the GPU, base of a transposed out view)
    for shape in DEQUANTIZE_SHAPES:
        q_cpu, s_cpu = _dequantize_inputs(shape, g)
        q, s = q_cpu.cuda(), s_cpu.cuda()
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            want = fp8._dequantize_torch(q, s, dtype, 128, None)
            assert torch.equal(_bits(want.cpu()), _bits(dequantize_blocks(q_cpu, s_cpu, dtype))), (shape, dtype)
            base = torch.full((shape[1], shape[0] + 3), float("nan"), dtype=dtype, device="cuda")
            cases.append((shape, dtype, q, s, want, base))

    def run():
        return [
            (dequantize_blocks(q, s, dtype), dequantize_blocks(q, s, dtype, out=base[:, 3:].t()))
            for _, dtype, q, s, _, base in cases
        ]

    run()  # every specialization compiled outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        results = run()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2 * len(cases) and all("dequantize" in k for k in kernels), kernels
    for (shape, dtype, _, _, want, base), (got, into) in zip(cases, results):
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(_bits(got), _bits(want)), (shape, dtype, int((_bits(got) != _bits(want)).sum()))
        assert into.data_ptr() == base[0, 3].data_ptr() and torch.equal(_bits(into), _bits(want)), (shape, dtype)
        assert base[:, :3].isnan().all()
    # a NaN scale (a block the trainer found non-finite) gives NaN over exactly its block
    q, s = (t.cuda() for t in _dequantize_inputs((200, 300), g))
    s[1, 2] = float("nan")
    got = dequantize_blocks(q, s, torch.bfloat16)
    assert got[128:, 256:].isnan().all() and not got[:128].isnan().any() and not got[:, :256].isnan().any()


@pytest.mark.gpus(1)
def test_cuda_kernels_address_tensors_of_more_than_2_31_elements():
    """Both kernels index with 64-bit offsets: in a (16512, 131072) weight the last block row starts at
    element 2^31, where a 32-bit ``row * cols`` wraps. That block row (quantized and dequantized through
    the whole tensor) must equal the same rows done on their own by the PyTorch path, and the rows before
    it must be untouched by it."""
    from megatron_ext.weight_export.plan import fp8

    assert fp8._triton_kernel() is not None and fp8._dequantize_kernel() is not None
    rows, cols = 129 * 128, 1 << 17  # rows * cols = 2^31 + 2^24
    x = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
    x[:-128].fill_(1.0)
    g = torch.Generator(device="cuda").manual_seed(5)
    x[-128:] = torch.randn(128, cols, generator=g, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_blocks(x)
    q_tail, s_tail = fp8._quantize_torch(x[-128:], 128, None)
    assert torch.equal(s[-1], s_tail[0]) and torch.equal(q[-128:].view(torch.uint8), q_tail.view(torch.uint8))
    assert (s[:-1] == 1.0 / fp8.FP8_MAX).all()  # blocks of ones: untouched by the last row's writes
    assert (q[:-128].view(torch.uint8) == q[0, 0].view(torch.uint8)).all()
    del x
    out = dequantize_blocks(q, s, torch.bfloat16)
    want = fp8._dequantize_torch(q_tail, s_tail, torch.bfloat16, 128, None)
    assert torch.equal(_bits(out[-128:]), _bits(want)) and (out[:-128] == 1.0).all()
