"""Layout conversion is exact on Megatron-shaped shards (gated fc1 included)."""

import torch

from megatron_ext.nonuniform_tp.checkpoint import merge_tp_shards, split_tp_full
from megatron_ext.nonuniform_tp.reshard import ShardSpec
from megatron_ext.nonuniform_tp import ntp_to_uniform, uniform_to_ntp


def test_round_trip_between_degrees_is_exact():
    specs = {"qkv": ShardSpec(0), "fc1": ShardSpec(0, 2), "fc2": ShardSpec(1), "norm": ShardSpec(None)}
    full = {"qkv": torch.randn(24, 8), "fc1": torch.randn(48, 8), "fc2": torch.randn(8, 24),
            "norm": torch.randn(8)}
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
