"""megatron_ext.layers: LocalNorm (torch's LayerNorm / RMSNorm with sequence parallelism) and the local GPT
block spec built with it; uniform TP2 with sequence parallelism trains like TP1.

Tolerance: the same bar as the NTP parity tests (tests/unit_tests/nonuniform_tp/test_ntp_training.py, RTOL
and WEIGHT_ATOL). Every run trains the same global model on the same global batches in fp32; sequence
parallelism changes only the order of reductions (the norms' and row-parallel biases' gradients summed over
the sequence parts of the TP ranks, the reduce-scatter of the row-parallel outputs), so the losses agree
within fp32 rounding carried through 10 Adam steps (observed: 2.1e-7 relative, weights 1.9e-5). A fault is
far outside it: the norms' parameters left unmarked (``sequence_parallel=False``, so finalize_model_grads
does not sum their gradients over TP) put the loss 1.7e-4 relative off and a weight 9.4e-3 off.
"""

import pytest
import torch

from megatron_ext.layers import NORMALIZATIONS, LocalNorm, local_gpt_block_spec, with_local_norms
from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks

from ..nonuniform_tp.ntp_bodies import train_cases
from ..nonuniform_tp.test_ntp_training import RTOL, STEPS, WEIGHT_ATOL, _backends

SPEC = tiny_gpt.TinyGPTSpec()
# Llama-shaped: RMSNorm, gated MLP, GQA, and q/k layer norms (LocalNorm too)
SPEC_RMS = tiny_gpt.TinyGPTSpec(normalization="RMSNorm", gated_linear_unit=True, num_query_groups=2, qk_layernorm=True)


def test_local_norm_is_torchs_norm_with_its_parameters_marked():
    for normalization, cls, names in (
        ("LayerNorm", torch.nn.LayerNorm, ["weight", "bias"]),
        ("RMSNorm", torch.nn.RMSNorm, ["weight"]),
    ):
        spec = tiny_gpt.TinyGPTSpec(normalization=normalization)
        for sp in (True, False):
            config = tiny_gpt.transformer_config(spec, tp=2, sequence_parallel=sp)
            norm = LocalNorm(config, hidden_size=64, eps=1e-6)
            assert type(norm) is cls and norm.eps == 1e-6 and norm.weight.shape == (64,)
            assert [n for n, _ in norm.named_parameters()] == names
            assert all(p.sequence_parallel is sp for p in norm.parameters()), (normalization, sp)
    assert NORMALIZATIONS == ("LayerNorm", "RMSNorm")


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(layernorm_zero_centered_gamma=True), r"TransformerConfig\.layernorm_zero_centered_gamma=True"),
        (dict(persist_layer_norm=True), r"TransformerConfig\.persist_layer_norm=True"),
        (dict(memory_efficient_layer_norm=True), r"TransformerConfig\.memory_efficient_layer_norm=True"),
        (dict(normalization="L2Norm"), r"normalization must be one of \('LayerNorm', 'RMSNorm'\), got 'L2Norm'"),
    ],
)
def test_local_norm_refuses_what_torchs_norms_cannot_do(overrides, match):
    config = tiny_gpt.transformer_config(SPEC, tp=2, sequence_parallel=True, **overrides)
    with pytest.raises(ValueError, match=match):
        LocalNorm(config, hidden_size=64)


def test_block_spec_has_local_norms_everywhere_and_leaves_megatrons_spec_alone():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = tiny_gpt.transformer_config(SPEC_RMS, tp=2, sequence_parallel=True)
    block = local_gpt_block_spec(config, pp_rank=0)
    assert block.layer_norm is LocalNorm and len(block.layer_specs) == SPEC_RMS.num_layers
    for layer in block.layer_specs:
        sub = layer.submodules
        attn = sub.self_attention.submodules
        assert sub.input_layernorm is sub.pre_mlp_layernorm is attn.q_layernorm is attn.k_layernorm is LocalNorm
    megatron = get_gpt_layer_local_spec(qk_layernorm=True)
    block = local_gpt_block_spec(config, megatron, pp_rank=0)
    assert [layer.submodules.input_layernorm for layer in block.layer_specs] == [LocalNorm] * SPEC_RMS.num_layers
    assert megatron.submodules.input_layernorm is WrappedTorchNorm  # copied, not changed
    assert megatron.submodules.self_attention.submodules.q_layernorm is WrappedTorchNorm
    assert with_local_norms([WrappedTorchNorm, torch.nn.Linear]) == [LocalNorm, torch.nn.Linear]


