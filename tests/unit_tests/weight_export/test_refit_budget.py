"""The reshard refit's memory budget on one process (no job spawned: each rank's executor is built and
allocates its staging, nothing moves): every rank's device staging, as allocated, is what the planner
counted and at most the budget, for ranks with 2, 3 and 7 peers, streaming and atomic staged on the host;
an atomic receiver that keeps the version on the device and does not fit is refused by name (under the
auto budget it keeps it on top); a budget
below one row per slot is refused naming the tensor and the least budget, which is accepted. The bytes
that move under a budget are checked exactly in the spawned job of ``test_reshard_refit``."""

import re

import pytest
import torch

from megatron_ext.copies import finite_groups
from megatron_ext.weight_export.control.peers import Peers
from megatron_ext.weight_export import ReshardExecutor, build_reshard_plan, gpt_specs, inference_layout, megatron_layout
from megatron_ext.weight_export.exec import staging
from megatron_ext.weight_export.plan.budget import SMALL_PAIR_BYTES, SMALL_SHARE, plan_staging, whole_nbytes
from megatron_ext.weight_export.plan.direct import DirectRound

from ._reference import SPECS

MIB = 1 << 20
BUDGET = 32 << 10  # 32 KiB: under the unbudgeted staging of every layout below
BUCKET = 16 << 10

# name: (trainer kwargs, engine kwargs); peers of the busiest rank in brackets
LAYOUTS = {
    "tp1_to_dp2 [2]": (dict(tp=1, ranks=[0]), dict(tp=1, dp=2, ranks=[1, 2])),
    "tp2_to_dp3 [3]": (dict(tp=2, ranks=[0, 1]), dict(tp=1, dp=3, ranks=[2, 3, 4])),
    "tp1_to_dp7 [7]": (dict(tp=1, ranks=[0]), dict(tp=1, dp=7, ranks=list(range(1, 8)))),
}


def _plan(name):
    specs = gpt_specs(**SPECS)
    mk, ek = LAYOUTS[name]
    return build_reshard_plan(megatron_layout(specs, **mk), inference_layout(specs, **ek))


def _tensors(plan, rank):
    out = {n: torch.randn(lt.shape) for n, lt in plan.src.tensors.get(rank, {}).items()}
    out.update({n: torch.zeros(lt.shape) for n, lt in plan.dst.tensors.get(rank, {}).items()})
    return out


class Gathered(Peers):
    """A stand-in group that hands every rank's words back, in rank order (what the agreement gathers)."""

    def __init__(self, words):
        self.words = words

    def ranks(self, n):
        return list(range(n))

    def gather_words(self, words, device=None, *, what):
        return self.words


def _executor(plan, rank, **kw):
    return ReshardExecutor(plan, rank, _tensors(plan, rank), **{"bucket_bytes": BUCKET, **kw})


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", [dict(atomic=False), dict(atomic=True, atomic_staging="host")])
@pytest.mark.parametrize("phased", [True, False], ids=["phases", "one-phase"])
def test_every_rank_stages_what_the_planner_counted_within_the_budget(name, mode, phased):
    plan = _plan(name)
    ranks = sorted({*plan.src.ranks, *plan.dst.ranks})
    peers = {r: len({t.dst for t in plan.transfers if t.src == r} - {r}) for r in ranks}
    assert max(peers.values()) == int(name[-2]), peers
    busiest = max(ranks, key=lambda r: peers[r])
    unbudgeted = _executor(plan, busiest, **mode)
    unbudgeted._allocate()
    assert unbudgeted.staging_bytes > BUDGET, "the budget must bind for the test to mean anything"
    # phases: the budget's buckets are far below MIN_OP_BYTES, so the pairs go in phases, each pair of the busiest
    # rank gets a larger bucket than in one phase, and the staging is still within the budget
    one = dict(min_op_bytes=None)
    for r in ranks:
        ex = _executor(plan, r, memory_budget_bytes=BUDGET, **mode, **({} if phased else one))
        assert ex.budget_problem is None
        assert (ex.phases > 1) == phased, (r, ex.phases)
        if phased and r == busiest:
            single = _executor(plan, r, memory_budget_bytes=BUDGET, **mode, **one).staging_plan.pair_bytes
            assert all(b > single[p] for p, b in ex.staging_plan.pair_bytes.items()), (
                ex.staging_plan.pair_bytes,
                single,
            )
        ex._allocate()
        planned = ex.staging_plan
        assert ex.staging_bytes == planned.device_bytes.get(r, 0) <= BUDGET, r
        assert ex.staging_host_bytes == planned.host_bytes.get(r, 0), r
        if mode["atomic"] and ex.recv:  # the host holds every bucket this rank receives, in pinned slabs whose
            # sizes are powers of two (PyTorch's pinned allocator rounds each allocation up to one)
            held = ex.staging.held
            assert sum(h.numel() for h in held.values()) == ex.received_bytes > 0
            slabs = [s.numel() for s in ex.staging._slabs]
            assert all(n & (n - 1) == 0 for n in slabs) and ex.staging_host_bytes == sum(slabs), slabs
            assert all(h.storage_offset() % 256 == 0 for h in held.values())  # aligned: headers read as int64
        # the planner counted what the allocator holds: one buffer per slot, each its largest bucket
        assert ex.staging_bytes == sum(b.numel() for b in ex.staging.bufs.values())
        # a pair's bucket is the same on both sides (each side cut it from the plan alone)
        for p in ex.send:
            theirs = plan_staging(
                plan.transfers,
                bucket_bytes=BUCKET,
                max_inflight=2,
                atomic=False,
                budget_bytes=BUDGET,
                phases=ex.phases,
            )
            assert ex.staging_plan.pair_bytes[(r, p)] == theirs.pair_bytes[(r, p)]


