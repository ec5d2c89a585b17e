"""FP8 through the export hook (``RefitConfig.quantize="fp8-block"`` with the hook's bucket transports).

A TP2 x PP2 trainer (gloo, 4 ranks) quantizes each gathered whole HF tensor into the FP8 checkpoint
layout (``float8_e4m3fn`` + ``weight_scale_inv`` per 128 x 128 block) and sends it:

- over ``broadcast`` to a Hugging Face model in another process (a consumer that expects its weights in
  float32): the engine holds exactly ``dequantize(quantize(W))`` of the whole gathered tensors for the
  quantized weights and ``W`` for the others, after two versions (so the trainer requantized);
- in process to a consumer that expects the FP8 checkpoint itself: it gets the FP8 values and scales bit
  for bit what the quantizer makes of the whole tensors;
- the bytes on the wire are exactly 1 per quantized element + 4 per block + the unquantized tensors;
- a NaN in one shard is refused before the engine applies the version, naming the weight's scale, and the
  engine keeps the previous version;
- the KL of the FP8 engine against the float32 trainer is within the default gate (1e-3).

The model's FFN (320 = 2.5 blocks) and heads give partial blocks and TP shards that cut blocks, which
the hook allows (it quantizes after the gather); the p2p refit needs shards of whole blocks.

The same job then exports a Qwen3-MoE model at TP2 x EP2 x expert-TP2 (each rank holds half of two experts;
expert FFN 192 = 1.5 blocks, so every expert shard cuts a block) in process to a Hugging Face Qwen3-MoE
model (float32, fused 3-D experts) and to an FP8 consumer: every expert weight arrives with its
``weight_scale_inv`` under the checkpoint's per-expert names, the HF model holds exactly
``dequantize(quantize(W))`` of each whole expert weight, and the router, norms and embeddings arrive bit
for bit.
"""

import dataclasses

import pytest

import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks
from megatron_ext.testing.receiver_proc import start_hf_receiver

from ._reference import gathered_hf_state, hf_checkpoint_names, hf_state_from_megatron, moe_full_state

SPEC = dataclasses.replace(
    tiny_llama.TinyLlamaSpec(arch="qwen2", num_layers=2),
    hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=320,
)
# experts of 1.5 blocks (their expert-TP2 shards of 96 rows / columns cut blocks), 256-wide attention
MOE_SPEC = dataclasses.replace(
    tiny_llama.TinyLlamaSpec(arch="qwen3_moe", num_layers=2),
    hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    moe_ffn_hidden_size=192,
)
TIMEOUT = 240


