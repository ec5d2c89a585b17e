"""Layout conversion is exact on Megatron-shaped shards (gated fc1 included)
and on real Megatron state dicts (``_extra_state`` included); inconsistent
input is refused with a ValueError naming the key."""

import copy
import io

import pytest
import torch

from megatron_ext.nonuniform_tp.checkpoint import merge_tp_shards, split_tp_full
from megatron_ext.nonuniform_tp.reshard import ShardSpec
from megatron_ext.nonuniform_tp import ntp_to_uniform, uniform_to_ntp
from megatron_ext.testing import tiny_gpt, tiny_llama
from megatron_ext.testing.multirank import run_on_ranks


def test_round_trip_between_degrees_is_exact():
    specs = {"qkv": ShardSpec(0), "fc1": ShardSpec(0, 2), "fc2": ShardSpec(1), "norm": ShardSpec(None)}
    full = {"qkv": torch.randn(24, 8), "fc1": torch.randn(48, 8), "fc2": torch.randn(8, 24), "norm": torch.randn(8)}
    base = split_tp_full(full, specs, 4)
    # gated fc1: rank 1 of 4 holds [gate rows 6..11; up rows 30..35]
    assert torch.equal(base[1]["fc1"], torch.cat([full["fc1"][6:12], full["fc1"][30:36]]))
    reduced = uniform_to_ntp(base, specs, tp_reduced=3)
    assert [r["fc2"].shape[1] for r in reduced] == [8, 8, 8]
    assert torch.equal(reduced[2]["fc1"], torch.cat([full["fc1"][16:24], full["fc1"][40:48]]))
    again = ntp_to_uniform(reduced, specs, tp_base=4)
    for a, b in zip(again, base):
        assert all(torch.equal(a[k], b[k]) for k in b)
    merged = merge_tp_shards(reduced, specs)
    assert all(torch.equal(merged[k], full[k]) for k in full)


# --- refusals: every inconsistent input is a ValueError naming the key -------------------------

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
NORM = "decoder.layers.0.input_layernorm.weight"
SPECS = {QKV: ShardSpec(0), FC1: ShardSpec(0, 2), NORM: ShardSpec(None)}


def _full():
    g = torch.Generator().manual_seed(0)
    return {
        QKV: torch.randn(32, 64, generator=g),
        FC1: torch.randn(64, 64, generator=g),
        NORM: torch.randn(64, generator=g),
    }


def test_shards_of_mixed_tp_degrees_are_refused():
    # A TP2 shard next to a TP4 shard used to merge into a (24, 64) QKV weight.
    tp2, tp4 = split_tp_full(_full(), SPECS, 2), split_tp_full(_full(), SPECS, 4)
    with pytest.raises(ValueError, match=rf"{QKV}: TP rank 1 holds \(8, 64\).*TP rank 0 \(16, 64\)"):
        merge_tp_shards([tp2[0], tp4[1]], SPECS)
    with pytest.raises(ValueError, match=QKV):
        ntp_to_uniform([tp2[0], tp4[1]], SPECS, tp_base=4)


def test_a_key_missing_from_any_rank_is_refused():
    s0, s1 = split_tp_full(_full(), SPECS, 2)
    del s0[NORM]  # used to be dropped silently
    with pytest.raises(ValueError, match=rf"{NORM}: in TP rank 1's state dict but missing from TP rank 0's"):
        merge_tp_shards([s0, s1], SPECS)
    s0, s1 = split_tp_full(_full(), SPECS, 2)
    del s1[QKV]  # used to be a bare KeyError
    with pytest.raises(ValueError, match=rf"{QKV}: in TP rank 0's state dict but missing from TP rank 1's"):
        uniform_to_ntp([s0, s1], SPECS, tp_reduced=1)


def test_the_same_shard_twice_is_refused():
    s0, _ = split_tp_full(_full(), SPECS, 2)
    for twice in ([s0, s0], [s0, copy.deepcopy(s0)], {0: s0, 1: s0}):
        with pytest.raises(ValueError, match="TP ranks 0 and 1 hold the same shard"):
            ntp_to_uniform(twice, SPECS, tp_base=4)
    # ... but all-constant split tensors (e.g. zero gradients) cannot tell, and merge
    zeros = [{QKV: torch.zeros(16, 64), NORM: torch.ones(64)} for _ in range(2)]
    assert torch.equal(merge_tp_shards(zeros, SPECS)[QKV], torch.zeros(32, 64))