def test_an_atomic_receiver_on_the_device_that_does_not_fit_is_refused_by_name():
    plan = _plan("tp1_to_dp2 [2]")
    ex = _executor(plan, 1, memory_budget_bytes=BUDGET, atomic=True)  # an engine rank: its whole share
    assert ex.budget_problem is not None and ex.budget_problem.reason == "staging"
    msg = str(ex.budget_problem)
    assert "--refit-memory-budget-mb 0.03125 MiB cannot hold rank 1's staging" in msg, msg
    assert "--refit-atomic-staging host" in msg and "--no-refit-atomic" in msg, msg
    # the trainer rank sends only: its slots fit the same budget
    assert _executor(plan, 0, memory_budget_bytes=BUDGET, atomic=True).budget_problem is None
    # host staging fits
    assert _executor(plan, 1, memory_budget_bytes=BUDGET, atomic=True, atomic_staging="host").budget_problem is None
    # the auto budget (not strict) cuts the same buckets but keeps the atomic version on the device on top
    auto = _executor(plan, 1, memory_budget_bytes=BUDGET, memory_budget_strict=False, atomic=True)
    streaming = _executor(plan, 1, memory_budget_bytes=BUDGET, atomic=False)
    assert auto.budget_problem is None and auto.staging_plan.pair_bytes == streaming.staging_plan.pair_bytes
    assert auto.staging_plan.device_bytes[1] > BUDGET >= streaming.staging_plan.device_bytes[1]
    assert "(auto: an atomic receiver's version on the device comes on top)" in auto.staging_plan.line(1)
    assert auto.wire_id == streaming.wire_id  # both jobs agree whatever each one's atomic mode


def test_a_budget_below_one_row_per_slot_is_refused_naming_the_tensor_and_the_least_budget():
    plan = _plan("tp1_to_dp7 [7]")
    ex = _executor(plan, 0, memory_budget_bytes=4096, atomic=False, min_op_bytes=None)
    msg = str(ex.budget_problem)
    # the widest row: down_proj's (ffn 48 floats = 192 bytes, 256 aligned); rank 0 stages 2 buckets x 7 peers
    assert "cannot stage model.layers.0.mlp.down_proj.weight: a bucket of rank 0 -> 1 must hold one row" in msg, msg
    least = int(re.search(r"at least (\d+) bytes", msg).group(1))
    assert least == (256 + 256) * 2 * 7, msg  # header + one aligned row, per slot
    # the least budget works, one byte less does not (every rank computes the same from the plan)
    one = dict(atomic=False, min_op_bytes=None)
    assert _executor(plan, 0, memory_budget_bytes=least, **one).budget_problem is None
    assert _executor(plan, 3, memory_budget_bytes=least - 1, **one).budget_problem is not None
    # in phases (the default) the trainer rank's seven peers fall in seven phases, one slot each way per round,
    # and the budget keeps room for round 0's seven header-only buckets: 4096 bytes fit
    assert _executor(plan, 0, memory_budget_bytes=4096, atomic=False).budget_problem is None
    phased = (256 + 256) * 2 * 1 + 7 * 40
    short = _executor(plan, 0, memory_budget_bytes=phased - 1, atomic=False)
    assert short.phases == 8, short.phases
    assert f"at least {phased} bytes" in str(short.budget_problem), short.budget_problem
    assert "peers it sends to and receives from in one of 8 phases" in str(short.budget_problem)
    # a budget that leaves no slot in any number of phases: the refusal names the least of the phases with the
    # fewest slots (8: one per round each way), which then fits, at 3 in flight
    tiny = _executor(plan, 0, memory_budget_bytes=1024, atomic=False, max_inflight=3)
    least3 = (256 + 256) * 3 * 1 + 7 * 40
    assert tiny.phases == 8 and f"at least {least3} bytes" in str(tiny.budget_problem), tiny.budget_problem
    fits = [_executor(plan, r, memory_budget_bytes=least3, atomic=False, max_inflight=3) for r in range(8)]
    assert all(e.budget_problem is None for e in fits), [str(e.budget_problem) for e in fits]
    ok = {r: _executor(plan, r, memory_budget_bytes=phased, atomic=False) for r in range(8)}
    assert all(e.budget_problem is None and e.phases == 8 for e in ok.values())
    assert ok[0].staging_plan.pair_bytes[(0, 1)] == 512 and ok[0].staging_plan.device_bytes[0] <= phased
    # and the refit refuses it on every rank before anything is allocated or sent
    with pytest.raises(Exception) as err:
        ex.refit(1)
    assert getattr(err.value, "reason", None) == "staging" and ex.staging is None, err.value


