"""FP8 refit on CPU, without spawned ranks.

- The block quantizer is within FP8 rounding of its input, with the bound derived below, and puts a NaN or
  Inf into its block's scale.
- Planned over trainer shards (Megatron TP2, TP1 x DP2, TP2 x PP2) and applied, the engine receives exactly
  the checkpoint an FP8 converter makes from the whole HF tensors (``quantize_blocks`` on each full tensor),
  in the bytes the format says: 1 per weight element plus 4 per block.
- A shard that does not cover whole blocks is refused when the layout is built, naming the tensor.
- Through the executor (trainer and engine TP1 on one rank: every byte is a local copy), each refit
  requantizes the current weights, and a NaN is refused before a byte moves, naming the weight.
"""

import pytest
import torch

from megatron_ext.sharding import fp8_layout, gpt_specs, megatron_layout
from megatron_ext.weight_export import RefitRejected, ReshardExecutor, build_reshard_plan, inference_layout
from megatron_ext.weight_export.fp8 import FP8_MAX, Fp8Sources, dequantize_blocks, dequantized, quantize_blocks
from megatron_ext.weight_export.reshard_plan import check_reshard_plan

from .test_reshard_plan import _apply, _engine_locals, _hf_weights, _megatron_locals

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


CASES = {
    "tp2_to_tp1": (dict(tp=2), dict(tp=1)),
    "tp1dp2_to_tp2": (dict(tp=1, dp=2), dict(tp=2)),
    "tp2pp2_to_tp2dp2": (dict(tp=2, pp=2), dict(tp=2, dp=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_receives_the_fp8_checkpoint_of_the_whole_tensors(case):
    mkw, ekw = CASES[case]
    specs = gpt_specs(**ALIGNED)
    src = megatron_layout(specs, **mkw)
    world = len(src.ranks)
    dst = inference_layout(specs, **ekw, ranks=range(world, world + ekw["tp"] * ekw.get("dp", 1)))
    fsrc, fdst = fp8_layout(src), fp8_layout(dst)
    plan = build_reshard_plan(fsrc, fdst)
    check_reshard_plan(plan)
    weights = _weights(specs)
    trainer = _megatron_locals(src, weights, specs, mkw["tp"])
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
    from megatron_ext.weight_export import fp8

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
