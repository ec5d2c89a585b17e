"""The transfers between a degraded replica and its healthy partner move exact tensors
(row- and column-sharded, gated fc1, replicated; a replicated gradient that is a partial
sum per TP rank reaches the partner's TP sum once), on gloo and on NCCL: gradients are
added into the partner's (scaled by the satellite's weight), parameters copied back."""

import pytest
import torch
import torch.distributed as dist

from megatron_ext.nonuniform_tp import reshard
from megatron_ext.nonuniform_tp.checkpoint import split_tp_full
from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks

SPECS = [reshard.ShardSpec(0), reshard.ShardSpec(1), reshard.ShardSpec(0, 2), reshard.ShardSpec(None)]


def _full(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "0": torch.randn(24, 4, generator=g),
        "1": torch.randn(4, 24, generator=g),
        "2": torch.randn(48, 4, generator=g),
        "3": torch.randn(4, generator=g),
    }


UNIT_ELEMS = 10  # smaller than every sharded tensor: pack_units cuts them into slices of 2 rows/columns


def _pair_body(tp_base, tp_reduced, scale):
    """The exchanges once in one unit each way, once cut into units of UNIT_ELEMS (one Exchange per
    unit, run in order); per mode what _pair_run returns, and the largest unit."""
    out = {}
    for max_elems in (None, UNIT_ELEMS):
        out[max_elems] = _pair_run(tp_base, tp_reduced, scale, max_elems)
    return out


def _pair_run(tp_base, tp_reduced, scale, max_elems):
    """Group ranks 0..tp_base-1: the partner's TP ranks; the next tp_reduced: the satellite's.
    Returns (gradients after the transfer, parameters after the transfer) of this rank, per step,
    and the element count of the largest unit."""
    me, dev = dist.get_rank(), tiny_gpt.rank_device()
    specs = {str(i): s for i, s in enumerate(SPECS)}
    partner = me < tp_base
    base_ranks, reduced_ranks = list(range(tp_base)), list(range(tp_base, tp_base + tp_reduced))
    k = me if partner else me - tp_base
    degree = tp_base if partner else tp_reduced
    pieces_g, pieces_p = [], []
    base0 = split_tp_full(_full(0), specs, tp_base)[0]
    for i, s in enumerate(SPECS + [reshard.ShardSpec(None)]):
        size = base0[str(i)].shape[s.dim] if s.dim is not None else 0
        summed = i == len(SPECS)  # a partial sum per TP rank (a q/k layer norm's gradient)
        pieces_g += reshard.pair_pieces(i, s, size, base_ranks, reduced_ranks, gradient=True, summed=summed)
        pieces_p += reshard.pair_pieces(i, s, size, base_ranks, reduced_ranks, gradient=False)
    scratch = reshard.Scratch()
    grads = [t.to(dev) for t in split_tp_full(_full(1 + (not partner)), specs, degree)[k].values()]
    grads.append((torch.arange(6.0) * 10 ** (me + 1) + me).to(dev))
    params = [t.to(dev) for t in split_tp_full(_full(3) if partner else _full(4), specs, degree)[k].values()]
    params.append(torch.full((6,), float(me), device=dev))
    largest = 0
    if max_elems is None:
        units_g, units_p = [pieces_g], [pieces_p]
    else:
        shapes = [tuple(t.shape) for t in params]
        units_g = reshard.pack_units(pieces_g, shapes, max_elems)
        units_p = reshard.pack_units(pieces_p, shapes, max_elems)
        largest = max(sum(_numel(q, shapes) for q in u) for u in units_g + units_p)
    grad_x = [reshard.Exchange(u, me, None, lambda i: grads[i], lambda i: grads[i], scratch) for u in units_g]
    param_x = [reshard.Exchange(u, me, None, lambda i: params[i], lambda i: params[i], scratch) for u in units_p]
    out = []
    for step in range(2):
        if step == 1:
            grads[0] = grads[0] * 1.0  # a reallocated tensor: the exchange must rebuild, not use the old storage
            for t in params:
                t.mul_(-2.0)
        before = [t.cpu().clone() for t in grads]
        for x in grad_x:
            x.run(scale=scale)
        for x in param_x:
            x.run()
        out.append((before, [t.cpu().clone() for t in grads], [t.cpu().clone() for t in params]))
    return out, largest, len(units_g), scratch.nbytes