def _same_model_and_training(cases):
    """On TP1: tiny_gpt's model (LocalNorm) holds exactly the tensors, under the same names, of the same
    GPTModel built from Megatron's own local layer spec (WrappedTorchNorm). Then ``train_cases(cases)``."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ps.initialize_model_parallel()
    same = []
    for spec in (SPEC, SPEC_RMS):
        config = tiny_gpt.transformer_config(spec)
        ours = tiny_gpt.build_model(spec, config).state_dict()
        torch.manual_seed(spec.seed)  # as build_model seeds
        tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
        megatron = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(
                qk_layernorm=spec.qk_layernorm, normalization=spec.normalization
            ),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            position_embedding_type="learned_absolute",
        ).state_dict()
        same.append(
            list(ours) == list(megatron)
            and all(torch.equal(ours[k], megatron[k]) for k in ours if torch.is_tensor(ours[k]))
        )
    ps.destroy_model_parallel()
    return same, train_cases(cases)


@pytest.mark.parametrize("backend", _backends(2))
def test_sequence_parallel_tp2_trains_like_tp1(backend):
    """One 2-rank job: uniform TP2 with sequence parallelism (Megatron's DDP and forward-backward function,
    its finalize_model_grads) against TP1 x DP2 (one micro-batch of 1 per rank; TP2: 4 micro-batches), 10
    Adam steps, for the LayerNorm tiny GPT and a Llama-shaped one (RMSNorm, gated MLP, GQA, q/k layer norms).
    The losses per step agree within RTOL and the weights within WEIGHT_ATOL (the module docstring)."""
    cases = [
        (None, STEPS, dict(spec=SPEC)),
        (None, STEPS, dict(spec=SPEC, tp=2, sequence_parallel=True)),
        (None, STEPS, dict(spec=SPEC_RMS)),
        (None, STEPS, dict(spec=SPEC_RMS, tp=2, sequence_parallel=True)),
    ]
    per_rank = run_on_ranks(_same_model_and_training, 2, args=(cases,), timeout=300, backend=backend)
    for same, _ in per_rank:
        assert same == [True, True], "LocalNorm's model differs from Megatron's local spec's"
    runs = list(zip(*(results for _, results in per_rank)))
    for spec, (tp1, sp) in ((SPEC, runs[0:2]), (SPEC_RMS, runs[2:4])):
        assert all(not o["sequence_parallel"] for o in tp1) and all(o["sequence_parallel"] for o in sp)
        norms = [n for n in sp[0]["sp_params"] if "layernorm" in n]
        # input, pre-MLP (and q/k) norms of every layer and the final norm, their weight (and bias)
        per_norm = 2 if spec.normalization == "LayerNorm" else 1
        assert len(norms) == (spec.num_layers * (2 + 2 * spec.qk_layernorm) + 1) * per_norm, norms
        assert "decoder.final_layernorm.weight" in norms, norms

        def step_loss(results, step):  # equal micro-batches: the mean of the micro-batch means
            means = [s / n for o in {o["replica"]: o for o in results}.values() for s, n in o["reports"][step]]
            return sum(means) / len(means)

        rel = [abs(step_loss(sp, k) / step_loss(tp1, k) - 1) for k in range(STEPS)]
        assert max(rel) <= RTOL, f"{spec.normalization}: TP2 + SP vs TP1, relative loss error per step: {rel}"
        assert step_loss(tp1, STEPS - 1) < step_loss(tp1, 0) - 0.3, "the baseline did not learn"
        want = next(o for o in tp1 if o["final"] is not None)
        got = next(o for o in sp if o["final"] is not None)
        for name, w in want["final"].items():
            assert torch.equal(got["init"][name], want["init"][name]), name
            err = (got["final"][name] - w).abs().max().item()
            assert err <= WEIGHT_ATOL, f"{spec.normalization} {name}: {err}"