def test_a_ranks_own_plan_refuses_with_its_peers_gathered_slots():
    """Ranks that plan only their own transfers learn their peers' slot sizes and counts at the agreement (here a
    stand-in group hands every rank's words back): engine rank 3 of TP1 -> 7 replicas has one peer, the trainer
    rank seven, so the pair 0 -> 3 gets rank 0's smaller slot, and a budget one byte short of rank 0's need is
    refused on rank 3 too, with rank 0's seven slots in the least budget (counted from rank 3's own pairs, it
    would be 7x too small)."""
    specs = gpt_specs(**SPECS)
    mk, ek = LAYOUTS["tp1_to_dp7 [7]"]
    src, dst = megatron_layout(specs, **mk), inference_layout(specs, **ek)
    least = (256 + 256) * 2 * 7  # as in the test above

    def executors(budget, peers=None):
        out = {}
        for r in range(8):
            plan = build_reshard_plan(src, dst, rank=r)
            out[r] = ReshardExecutor(
                plan,
                r,
                _tensors(plan, r),
                bucket_bytes=BUCKET,
                group=peers,
                memory_budget_bytes=budget,
                atomic=False,
                min_op_bytes=None,  # one phase: rank 0's seven peers in every round
            )
        return out

    for budget in (least, least - 1):
        words = {r: list(ex._shares[r]) for r, ex in executors(budget).items()}
        for r, ex in executors(budget, Gathered([words[r] for r in range(8)])).items():
            assert ex.staging_plan is None  # a rank's plan is cut once its peers' slots are known
            ex._settle("test")
            assert ex._pairs_agree, r
            if budget == least:
                assert ex.budget_problem is None, (r, ex.budget_problem)
                assert set(ex.staging_plan.pair_bytes.values()) == {(least // 2 // 7) // 256 * 256}, r
            else:
                msg = str(ex.budget_problem)
                assert f"at least {least} bytes" in msg, (r, msg)
                if r == 3:
                    assert "a bucket of rank 0 -> 3 must hold one row" in msg, msg


# MiBs per TP rank: the pairs of TP ranks whose shards overlap are far above SMALL_PAIR_BYTES, the norms the holder
# rule takes from another rank far below it
WIDE = dict(SPECS, hidden_size=256, num_heads=8, head_dim=32, ffn_hidden_size=512, vocab_size=4096)
WIDE["padded_vocab_size"] = 4096


def test_a_small_pair_goes_in_one_bucket_and_leaves_the_budget_to_the_others():
    """Colocated TP2xPP2 -> TP4: each engine rank takes its shards (MiBs) from the trainer ranks of both stages, and
    a few norms (KiBs) that every rank of a stage holds from a rank that sends it nothing else (rank 0 -> 2 and 3 ->
    1: TP4 rank 2's shards are TP2 rank 1's). In one phase such a pair goes in one bucket of its own size, taken off
    the budget, so the large pairs' buckets are the rest over their buffers instead of the budget over every pair's;
    every rank allocates what the planner counted, within the budget, both ends cut each pair alike and agree on
    the wire id, whether a rank plans the whole job or its own pairs. A rank whose small pairs take more than
    SMALL_SHARE of its budget turns it off for the whole job (each pair is cut alike on both ends)."""
    specs = gpt_specs(**WIDE)
    src = megatron_layout(specs, tp=2, pp=2, ranks=[0, 1, 2, 3])
    dst = inference_layout(specs, tp=4, ranks=[0, 1, 2, 3])
    plan = build_reshard_plan(src, dst)
    pairs = {}
    for t in plan.transfers:
        if t.src != t.dst:
            pairs.setdefault((t.src, t.dst), []).append(t)
    whole = {p: whole_nbytes(ts) for p, ts in pairs.items()}
    small = {p for p, n in whole.items() if n <= SMALL_PAIR_BYTES}
    large = set(pairs) - small
    assert small == {(0, 2), (3, 1)} and min(whole[p] for p in large) > SMALL_PAIR_BYTES // 2, whole
    for p, ts in pairs.items():  # with a limit: the same count up to it, a count over it past it
        for limit in (SMALL_PAIR_BYTES, whole[p], whole[p] - 1):
            got = whole_nbytes(ts, limit)
            assert got == whole[p] if whole[p] <= limit else limit < got <= whole[p], (p, limit, got)
    budget, inflight = 2 * MIB, 2
    # each rank: its small pair's bytes off the budget, the rest over its large pairs' buffers; a pair's bucket the
    # smaller of its two ranks' slots
    off = {r: sum(whole[p] for p in small if r in p) for r in range(4)}
    rest = min((budget - off[r]) // (inflight * sum(1 for p in large if r in p)) // 256 * 256 for r in range(4))
    old = plan_staging(plan.transfers, bucket_bytes=budget, max_inflight=inflight, atomic=False, budget_bytes=budget)
    most = max(sum(1 for p in pairs if r in p) for r in range(4))  # rank 1: 2 pairs out, 3 in
    assert old.pair_bytes[(0, 2)] == budget // (inflight * most) // 256 * 256 and not old.small  # counted as a slot
    assert rest > old.pair_bytes[(0, 1)]
    kw = dict(bucket_bytes=budget, max_inflight=inflight, memory_budget_bytes=budget, atomic=False, min_op_bytes=None)
    words = {}
    for r in range(4):
        ex = _executor(plan, r, **kw)
        got = ex.staging_plan
        assert ex.budget_problem is None and ex.phases == 1 and got.small == small, (r, got.small)
        assert got.pair_bytes == {p: whole[p] if p in small else rest for p in pairs}, (r, got.pair_bytes)
        assert all(len(got.buckets[p]) == 1 for p in small if r in p)  # one round, whole
        assert "1 small pair in one bucket each" in got.line(r), got.line(r)
        ex._allocate()
        assert ex.staging_bytes == got.device_bytes[r] <= budget, r
        assert ex.staging_bytes == sum(b.numel() for b in ex.staging.bufs.values())
        assert len(ex.staging._device_slabs) == 1  # one allocation, each buffer at an aligned offset
        assert all(b.storage_offset() % 256 == 0 for b in ex.staging.bufs.values())
        words[r] = ex.wire_id
    # each rank with its own plan: the same buckets and wire id once the words are gathered
    own = {r: build_reshard_plan(src, dst, rank=r) for r in range(4)}
    gathered = [list(ReshardExecutor(own[r], r, _tensors(plan, r), **kw)._shares[r]) for r in range(4)]
    for r in range(4):
        ex = ReshardExecutor(own[r], r, _tensors(plan, r), group=Gathered(gathered), **kw)
        ex._settle("test")
        mine = next(p for p in small if r in p)
        assert ex._pairs_agree and ex.staging_plan.small == {mine}, r
        assert ex.wire_id == words[r] and ex.staging_plan.pair_bytes[mine] == whole[mine]
    assert len(set(words.values())) == 1
    # a budget whose share for small pairs cannot hold rank 3's: one phase as before on every rank (rank 0's own
    # small pair would fit, but a pair is cut alike on both ends only if the job decides as one)
    tight = int(whole[(3, 1)] / SMALL_SHARE) - 256
    for r in range(4):
        got = _executor(plan, r, **dict(kw, memory_budget_bytes=tight))
        assert not got.staging_plan.small and got.staging_plan.pair_bytes[(3, 1)] == tight // 10 // 256 * 256, r


def test_the_plan_line_says_what_was_chosen():
    plan = _plan("tp2_to_dp3 [3]")
    ex = _executor(plan, 0, memory_budget_bytes=BUDGET, atomic=False)
    line = ex.staging_plan.line(0)
    assert line.startswith(f"staging {ex.staging_plan.device_bytes[0] / MIB:.1f} MiB on the device"), line
    assert f"budget 0.0 MiB; the pairs in {ex.phases} phases; bucket MiB per pair:" in line, line
    assert ex.phases > 1
    one = _executor(plan, 0, memory_budget_bytes=BUDGET, atomic=False, min_op_bytes=None).staging_plan.line(0)
    assert "budget 0.0 MiB; bucket MiB per pair:" in one, one


ZERO_COPY = 512  # bytes: the tiny model's runs of at least this many go zero-copy


def _put(dst, src):
    """Copy one box between its two runs' views (``(1, n)`` on one side, ``(rows, length)`` on the other)."""
    dst.copy_(src.reshape(dst.shape))


@pytest.mark.parametrize("case", ["tp2_to_tp2", "tp2_to_tp1dp2"])
@pytest.mark.parametrize("max_bytes", [BUCKET, 1024])
def test_zero_copy_ops_carry_exactly_the_bytes_of_their_transfers(case, max_bytes):
    """Every pair's transfers split into staged ones and zero-copy ops that together move every byte once:
    applied to random source tensors, the ops' byte ranges give the destination what the transfers give;
    an op is one run on both sides, at least ZERO_COPY bytes unless cut, at most ``max_bytes``; a strided
    transfer is never zero-copy; rounds stay within ``max_bytes`` staged."""
    from megatron_ext.weight_export.plan.direct import direct_rounds, split_direct
    from megatron_ext.weight_export.plan.reshard_plan import run_view

    specs = gpt_specs(**SPECS)
    engine = dict(tp=2, ranks=[2, 3]) if case == "tp2_to_tp2" else dict(tp=1, dp=2, ranks=[2, 3])
    plan = build_reshard_plan(megatron_layout(specs, tp=2, ranks=[0, 1]), inference_layout(specs, **engine))
    g = torch.Generator().manual_seed(0)
    src = {(r, n): torch.randn(lt.shape, generator=g) for r, ts in plan.src.tensors.items() for n, lt in ts.items()}
    want = {(r, n): torch.zeros(lt.shape) for r, ts in plan.dst.tensors.items() for n, lt in ts.items()}
    got = {k: v.clone() for k, v in want.items()}
    pairs = {}
    for t in plan.transfers:
        pairs.setdefault((t.src, t.dst), []).append(t)
        _put(run_view(want[t.dst, t.dst_run.local], t.dst_run), run_view(src[t.src, t.src_run.local], t.src_run))
    direct_total = 0
    for (s, d), ts in pairs.items():
        staged, ops = split_direct(ts, min_bytes=ZERO_COPY, max_bytes=max_bytes)
        assert sum(t.nbytes for t in staged) + sum(op.nbytes for op in ops) == sum(t.nbytes for t in ts)
        assert all(t.src_run.count == 1 and t.dst_run.count == 1 for op in ops for t in op.transfers)
        assert all(t in ts for t in staged) and not set(staged) & {t for op in ops for t in op.transfers}
        for t in staged:
            _put(run_view(got[d, t.dst_run.local], t.dst_run), run_view(src[s, t.src_run.local], t.src_run))
        for op in ops:
            assert 0 < op.nbytes <= max_bytes
            a = src[s, op.src_local].view(-1).view(torch.uint8)[op.src_offset : op.src_offset + op.nbytes]
            got[d, op.dst_local].view(-1).view(torch.uint8)[op.dst_offset : op.dst_offset + op.nbytes].copy_(a)
        for r in direct_rounds(ops, max_bytes):
            assert r.staged_nbytes <= max_bytes and r.nbytes <= r.staged_nbytes
        direct_total += sum(op.nbytes for op in ops)
    assert direct_total > 0, "the test needs zero-copy ops"
    if case == "tp2_to_tp1dp2":  # down_proj / o_proj are split by columns in the trainer: strided, staged
        assert any(
            t.dst_run.count > 1
            for ts in pairs.values()
            for t in split_direct(ts, min_bytes=ZERO_COPY, max_bytes=max_bytes)[0]
        )
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", [dict(atomic=False), dict(atomic=True, atomic_staging="host")])
def test_zero_copy_stages_only_what_an_atomic_receiver_must_keep(name, mode, monkeypatch):
    """With zero-copy runs, every rank allocates what the planner counted (within the budget); without a
    budget, senders and streaming receivers stage less than with every byte staged (none of the zero-copy
    bytes), an atomic receiver stages them (on the host: it holds every round); the plan line says how
    much went zero-copy."""
    monkeypatch.setattr(staging, "CHECK_CHUNK_BYTES", BUCKET)  # the sender's check in several chunks
    plan = _plan(name)
    for r in sorted({*plan.src.ranks, *plan.dst.ranks}):
        budgeted = _executor(plan, r, memory_budget_bytes=BUDGET, zero_copy_bytes=ZERO_COPY, **mode)
        assert budgeted.budget_problem is None
        budgeted._allocate()
        planned = budgeted.staging_plan
        held = sum(b.numel() for b in budgeted.staging.bufs.values())
        assert budgeted.staging_bytes == planned.device_bytes.get(r, 0) == held <= BUDGET
        assert budgeted.staging_host_bytes == planned.host_bytes.get(r, 0)
        assert planned.direct_bytes[r] > 0 and f"{planned.direct_bytes[r] / MIB:.1f} MiB zero-copy" in planned.line(r)
        staged = _executor(plan, r, zero_copy_bytes=None, **mode)
        ex = _executor(plan, r, zero_copy_bytes=ZERO_COPY, **mode)
        assert ex.wire_id != staged.wire_id  # both sides must cut alike: part of the first refit's plan check
        ex._allocate()
        staged._allocate()
        assert ex.sent_bytes + ex.received_bytes < staged.sent_bytes + staged.received_bytes  # less padding
        if ex.send:  # each zero-copy source is checked in a round before its pair's last header is packed
            st = ex.staging
            last = [len(bs) - 1 for bs in ex.send.values() if any(isinstance(b, DirectRound) for b in bs)]
            assert st.trailer_rounds == set(last) and len(st.trailer_rows) == len(last)
            checked = [i for a, b in sorted(st.direct_slices.values()) for i in range(a, b)]
            assert checked == list(range(len(st.direct_sources))) == list(range(len(st.direct_checked)))
            assert len(st.direct_slices) > 1, "the test needs several chunks"
            for k, (a, b) in st.direct_slices.items():
                assert all(k < last[p] for p in st.direct_pairs[a:b].tolist()), (r, k)
                # grouped by dtype (finite_groups): every source checked, one range per dtype, together the chunk
                assert [i for idx in finite_groups(st.direct_sources[a:b]) for i in idx] == list(range(b - a))
        if ex.recv and mode["atomic"]:  # the host holds every round it receives, zero-copy ones too
            assert ex.staging_host_bytes >= ex.received_bytes > 0
        else:
            assert ex.staging_bytes < staged.staging_bytes, r


@pytest.mark.parametrize(
    "sizes, most",
    [
        ([(42 << 20) + 4096] * 130, 1.05),  # the auto budget's buckets (4xH200 colocated TP4 -> TP1xDP4): 1.5x alone
        ([128 << 20] * 58, 1.0),  # powers of two: a slab per buffer is exact
        ([1000, 5000, 300], 2.0),
    ],
)
def test_host_slabs_pin_powers_of_two_holding_every_buffer(sizes, most):
    """An atomic receiver staged on the host pins its rounds in slabs whose sizes are powers of two (PyTorch's
    pinned allocator rounds each allocation up to one), each buffer inside one slab at an aligned offset, no two
    overlapping, in at most ``most`` times their bytes."""
    from megatron_ext.weight_export.plan.budget import host_slabs

    slabs, where = host_slabs(sizes)
    assert all(n & (n - 1) == 0 for n in slabs), slabs
    spans = sorted((s, off, off + n) for (s, off), n in zip(where, sizes))
    assert all(off % 256 == 0 and end <= slabs[s] for s, off, end in spans), spans
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:])), "buffers overlap"
    assert sum(slabs) <= most * sum(sizes), (sum(slabs) / sum(sizes), slabs)
    assert sum(slabs) <= sum(1 << (n - 1).bit_length() for n in sizes)  # never more than a buffer each