def test_tp_rank_order_is_stated_by_a_mapping_or_a_list_and_checked_against_the_degree():
    full = _full()
    s = split_tp_full(full, SPECS, 4)
    by_rank = {2: s[2], 0: s[0], 3: s[3], 1: s[1]}  # any insertion order: the key is the TP rank
    merged = merge_tp_shards(by_rank, SPECS, tp=4)
    assert all(torch.equal(merged[k], full[k]) for k in full)
    with pytest.raises(ValueError, match=r"TP ranks \[0, 2\] are not 0..1 \(missing TP rank\(s\) \[1\]\)"):
        merge_tp_shards({0: s[0], 2: s[2]}, SPECS)
    with pytest.raises(ValueError, match=r"reduced_shards: got 3 shard\(s\) but tp_reduced=4"):
        ntp_to_uniform(s[:3], SPECS, tp_base=2, tp_reduced=4)
    with pytest.raises(ValueError, match=r"base_shards: got 4 shard\(s\) but tp_base=2"):
        uniform_to_ntp(s, SPECS, tp_reduced=1, tp_base=2)
    with pytest.raises(ValueError, match="looks like a single state dict"):
        merge_tp_shards(s[0], SPECS)
    with pytest.raises(ValueError, match="got none"):
        merge_tp_shards([], SPECS)
    with pytest.raises(ValueError, match="TP rank 1's entry is a Tensor"):
        merge_tp_shards([s[0], s[1][QKV]], SPECS)


def test_a_tensor_without_a_spec_is_refused():
    s = split_tp_full(_full(), SPECS, 2)
    with pytest.raises(ValueError, match=rf"{QKV}: no ShardSpec .* shard_specs\(model, gated_linear_unit\)"):
        merge_tp_shards(s, {})  # used to treat every tensor as replicated
    with pytest.raises(ValueError, match=rf"{QKV}: no ShardSpec"):
        split_tp_full(_full(), {}, 2)
    with pytest.raises(ValueError, match=rf"{NORM}: ShardSpec dim 1 does not fit a 1-dim tensor"):
        merge_tp_shards(s, {**SPECS, NORM: ShardSpec(1)})
    with pytest.raises(ValueError, match=rf"{FC1}: ShardSpec chunks must be a positive int"):
        split_tp_full(_full(), {**SPECS, FC1: ShardSpec(0, 0)}, 2)
    with pytest.raises(ValueError, match=rf"{FC1}: specs\[.*\] is a int, not a ShardSpec"):
        merge_tp_shards(s, {**SPECS, FC1: 0})
    odd = [{**sd, FC1: sd[FC1][:31]} for sd in s]  # a gated fc1 shard must hold two equal halves
    with pytest.raises(ValueError, match=rf"{FC1}: size 31 along dim 0 does not split into the 2 chunks"):
        merge_tp_shards(odd, SPECS)


def test_unequal_dtypes_and_non_tensor_values_are_refused():
    s0, s1 = split_tp_full(_full(), SPECS, 2)
    with pytest.raises(ValueError, match=rf"{NORM}: TP rank 1 holds \(64,\) torch.float64"):
        merge_tp_shards([s0, {**s1, NORM: s1[NORM].double()}], SPECS)
    with pytest.raises(ValueError, match=r"iteration: TP rank 0 holds a int, not a tensor.*'model' entry"):
        merge_tp_shards([{**s0, "iteration": 5}, {**s1, "iteration": 5}], {**SPECS, "iteration": ShardSpec(None)})
    with pytest.raises(ValueError, match=r"iteration: full holds a int, not a tensor"):
        split_tp_full({**_full(), "iteration": 5}, SPECS, 2)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, None])
def test_tp_degrees_must_be_positive_ints(bad):
    s = split_tp_full(_full(), SPECS, 2)
    with pytest.raises(ValueError, match=rf"tp_base must be a TP degree, a positive int .*got {bad!r}"):
        ntp_to_uniform(s, SPECS, tp_base=bad)
    with pytest.raises(ValueError, match=rf"tp_reduced must be a TP degree.*got {bad!r}"):
        uniform_to_ntp(s, SPECS, tp_reduced=bad)
    with pytest.raises(ValueError, match=rf"^tp must be a TP degree.*got {bad!r}"):
        split_tp_full(_full(), SPECS, bad)
    if bad is not None:  # None: the degree is not stated
        with pytest.raises(ValueError, match=rf"^tp must be a TP degree.*got {bad!r}"):
            merge_tp_shards(s, SPECS, tp=bad)


def test_a_size_that_does_not_split_at_the_target_degree_names_the_degree():
    s = split_tp_full(_full(), SPECS, 2)
    with pytest.raises(ValueError, match=rf"{QKV}: size 32 along dim 0 does not split into tp_base=5 TP shards"):
        ntp_to_uniform(s, SPECS, tp_base=5)


def test_extra_state_entries_are_carried_through_unchanged():
    extras = {
        "decoder.layers.0.mlp.linear_fc1._extra_state": None,
        "decoder.layers.0.self_attention.linear_qkv._extra_state": io.BytesIO(b"fp8 meta"),
        "output_layer._extra_state": torch.tensor([1, 2, 3], dtype=torch.uint8),
    }
    shards = [{**sd, **copy.deepcopy(extras)} for sd in split_tp_full(_full(), SPECS, 2)]
    for out in (ntp_to_uniform(shards, SPECS, tp_base=4), uniform_to_ntp(shards, SPECS, tp_reduced=1)):
        for sd in out:
            assert list(sd)[-3:] == list(extras)
            assert sd["decoder.layers.0.mlp.linear_fc1._extra_state"] is None
            buf = sd["decoder.layers.0.self_attention.linear_qkv._extra_state"]
            assert isinstance(buf, io.BytesIO) and buf.getvalue() == b"fp8 meta"
            assert torch.equal(sd["output_layer._extra_state"], extras["output_layer._extra_state"])
        bufs = [sd["decoder.layers.0.self_attention.linear_qkv._extra_state"] for sd in out]
        assert len({id(b) for b in bufs}) == len(bufs), "each rank gets its own copy"


