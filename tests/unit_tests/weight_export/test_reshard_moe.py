"""Reshard refit from a real megatron-core MoE trainer (EP2, local experts on
each EP rank) to engine ranks: experts TP-sharded (fused gate_up per expert)
or whole experts per engine EP rank. The reference is a hand-written
conversion of the trainer's own parameters. The same expert bytes under
TEGroupedMLP's names (``linear_fc1.weight{j}``; TE does not run on CPU) move
exactly too, with specs built for grouped-GEMM experts."""

import re

import torch

from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks

SPEC = tiny_llama.TinyLlamaSpec(arch="llama")
EXPERTS, MOE_FFN = 4, 32
CASES = {"ep2_to_tp2": dict(tp=2), "ep2_to_ep2": dict(tp=1, dp=2, ep=2)}


def _config():
    return tiny_llama.transformer_config(
        SPEC,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=MOE_FFN,
        expert_model_parallel_size=2,
        moe_router_topk=2,
        moe_grouped_gemm=False,
    )


def _layouts(case, grouped_gemm=False):
    from megatron_ext.sharding import megatron_layout, specs_from_config
    from megatron_ext.weight_export.plan.layout import inference_layout

    specs = specs_from_config(
        _config(), vocab_size=SPEC.hf_vocab_size, padded_vocab_size=SPEC.vocab_size, grouped_gemm=grouped_gemm
    )
    return megatron_layout(specs, tp=1, dp=2, ep=2, ranks=[0, 1]), inference_layout(specs, **CASES[case], ranks=[2, 3])


def _body():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.weight_export.exec.reshard import ReshardExecutor, megatron_tensors
    from megatron_ext.weight_export.plan.reshard_plan import build_reshard_plan

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    rank = dist.get_rank()
    torch.manual_seed(SPEC.seed + rank)
    tensor_parallel.model_parallel_cuda_manual_seed(SPEC.seed)
    model = GPTModel(
        config=_config(),
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm"
        ),
        vocab_size=SPEC.vocab_size,
        max_sequence_length=SPEC.seq_length,
        position_embedding_type="rope",
    )
    with torch.no_grad():  # CPU init repeats local experts on every EP rank: make each expert distinct
        for i, (n, p) in enumerate(model.named_parameters()):
            if ".local_experts." in n:
                gen = torch.Generator().manual_seed(1000 * ps.get_expert_model_parallel_rank() + i)
                p.add_(torch.randn(p.shape, generator=gen))
    params = megatron_tensors(model)
    out = {"params": {n: t.clone() for n, t in params.items()} if rank < 2 else None}
    # TEGroupedMLP holds local expert j as linear_fc1.weight{j} / linear_fc2.weight{j}: the same tensors renamed
    grouped = {
        re.sub(r"local_experts\.(\d+)\.(linear_fc[12])\.weight$", r"\2.weight\1", n): t for n, t in params.items()
    }
    for case in CASES:
        for names, trainer in (("sequential", params), ("grouped", grouped)):
            src, dst = _layouts(case, grouped_gemm=names == "grouped")
            engine = {n: torch.full(lt.shape, float("nan")) for n, lt in dst.tensors.get(rank, {}).items()}
            ex = ReshardExecutor(
                build_reshard_plan(src, dst), rank, {**(trainer if rank < 2 else {}), **engine}, bucket_bytes=8192
            )
            ex.refit(1)
            out[case, names] = engine
    out["grouped_names"] = sorted(n for n in grouped if ".experts." in n) if rank < 2 else None
    return out


def _reference(p0, p1):
    """HF tensors by hand: dense from rank 0, expert e from EP rank e // 2 (local index e % 2)."""
    cfg = _config()
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    hd = cfg.hidden_size // heads
    ref = {
        "model.embed_tokens.weight": p0["embedding.word_embeddings.weight"][: SPEC.hf_vocab_size],
        "lm_head.weight": p0["output_layer.weight"][: SPEC.hf_vocab_size],
        "model.norm.weight": p0["decoder.final_layernorm.weight"],
    }
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = p0[m + "self_attention.linear_qkv.weight"].view(groups, (heads // groups + 2) * hd, -1)
        q_rows = heads // groups * hd
        ref[h + "self_attn.q_proj.weight"] = qkv[:, :q_rows].reshape(-1, cfg.hidden_size)
        ref[h + "self_attn.k_proj.weight"] = qkv[:, q_rows : q_rows + hd].reshape(-1, cfg.hidden_size)
        ref[h + "self_attn.v_proj.weight"] = qkv[:, q_rows + hd :].reshape(-1, cfg.hidden_size)
        ref[h + "self_attn.o_proj.weight"] = p0[m + "self_attention.linear_proj.weight"]
        ref[h + "input_layernorm.weight"] = p0[m + "input_layernorm.weight"]
        ref[h + "post_attention_layernorm.weight"] = p0[m + "pre_mlp_layernorm.weight"]
        ref[h + "mlp.gate.weight"] = p0[m + "mlp.router.weight"]
        for e in range(EXPERTS):
            p = (p0, p1)[e // 2]
            me = m + f"mlp.experts.local_experts.{e % 2}."
            ref[h + f"mlp.experts.{e}.gate_proj.weight"] = p[me + "linear_fc1.weight"][:MOE_FFN]
            ref[h + f"mlp.experts.{e}.up_proj.weight"] = p[me + "linear_fc1.weight"][MOE_FFN:]
            ref[h + f"mlp.experts.{e}.down_proj.weight"] = p[me + "linear_fc2.weight"]
    return ref


def test_moe_reshard_exact():
    results = run_on_ranks(_body, 4, backend="gloo", timeout=240)
    p0, p1 = results[0]["params"], results[1]["params"]
    assert not torch.equal(
        p0["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
        p1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
    )  # distinct experts
    ref = _reference(p0, p1)
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight1" in results[1]["grouped_names"]
    for case in CASES:
        for names in ("sequential", "grouped"):
            src, dst = _layouts(case, grouped_gemm=names == "grouped")
            if names == "grouped":  # the layout names the renamed tensors: every one of them is a source
                assert sorted(n for n in src.tensors[1] if ".experts." in n) == results[1]["grouped_names"]
            for r in dst.ranks:
                for n, lt in dst.tensors[r].items():
                    want = torch.cat([ref[s.name][tuple(slice(a, b) for a, b in s.box.ranges)] for s in lt.segments])
                    torch.testing.assert_close(
                        results[r][case, names][n], want, rtol=0, atol=0, msg=f"{case} {names} rank {r} {n}"
                    )
        if case == "ep2_to_ep2":  # whole experts per engine EP rank: rank 3 keeps experts 2, 3 only
            assert not any(".experts.0." in n or ".experts.1." in n for n in dst.tensors[3])
