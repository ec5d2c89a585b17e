"""Test-only reference: Megatron GPT state (TP=1) -> HF names, written out by hand
independently of megatron_ext.weight_export's mapping code."""

import torch


def hf_state_from_megatron(state: dict, *, num_layers, num_heads, num_groups, hidden, vocab, tied) -> dict:
    hd = hidden // num_heads
    hpg = num_heads // num_groups
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if not tied:
        out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    for i in range(num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
        for suffix in ("weight", "bias"):
            key = m + "self_attention.linear_qkv." + suffix
            if key not in state:
                continue
            w = state[key]
            groups = [w[g * (hpg + 2) * hd:(g + 1) * (hpg + 2) * hd] for g in range(num_groups)]
            out[h + "self_attn.q_proj." + suffix] = torch.cat([g[:hpg * hd] for g in groups])
            out[h + "self_attn.k_proj." + suffix] = torch.cat([g[hpg * hd:(hpg + 1) * hd] for g in groups])
            out[h + "self_attn.v_proj." + suffix] = torch.cat([g[(hpg + 1) * hd:] for g in groups])
        for mq, hq in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            if m + f"self_attention.{mq}.weight" in state:
                out[h + f"self_attn.{hq}.weight"] = state[m + f"self_attention.{mq}.weight"]
        out[h + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        fc1 = state[m + "mlp.linear_fc1.weight"]
        out[h + "mlp.gate_proj.weight"] = fc1[: fc1.shape[0] // 2]
        out[h + "mlp.up_proj.weight"] = fc1[fc1.shape[0] // 2:]
        out[h + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
    return {k: v.detach().clone() for k, v in out.items()}


def reference_for(spec, model) -> dict:
    state = {n: p for n, p in model.named_parameters()}
    return hf_state_from_megatron(
        state, num_layers=spec.num_layers, num_heads=spec.num_attention_heads,
        num_groups=spec.num_query_groups, hidden=spec.hidden_size, vocab=spec.hf_vocab_size,
        tied=spec.tie_embeddings)