# --- real Megatron state dicts: TP2 <-> TP1 bit for bit ------------------------------------------

GPT = tiny_gpt.TinyGPTSpec(gated_linear_unit=True, num_query_groups=2)
QWEN2 = tiny_llama.TinyLlamaSpec(arch="qwen2", tie_embeddings=True)


def _real_state_dicts_body():
    """Each rank's ``state_dict()`` of two tiny models at TP=2, then at TP=1
    (same global model), and the specs read from the TP=2 models."""
    from megatron.core import parallel_state as ps

    from megatron_ext.nonuniform_tp.checkpoint import shard_specs
    from megatron_ext.testing.ntp_job import init_job

    models = {"gpt": (tiny_gpt, GPT, GPT.gated_linear_unit), "qwen2": (tiny_llama, QWEN2, True)}
    out = {}
    for tp in (2, 1):
        init_job(None, tp)
        for key, (mod, spec, gated) in models.items():
            model = mod.build_model(spec, mod.transformer_config(spec, tp=tp))
            out[key, tp] = model.state_dict()
            if tp == 2:
                out[key, "specs"] = shard_specs(model, gated)
        ps.destroy_model_parallel()
    return out


def _assert_same_state(got, want):
    assert list(got) == list(want)
    for name, t in want.items():
        if t is None:
            assert got[name] is None, name
        else:
            assert got[name].shape == t.shape and got[name].dtype == t.dtype, name
            assert torch.equal(got[name], t), name
    assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None)


def test_real_state_dicts_convert_between_tp_degrees_bit_for_bit():
    """Megatron's own state_dict() (``_extra_state`` entries included): the
    merged TP=2 shards equal the TP=1 model, the TP=1 model splits into the
    TP=2 shards, and uniform TP=2 -> NTP TP=1 -> uniform TP=2 is exact."""
    out = run_on_ranks(_real_state_dicts_body, 2, backend="gloo", timeout=180)
    for key in ("gpt", "qwen2"):
        tp2 = {rank: out[rank][key, 2] for rank in (0, 1)}
        tp1, specs = out[0][key, 1], out[0][key, "specs"]
        assert any(n.endswith("._extra_state") for n in tp1) and any(s.chunks == 2 for s in specs.values())
        assert set(specs) == {n for n in tp1 if not n.endswith("._extra_state")}
        _assert_same_state(merge_tp_shards(tp2, specs, tp=2), tp1)
        for got, want in zip(split_tp_full(tp1, specs, 2), (tp2[0], tp2[1])):
            _assert_same_state(got, want)
        ntp = uniform_to_ntp(tp2, specs, tp_reduced=1, tp_base=2)
        _assert_same_state(ntp[0], tp1)
        for got, want in zip(ntp_to_uniform(ntp, specs, tp_base=2, tp_reduced=1), (tp2[0], tp2[1])):
            _assert_same_state(got, want)
        # the same refusals on real shards
        with pytest.raises(ValueError, match=r"embedding.word_embeddings.weight: TP rank 1 holds \(32, 64\)"):
            ntp_to_uniform([tp2[0], split_tp_full(tp1, specs, 4)[1]], specs, tp_base=4)
        with pytest.raises(ValueError, match="TP ranks 0 and 1 hold the same shard"):
            ntp_to_uniform([tp2[0], tp2[0]], specs, tp_base=4)
        with pytest.raises(ValueError, match=r"embedding.word_embeddings.weight: no ShardSpec"):
            ntp_to_uniform(tp2, {}, tp_base=4)


def test_conversions_log_progress_per_layer(caplog):
    full = {**_full(), "decoder.layers.1.input_layernorm.weight": torch.ones(64), "output_layer.weight": torch.ones(4)}
    specs = {**SPECS, "decoder.layers.1.input_layernorm.weight": ShardSpec(None), "output_layer.weight": ShardSpec(0)}
    with caplog.at_level("INFO", logger="megatron_ext.nonuniform_tp.checkpoint"):
        ntp_to_uniform(split_tp_full(full, specs, 2), specs, tp_base=4)
    lines = [r.getMessage() for r in caplog.records]
    merging = [line for line in lines if line.startswith("merging 2 TP shards")]
    assert [line.split(": ")[1] for line in merging] == ["decoder.layers.0", "decoder.layers.1", "other tensors"]
    assert "3 tensors" in merging[0] and "(5/5 tensors" in merging[-1], lines
    assert sum(line.startswith("splitting into 4 TP shards") for line in lines) == 3