@pytest.mark.parametrize(
    "sizes, most, count",
    [
        ([42 << 20] * 12, 1 << 30, 1),  # a colocated rank's streaming buffers within the auto budget: one allocation
        ([120 << 20] * 45, 1 << 30, 6),  # an atomic receiver's rounds on the device: 8 per GiB
        ([3 << 30, 256, 512, 40, 40], 1 << 30, 2),  # a buffer above the cap alone, then the rest (headers: 40)
    ],
)
def test_device_slabs_hold_every_buffer_in_a_few_allocations(sizes, most, count):
    """Staging buffers are carved from a few device allocations (each costs the first refit about a millisecond of
    host time): consecutive buffers, no two overlapping, each allocation at most ``most`` bytes unless one buffer
    is larger, and nothing between them (the planner counts what is allocated)."""
    from megatron_ext.weight_export.plan.budget import device_slabs

    slabs, where = device_slabs(sizes, most)
    assert len(slabs) == count and sum(slabs) == sum(sizes), slabs
    spans = [(s, off, off + n) for (s, off), n in zip(where, sizes)]
    assert all(end <= slabs[s] for s, _, end in spans)
    assert all(a[0] != b[0] or a[2] == b[1] for a, b in zip(spans, spans[1:])), "buffers overlap or leave gaps"
    assert all(n <= most or sum(1 for s, *_ in spans if s == i) == 1 for i, n in enumerate(slabs)), slabs


