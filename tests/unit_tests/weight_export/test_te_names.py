"""Transformer Engine's fused layer specs name layernorm weights differently
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); TE cannot
run on CPU, so a module with TE's parameter names and shapes stands in."""

import types

import torch
from torch import nn

from megatron_ext.weight_export import local_sources


def _te_like_gpt(hidden=32, heads=4, groups=2, ffn=48, vocab=64, layers=2, offset=3):
    head_dim = hidden // heads

    def layer(number):
        m = nn.Module()
        m.layer_number = number
        m.self_attention = nn.Module()
        m.self_attention.linear_qkv = nn.Module()
        m.self_attention.linear_qkv.weight = nn.Parameter(torch.zeros((heads + 2 * groups) * head_dim, hidden))
        m.self_attention.linear_qkv.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        m.self_attention.linear_proj = nn.Linear(hidden, hidden, bias=False)
        m.mlp = nn.Module()
        m.mlp.linear_fc1 = nn.Module()
        m.mlp.linear_fc1.weight = nn.Parameter(torch.zeros(2 * ffn, hidden))
        m.mlp.linear_fc1.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        m.mlp.linear_fc2 = nn.Linear(ffn, hidden, bias=False)
        return m

    model = nn.Module()
    model.config = types.SimpleNamespace(num_moe_experts=None, num_attention_heads=heads, num_query_groups=groups,
                                         kv_channels=head_dim, hidden_size=hidden, gated_linear_unit=True)
    model.share_embeddings_and_output_weights = False
    model.decoder = nn.Module()
    # A later pipeline stage: local layers 0..1 are global layers 3..4.
    model.decoder.layers = nn.ModuleList([layer(offset + j + 1) for j in range(layers)])
    model.decoder.final_layernorm = nn.Module()
    model.decoder.final_layernorm.weight = nn.Parameter(torch.ones(hidden))
    model.output_layer = nn.Module()
    model.output_layer.weight = nn.Parameter(torch.zeros(vocab, hidden))
    return model


def test_te_fused_layernorm_names_map_to_hf_layernorms():
    sources = local_sources(_te_like_gpt(), pp_rank=1)
    by_name = {s.mcore_name: s for s in sources}
    assert by_name["decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"].outputs == (
        ("model.layers.3.input_layernorm.weight", (32,)),)
    assert by_name["decoder.layers.4.mlp.linear_fc1.layer_norm_weight"].outputs == (
        ("model.layers.4.post_attention_layernorm.weight", (32,)),)
    assert [n for n, _ in by_name["decoder.layers.3.self_attention.linear_qkv.weight"].outputs] == [
        "model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight"]
    assert by_name["decoder.layers.3.self_attention.linear_qkv.weight"].outputs[1][1] == (16, 32)
    assert by_name["decoder.layers.4.mlp.linear_fc1.weight"].outputs == (
        ("model.layers.4.mlp.gate_proj.weight", (48, 32)), ("model.layers.4.mlp.up_proj.weight", (48, 32)))
    assert {s.pp_rank for s in sources} == {1}
    assert by_name["output_layer.weight"].outputs == (("lm_head.weight", (64, 32)),)
