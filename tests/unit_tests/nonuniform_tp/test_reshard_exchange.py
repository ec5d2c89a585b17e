"""The fold/unfold all-to-all inside a healthy TP group moves exact tensors
(row- and column-sharded, gated fc1, replicated; a replicated tensor that is a
partial sum per TP rank folds to the sum), on gloo and on NCCL."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.nonuniform_tp import reshard
from megatron_ext.nonuniform_tp.checkpoint import split_tp_full
from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks

SPECS = [reshard.ShardSpec(0), reshard.ShardSpec(1), reshard.ShardSpec(0, 2), reshard.ShardSpec(None)]


def _full():
    g = torch.Generator().manual_seed(0)
    return {
        "0": torch.randn(24, 4, generator=g),
        "1": torch.randn(4, 24, generator=g),
        "2": torch.randn(48, 4, generator=g),
        "3": torch.randn(4, generator=g),
    }


def _partial(rank):
    return torch.arange(6.0) * 10 ** (rank + 1) + rank


def _exchange_body(tp_base, tp_reduced):
    me, dev = dist.get_rank(), tiny_gpt.rank_device()
    specs = {str(i): s for i, s in enumerate(SPECS)}
    base = [{k: v.to(dev) for k, v in shard.items()} for shard in split_tp_full(_full(), specs, tp_base)]
    want = split_tp_full(_full(), specs, tp_reduced)
    mine = [base[me][str(i)] for i in range(len(SPECS))]
    shadow = [torch.full_like(want[me % tp_reduced][str(i)], float("nan"), device=dev) for i in range(len(SPECS))]
    pieces = [
        pc
        for i, s in enumerate(SPECS)
        for pc in reshard.reshard_pieces(i, s, mine[i].shape[s.dim] if s.dim is not None else 0, tp_base, tp_reduced)
    ]
    # a partial sum per TP rank (a q/k layer norm's gradient): rank k holds _partial(k)
    mine.append(_partial(me).to(dev))
    shadow.append(torch.full_like(mine[-1], float("nan")))
    pieces += reshard.reshard_pieces(len(SPECS), reshard.ShardSpec(None), 0, tp_base, tp_reduced, summed=True)
    reshard.exchange(pieces, me, None, src=lambda i: mine[i], dst=lambda i: shadow[i])
    folded = [t.cpu().clone() for t in shadow] if me < tp_reduced else None
    back = [torch.zeros_like(t) for t in mine]
    # spares' shadows are not valid sources; unfold reads core ranks' shadows only
    reshard.exchange(
        reshard.reverse(pieces, tp_base, tp_reduced), me, None, src=lambda i: shadow[i], dst=lambda i: back[i]
    )
    back_once, mine_once = [t.clone() for t in back], [t.clone() for t in mine]
    # built once, run every step (NTP's unfold): new values in place, then a reallocated source
    scratch = reshard.Scratch()
    unfold = reshard.Exchange(
        reshard.reverse(pieces, tp_base, tp_reduced), me, None, src=lambda i: shadow[i], dst=lambda i: back[i],
        scratch=scratch,
    )  # fmt: skip
    fold = reshard.Exchange(pieces, me, None, src=lambda i: mine[i], dst=lambda i: shadow[i], scratch=scratch)
    runs = []
    for step in range(3):
        for t in back:
            t.fill_(float("nan"))
        if step == 2:
            mine[0] = mine[0] * 1.0  # a new tensor: the fold must rebuild, not read the old storage
        for t in mine:
            t.mul_(-2.0)  # the next step's values
        if me < tp_reduced:
            for t in shadow:
                t.fill_(float("nan"))
        fold.run()
        unfold.run()
        runs.append(([t.cpu().clone() for t in mine], [t.cpu().clone() for t in back]))
    return folded, [t.cpu() for t in back_once], [t.cpu() for t in mine_once], want, runs


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(2))])
def test_fold_and_unfold_move_exact_shards(backend):
    out = run_on_ranks(_exchange_body, 2, args=(2, 1), backend=backend, timeout=180)
    folded, _, _, want, _ = out[0]
    assert out[1][0] is None
    for i in range(len(SPECS)):
        assert torch.equal(folded[i], want[0][str(i)]), i
    assert torch.equal(folded[-1], _partial(0) + _partial(1))  # the core rank holds the TP sum
    for _, back, mine, _, _ in out:
        for b, m in zip(back[:-1], mine):
            assert torch.equal(b, m)
        assert torch.equal(back[-1], _partial(0) + _partial(1))  # unfolds what the core holds
    for step in range(3):  # the cached exchanges: every step's values, also after a source was reallocated
        mine_all = [out[r][4][step][0] for r in range(2)]
        for r in range(2):
            back = out[r][4][step][1]
            for i in range(len(SPECS)):
                assert torch.equal(back[i], mine_all[r][i]), (step, r, i)
            assert torch.equal(back[-1], mine_all[0][-1] + mine_all[1][-1]), step


def test_ddp_without_ntp_groups_says_what_to_call():
    from megatron_ext.nonuniform_tp import NonuniformTPConfig, NonuniformTPDistributedDataParallel

    cfg = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)})
    with pytest.raises(RuntimeError, match=r"call initialize_nonuniform_tp_process_groups\(ntp_config\)"):
        NonuniformTPDistributedDataParallel(None, None, torch.nn.Linear(2, 2), ntp_config=cfg)