def test_buckets_hold_each_piece_at_an_aligned_offset_and_cut_only_what_does_not_fit():
    """bucketize against the rule it implements: every transfer cut into rows that fit a bucket's payload
    (one that fits is never cut), each piece at the next ALIGN offset, a new bucket where the next piece would
    pass the bucket's end; a transfer exactly as large as the payload, one a byte over it (cut), a 1-D one."""
    from megatron_ext.sharding.geometry import Box
    from megatron_ext.weight_export.plan import wire
    from megatron_ext.weight_export.plan.reshard_plan import Run, Transfer

    bucket = 4096
    cap = bucket - wire.PAYLOAD_OFFSET

    def tr(rows, cols, itemsize=2):
        n = rows * cols
        box = Box(((0, rows), (0, cols))) if cols > 1 else Box(((0, rows),))
        return Transfer("w", box, 0, 1, Run("a", 0, n, n, 1), Run("b", 0, n, n, 1), itemsize)

    ts = [tr(3, 5), tr(cap // 8, 4), tr(cap // 2 + 1, 1, itemsize=2), tr(7, 300), tr(33, 1), tr(2 * cap // 8, 8)]
    assert ts[1].nbytes == cap and ts[2].nbytes == cap + 2
    want, cur, used = [], [], wire.PAYLOAD_OFFSET
    for whole in ts:
        for t in wire._pieces(whole, cap):
            if cur and used + t.nbytes > bucket:
                want.append(cur)
                cur, used = [], wire.PAYLOAD_OFFSET
            cur.append((t, used))
            used = wire.align(used + t.nbytes)
    want.append(cur)
    got = wire.bucketize(ts, bucket)
    assert got == want
    assert sum(1 for b in got for t, _ in b if t is ts[1]) == 1  # as large as the payload: whole
    assert sum(len(b) for b in got) > len(ts)  # the others too large were cut


def test_a_buckets_copies_join_pieces_as_the_reference_rule():
    """A bucket's pieces join into one copy exactly where :func:`staging._coalesced` joins their runs and their
    bytes' runs in the bucket: a strided run never joins, nor pieces of two itemsizes, of two local tensors, with
    a gap in the tensor or in the bucket."""
    from megatron_ext.sharding.geometry import Box
    from megatron_ext.weight_export.plan.reshard_plan import Run, Transfer

    def piece(local, offset, n, itemsize=2, count=1):
        run = Run(local, offset, n // count, 4 * n, count)
        return Transfer("w", Box(((0, n),)), 0, 1, run, Run("d", offset, n, n, 1), itemsize)

    a, b, c = piece("x", 0, 64), piece("x", 64, 32), piece("x", 96, 32)  # one range of x, bytes back to back
    gap_tensor, other = piece("x", 200, 32), piece("y", 232, 32)
    # (after: where the strided run's first row ends, as a run that continued it would start)
    wide, strided, after = piece("x", 232, 16, itemsize=4), piece("x", 300, 64, count=4), piece("x", 316, 32)
    bucket, at = [], 0
    for t, skip in ((a, 0), (b, 0), (c, 0), (gap_tensor, 0), (other, 0), (wide, 0), (strided, 0), (after, 0)):
        bucket.append((t, at))
        at += t.nbytes + skip
    bucket.append((piece("x", 348, 32), at + 512))  # continues the tensor, not the bucket
    for src in (True, False):
        ref = staging._coalesced(
            [
                (t, t.src_run if src else t.dst_run, Run("", off // t.itemsize, t.nbytes // t.itemsize, 0, 1))
                for t, off in bucket
            ]
        )
        got = staging._in_bucket(bucket, src)
        assert [(ts, run, off) for ts, run, off in got] == [
            (ts, run, there.offset * ts[0].itemsize) for ts, run, there in ref
        ]
    assert [len(ts) for ts, _, _ in staging._in_bucket(bucket, True)] == [3, 1, 1, 1, 1, 1, 1]


def test_pieces_that_are_one_range_are_one_copy():
    """TP1 -> TP1 of the 3.6B preset (meta tensors; the refit_vs_swap benchmark's layouts): each fused QKV's 24
    pieces (q, k and v of 8 query groups) and each [gate; up]'s two are one range of the trainer's tensor, of the
    bucket and of the engine's tensor, so the sender packs and the receiver unpacks one copy per parameter (171, as
    swap_model_weights moves them; the embedding and the output layer, larger than a 512 MiB bucket, in two each:
    173) of the plan's 843 transfers; every transfer in exactly one copy, in order."""
    from benchmarks.common import megatron_config, spec_for
    from benchmarks.refit_vs_swap import ENGINE_PREFIX, _prefixed
    from megatron_ext.sharding import specs_from_config
    from megatron_ext.weight_export.megatron_refit import megatron_engine_layout, megatron_engine_specs

    spec = spec_for("3b")
    specs = specs_from_config(
        megatron_config(spec, False),
        vocab_size=spec.hf_vocab_size,
        padded_vocab_size=spec.vocab_size,
        tie_embeddings=spec.tie_embeddings,
        dtype=torch.bfloat16,
    )
    src = megatron_layout(megatron_engine_specs(specs), tp=1, ranks=[0])
    dst = _prefixed(megatron_engine_layout(specs, tp=1, dp=1, ep=1, etp=1, ranks=range(1, 2)), ENGINE_PREFIX)
    plan = build_reshard_plan(src, dst)
    meta = {
        n: torch.empty(lt.shape, dtype=lt.dtype, device="meta")
        for lay in (src, dst)
        for n, lt in lay.tensors[0 if lay is src else 1].items()
    }
    sender = ReshardExecutor(plan, 0, meta, bucket_bytes=512 << 20, atomic=False, check_finite=True)
    receiver = ReshardExecutor(plan, 1, meta, bucket_bytes=512 << 20, atomic=False)
    for ex in (sender, receiver):
        ex._allocate()
        for k in range(ex.rounds):
            ex.staging.prepare(k)  # (what a refit builds as it reaches each chunk of rounds)
    groups = [ts for k in sorted(sender.staging.packed) for ts in sender.staging.packed[k] if ts is not None]
    assert len(plan.transfers) == 843 and len(groups) == 173
    assert [t for ts in groups for t in ts] == [
        t for _, bucket in sorted(sender.send.items()) for b in bucket for t, _ in b
    ]
    unpacked = sum(len(batch) for batch in receiver.staging.unpack.values())
    assert unpacked == 173 + receiver.rounds  # and each bucket's header


def test_rounds_copies_are_built_in_chunks_of_rounds(monkeypatch):
    """The staging builds round 0's copies and the local ones when it allocates its buffers; later rounds' in
    chunks of rounds (1, 2-3, 4-7, ...), one CopyBatch.many each, when the refit reaches the chunk (prepare, before
    it posts a round): one round at a time, a first refit was bound by the host; all at once, the staging (before
    the agreement, nothing in flight) took longer. A chunk's flags are parts of one buffer. An atomic receiver's
    apply is built by prepare_apply, once."""
    from megatron_ext.copies import CopyBatch

    calls, many = [], CopyBatch.many.__func__

    def counted(cls, batches):
        batches = list(batches)
        calls.append(len(batches))
        return many(cls, batches)

    monkeypatch.setattr(CopyBatch, "many", classmethod(counted))
    plan = _plan("tp1_to_dp2 [2]")
    sender, receiver = _executor(plan, 0, check_finite=True), _executor(plan, 1, atomic=False)
    atomic = _executor(plan, 1)
    for ex in (sender, receiver, atomic):
        ex._allocate()
    assert sender.rounds == receiver.rounds > 4
    assert list(sender.staging.pack) == [0] and list(receiver.staging.unpack) == [0]
    assert receiver.staging.local is not None and calls == [1, 2], calls  # round 0 (and the local copies)
    for k in range(sender.rounds):
        for ex in (sender, receiver):
            ex.staging.prepare(k)
            assert k in (ex.staging.pack if ex is sender else ex.staging.unpack)
    chunks = [len(range(1 << c - 1, min(1 << c, sender.rounds))) for c in range(1, sender.rounds.bit_length() + 1)]
    assert calls[2:] == [n for n in chunks for _ in (0, 1)], (calls, chunks)  # sender and receiver alike
    assert list(sender.staging.pack) == list(range(sender.rounds)) and not sender.staging._chunks
    assert all(b.check and len(b) > 1 for b in sender.staging.pack.values())
    last = [b for k, b in sender.staging.pack.items() if k.bit_length() == sender.rounds.bit_length() - 1]
    assert len(last) > 1 and len({b.bad.untyped_storage().data_ptr() for b in last}) == 1, "one flag buffer a chunk"
    assert "_apply" not in vars(atomic.staging) and atomic.staging.local is None
    atomic.staging.prepare_apply()
    built = atomic.staging._apply
    atomic.staging.prepare_apply()
    assert atomic.staging._apply is built and len(built) > 1