def _numel(piece, shapes):
    shape = list(shapes[piece.index])
    if piece.dim is not None:
        shape[piece.dim] = piece.length
    return torch.Size(shape).numel()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(3))])
def test_gradients_add_into_the_partner_and_parameters_come_back(backend):
    b, r, scale = 2, 1, 0.5
    runs = run_on_ranks(_pair_body, b + r, args=(b, r, scale), backend=backend, timeout=180)
    for max_elems in (None, UNIT_ELEMS):
        out = [run[max_elems][0] for run in runs]
        _check_pair(out, b, r, scale)
    _, largest, n_units, staging = runs[b][UNIT_ELEMS]  # the satellite: it sends every gradient piece
    # cut into units of at most UNIT_ELEMS elements (no tensor slice here is larger), and many of them;
    # a rank's flat buffers hold at most one unit
    assert 0 < largest <= UNIT_ELEMS and n_units > len(SPECS) + 1
    assert staging <= UNIT_ELEMS * 4
    assert runs[b][None][3] > UNIT_ELEMS * 4  # in one unit the staging is every piece the satellite sends


def _check_pair(out, b, r, scale):
    specs = {str(i): s for i, s in enumerate(SPECS)}
    for step in range(2):
        sat_before = out[b][step][0]  # the satellite's gradients (TP=1: the whole tensors)
        sat_full = {str(i): sat_before[i] for i in range(len(SPECS))}
        want = split_tp_full(sat_full, specs, b)
        for j in range(b):
            before, after, params = out[j][step]
            for i in range(len(SPECS)):
                assert torch.allclose(after[i], before[i] + scale * want[j][str(i)], rtol=0, atol=1e-6), (step, j, i)
            # the partial sum: satellite rank i's part reaches partner rank i only (i < r)
            extra = scale * sat_before[-1] if j < r else 0
            assert torch.allclose(after[-1], before[-1] + extra, rtol=0, atol=1e-6), (step, j)
        # the satellite's own gradients are left as they were
        assert all(torch.equal(a, c) for a, c in zip(out[b][step][1], sat_before))
        # parameters: the satellite holds exactly the partner's, at its degree
        partner_full = {
            str(i): torch.cat([out[j][step][2][i] for j in range(b)], specs[str(i)].dim)
            if specs[str(i)].dim is not None and specs[str(i)].chunks == 1
            else None
            for i in range(len(SPECS))
        }
        for i in range(len(SPECS)):
            spec = specs[str(i)]
            if spec.dim is None:
                assert torch.equal(out[b][step][2][i], out[0][step][2][i]), (step, i)
            elif spec.chunks == 1:
                assert torch.equal(out[b][step][2][i], partner_full[str(i)]), (step, i)
            else:  # gated fc1: [gate; up] per rank
                gates = [out[j][step][2][i].chunk(2, 0) for j in range(b)]
                whole = torch.cat([torch.cat([g[0] for g in gates]), torch.cat([g[1] for g in gates])])
                assert torch.equal(out[b][step][2][i], whole), (step, i)
        assert torch.equal(out[b][step][2][-1], out[0][step][2][-1])


def test_ddp_without_ntp_groups_says_what_to_call():
    from megatron_ext.nonuniform_tp import NonuniformTPConfig, NonuniformTPDistributedDataParallel

    cfg = NonuniformTPConfig(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)})
    with pytest.raises(RuntimeError, match=r"call initialize_nonuniform_tp_process_groups\(ntp_config\)"):
        NonuniformTPDistributedDataParallel(None, None, torch.nn.Linear(2, 2), ntp_config=cfg)