def _quantized(name: str, t: torch.Tensor) -> bool:
    """The weights FP8 checkpoints quantize: 2-D linear weights of a decoder layer, not the MoE router."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and t.dim() == 2
        and not name.endswith(".mlp.gate.weight")
    )


class _Fp8Engine:
    """An engine that loads the FP8 checkpoint itself (expects FP8 weights and their scales)."""

    def __init__(self, expected):
        self.expected, self.state = expected, {}

    def expected_tensors(self):
        return self.expected

    def load_weights(self, weights):
        self.state.update({n: t.clone() for n, t in weights})


def _trainer(target):
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx
    from megatron_ext.weight_export.plan.fp8 import quantize_blocks

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC, tp=2, pp=2))
    common = dict(bucket_size_mb=0.25, vocab_size=SPEC.hf_vocab_size, timeout_s=60, quantize="fp8-block")
    exporter = wx.WeightExporter(model, wx.RefitConfig(target=target, transport="broadcast", **common))
    plain = wx.WeightExporter(
        model, wx.RefitConfig(transport="inprocess", bucket_size_mb=0.25, vocab_size=SPEC.hf_vocab_size)
    )
    out = {}
    exporter.export(version=1)
    with torch.no_grad():  # a training step's worth of change: the next export requantizes
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
    out["second"] = exporter.export(version=2)
    out["plan_bytes"], out["plain_bytes"] = exporter.plan.total_bytes, plain.plan.total_bytes
    out["staging"], out["buffer"] = exporter.plan.staging_bytes, exporter.plan.buffer_bytes
    out["extra"] = exporter.extra_memory_bytes
    out["plain_buffer"] = plain.plan.buffer_bytes
    reference = gathered_hf_state(SPEC, model)  # collective: every rank
    fp8 = None
    if exporter.is_export_rank:
        checkpoint = {}
        for name, w in reference.items():
            if _quantized(name, w):
                checkpoint[name], checkpoint[name + "_scale_inv"] = quantize_blocks(w)
            else:
                checkpoint[name] = w
        out["checkpoint"] = checkpoint
        fp8 = _Fp8Engine({n: (tuple(t.shape), t.dtype) for n, t in checkpoint.items()})
    local = wx.WeightExporter(
        model,
        wx.RefitConfig(transport="inprocess", **common),
        receiver=wx.WeightReceiver(fp8) if fp8 is not None else None,
    )
    local.export(version=2)
    if exporter.is_export_rank:
        out["fp8_engine"] = fp8.state
    # A NaN in one TP shard of each stage's first down_proj: refused before the engine applies the version.
    stage_layer = next(n for n, _ in model.named_parameters() if n.endswith("mlp.linear_fc2.weight"))
    with torch.no_grad():
        dict(model.named_parameters())[stage_layer].view(-1)[5] = float("nan")
    try:
        exporter.export(version=3)
        out["nan"] = None
    except wx.NonFiniteWeights as exc:
        out["nan"] = str(exc)
    with torch.no_grad():
        dict(model.named_parameters())[stage_layer].view(-1)[5] = 0.0
    out["fourth"] = exporter.export(version=4).applied
    reference = gathered_hf_state(SPEC, model)  # collective: every rank
    out["reference"] = reference if exporter.is_export_rank else None
    exporter.close()
    ps.destroy_model_parallel()
    out["moe"] = _moe_export()
    return out


def _moe_export():
    """TP2 x EP2 x expert-TP2 MoE export with fp8-block, in process to an HF model (bf16-style consumer:
    dequantized) and to an FP8 consumer (values and scales), versions 1 and 2 (requantized)."""
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2
    )
    cfg = tiny_llama.transformer_config(MOE_SPEC, tp=2, ep=2, expert_tensor_parallel_size=2)
    model = tiny_llama.build_model(MOE_SPEC, cfg)
    export_rank = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    common = dict(transport="inprocess", bucket_size_mb=0.25, vocab_size=MOE_SPEC.hf_vocab_size, quantize="fp8-block")
    hf = tiny_llama.hf_model(MOE_SPEC, tiny_llama.transformer_config(MOE_SPEC)) if export_rank else None
    names = wx.HFModelConsumer(hf).expected_tensors() if export_rank else None
    exporter = wx.WeightExporter(
        model, wx.RefitConfig(**common), receiver=wx.WeightReceiver(wx.HFModelConsumer(hf)) if export_rank else None
    )
    exporter.export(version=1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.25).add_(0.02)
    second = exporter.export(version=2)
    out = dict(second=second.applied, is_export_rank=exporter.is_export_rank)
    fp8 = None
    if exporter.is_export_rank:  # the FP8 engine lists every plan tensor: FP8 weights with their scales
        expected = {t.name: (tuple(t.shape), t.dtype) for t in exporter.plan.tensors()}
        fp8 = _Fp8Engine(expected)
        out["hf_names"] = names
    fp8_exporter = wx.WeightExporter(
        model, wx.RefitConfig(**common), receiver=wx.WeightReceiver(fp8) if fp8 is not None else None
    )
    fp8_exporter.export(version=2)
    state = moe_full_state(model)  # collective: every rank
    if exporter.is_export_rank:
        out["fp8_engine"] = fp8.state
        out["received"] = hf_checkpoint_names(dict(hf.named_parameters()))
        out["reference"] = hf_state_from_megatron(
            state,
            num_layers=MOE_SPEC.num_layers,
            num_heads=MOE_SPEC.num_attention_heads,
            num_groups=MOE_SPEC.num_query_groups,
            hidden=MOE_SPEC.hidden_size,
            vocab=MOE_SPEC.hf_vocab_size,
            tied=MOE_SPEC.tie_embeddings,
        )
    exporter.close()
    fp8_exporter.close()
    ps.destroy_model_parallel()
    return out


def test_fp8_export_sends_the_fp8_checkpoint_and_engines_load_it():
    from megatron_ext.weight_export.plan.fp8 import dequantize_blocks, quantize_blocks

    with start_hf_receiver(tiny_llama.build_hf, (SPEC,)) as receiver:
        out = run_on_ranks(
            _trainer, 4, args=(receiver.address,), backend="gloo", timeout=TIMEOUT, watch=receiver.failure
        )
        got = receiver.result()
    assert got["ok"], got.get("error")
    export = out[0]
    # The NaN (in a TP shard of each stage's first down_proj) is found by the copy that gathers the weight in the
    # model's dtype before it is quantized (stage 1's leader sends its flags), and the export rank names both.
    want = "NaN/Inf in 2 tensor(s): model.layers.0.mlp.down_proj.weight, model.layers.1.mlp.down_proj.weight;"
    assert export["nan"] is not None and want in export["nan"], export["nan"]
    assert got["applied"] == [1, 2, 4], "version 3 (NaN) must not be applied"
    checkpoint, reference = export["checkpoint"], export["reference"]
    # The in-process FP8 engine got the checkpoint bit for bit (values and scales) at version 2.
    assert export["fp8_engine"].keys() == checkpoint.keys()
    for name, want in checkpoint.items():
        assert export["fp8_engine"][name].dtype == want.dtype, name
        assert torch.equal(export["fp8_engine"][name].view(torch.uint8), want.view(torch.uint8)), name
    # The HF engine (float32 weights) holds version 4 dequantized: exactly dequantize(quantize(W)).
    assert got["state"].keys() == reference.keys()
    quantized = [n for n, w in reference.items() if _quantized(n, w)]
    assert len(quantized) == 7 * SPEC.num_layers
    for name, w in reference.items():
        want = dequantize_blocks(*quantize_blocks(w), w.dtype) if name in quantized else w
        assert torch.equal(got["state"][name], want), name
        if name in quantized:
            assert not torch.equal(want, w), f"{name}: FP8 rounding must show (the test would not see a bf16 path)"
    # Wire bytes: 1 per quantized element + 4 per 128 x 128 block + the other tensors in their dtype, each
    # tensor at a 256-byte aligned offset (the plan's sizes are exact, not aligned).
    blocks = {n: -(-reference[n].shape[0] // 128) * -(-reference[n].shape[1] // 128) for n in quantized}
    want_bytes = sum(
        reference[n].numel() + 4 * blocks[n] if n in blocks else reference[n].numel() * reference[n].itemsize
        for n in reference
    )
    assert export["plan_bytes"] == want_bytes
    assert export["plain_bytes"] == sum(w.numel() * w.itemsize for w in reference.values())
    assert export["fourth"] == (4,)
    # Memory: the staging buffer (float32 of the quantized weights of a bucket) stays within the bucket size
    # the plain plan would use; each export buffer is no larger than the plain plan's.
    assert 0 < export["staging"] <= export["plain_buffer"] and export["buffer"] <= export["plain_buffer"]
    assert export["extra"] <= 4 * export["plain_buffer"]
    _check_moe(out)


def _check_moe(out):
    """The MoE export (see the module doc), read on the export rank."""
    from megatron_ext.weight_export.plan.fp8 import dequantize_blocks, quantize_blocks

    export = next(o["moe"] for o in out if o["moe"]["is_export_rank"])
    assert [o["moe"]["is_export_rank"] for o in out].count(True) == 1
    assert export["second"] == (2,)
    reference, received, fp8 = export["reference"], export["received"], export["fp8_engine"]
    experts = [n for n in reference if ".mlp.experts." in n]
    assert len(experts) == 3 * MOE_SPEC.num_moe_experts * MOE_SPEC.num_layers
    assert not torch.equal(
        reference["model.layers.0.mlp.experts.0.gate_proj.weight"],
        reference["model.layers.0.mlp.experts.2.gate_proj.weight"],
    ), "experts must differ per EP rank"
    quantized = {n for n, w in reference.items() if _quantized(n, w)}
    assert set(experts) <= quantized and "model.layers.1.mlp.gate.weight" in reference
    # The FP8 consumer: exactly the checkpoint names (each quantized weight and its weight_scale_inv, the rest
    # as they are), the quantizer's values and scales of the whole tensors, the other tensors bit for bit.
    assert fp8.keys() == reference.keys() | {n + "_scale_inv" for n in quantized}
    assert set(export["hf_names"]) == reference.keys()
    for name, w in reference.items():
        if name in quantized:
            q, s = quantize_blocks(w)
            assert fp8[name].dtype == torch.float8_e4m3fn, name
            assert torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8)), name
            assert fp8[name + "_scale_inv"].shape == ((w.shape[0] + 127) // 128, (w.shape[1] + 127) // 128), name
            assert torch.equal(fp8[name + "_scale_inv"], s), name
        else:
            assert torch.equal(fp8[name], w), name
    # The HF model (float32, fused experts): dequantize(quantize(W)) for the quantized weights, W for the rest.
    assert received.keys() == reference.keys()
    for name, w in reference.items():
        want = dequantize_blocks(*quantize_blocks(w), w.dtype) if name in quantized else w
        assert torch.equal(received[name], want), name
        if name in quantized:
            assert not torch.equal(want, w), f"{name}: FP8 rounding must show"


def _gpu_trainer(target):
    from megatron.core import parallel_state as ps

    from megatron_ext import weight_export as wx

    ps.initialize_model_parallel()
    device = torch.device("cuda", torch.cuda.current_device())
    model = tiny_llama.build_model(SPEC, tiny_llama.transformer_config(SPEC), device=device)
    cfg = wx.RefitConfig(transport="ipc", target=target, bucket_size_mb=0.25, vocab_size=SPEC.hf_vocab_size)
    exporter = wx.WeightExporter(model, dataclasses.replace(cfg, quantize="fp8-block"))
    exporter.export(version=1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
    second = exporter.export(version=2)
    verify = exporter.verify(tiny_llama.tokens(SPEC).to(device))
    from megatron_ext.weight_export.plan.fp8 import dequantize_blocks, quantize_blocks

    reference = gathered_hf_state(SPEC, model)  # on the CPU
    # the Triton kernel's FP8 checkpoint of the whole tensors, dequantized on the GPU as the receiver does
    want = {
        n: dequantize_blocks(*quantize_blocks(w.to(device)), w.dtype).cpu()
        for n, w in reference.items()
        if _quantized(n, w)
    }
    exporter.close()
    return dict(second=second.applied, verify=verify, reference=reference, want=want)


@pytest.mark.gpus(1)
def test_fp8_export_on_gpu_to_a_colocated_engine():
    """One GPU: the Triton quantizer writes into the export buffers shared over CUDA IPC with an HF engine
    on the same GPU, which loads the weights dequantized; the engine's logits pass the default KL gate
    against the trainer's."""
    with start_hf_receiver(tiny_llama.build_hf, (SPEC,), device="cuda:0") as receiver:
        (out,) = run_on_ranks(_gpu_trainer, 1, args=(receiver.address,), backend="nccl", timeout=TIMEOUT)
        got = receiver.result()
    assert got["ok"], got.get("error")
    assert out["second"] == (2,) and got["applied"] == [1, 2]
    for name, w in out["reference"].items():
        want = out["want"].get(name, w)
        assert torch.equal(got["state"][name], want), f"{name}: {(got['state'][name] != want).sum()} elements differ"
    assert len(out["want"]) == 7 * SPEC.num_layers
    print(f"FP8 export KL against the trainer: {out['verify'].kl:.3g}, max logit diff {out['verify'].max_abs_diff:.3g}")
    assert out["verify"].ok(max_kl=1e-3), out["verify"]
