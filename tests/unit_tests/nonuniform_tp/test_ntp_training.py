"""NTP jobs train exactly like uniform TP: per-step loss of the global batch
equal to a single-rank (TP=1) baseline within 1e-5 over 10 Megatron-optimizer
steps, the same global model at init in every replica, a degraded replica holding
exactly its partner's weights after training, the healthy replicas' checkpoint
being Megatron's own uniform one, a bystander replica issuing exactly a uniform
job's collectives and holding its tensors, and exact per-rank memory reports.
(The single-rank baseline equals uniform TP=2 x DP=2:
tests/unit_tests/testing/test_megatron_training.py.)"""

import dataclasses
import math

import pytest
import torch

from megatron_ext.nonuniform_tp import ntp_to_uniform, uniform_to_ntp
from megatron_ext.testing import tiny_gpt
from megatron_ext.testing.multirank import run_on_ranks

from .ntp_bodies import LR, WEIGHT_DECAY, train

STEPS = 10
RTOL = 1e-5
# Adam divides by sqrt(v) + eps, so reduction-order rounding in near-zero
# gradients moves single weights by a fraction of one step (lr=1e-3); uniform
# TP=4 differs from TP=1 by 1.3e-4 after 10 steps of this run.
WEIGHT_ATOL = 5e-4
SPEC = tiny_gpt.TinyGPTSpec()
SPEC_GLU_GQA = tiny_gpt.TinyGPTSpec(gated_linear_unit=True, num_query_groups=2)

_baselines = {}


def _backends(gpus):
    """gloo on CPU, and the same body on NCCL where ``gpus`` GPUs exist
    (NCCL needs one GPU per rank)."""
    return ["gloo", pytest.param("nccl", marks=pytest.mark.gpus(gpus))]


def _baseline(spec, backend):
    if (spec, backend) not in _baselines:
        (_baselines[spec, backend],) = run_on_ranks(
            train, 1, args=(None, STEPS), kwargs=dict(spec=spec), timeout=240, backend=backend
        )
    return _baselines[spec, backend]


def _check_overlap(out):
    """Overlapped runs: every healthy rank dispatches its bucket groups' DP collectives from
    the backward hooks, before finish_grad_sync (a partner adds its satellite's gradients of
    each group first); a degraded rank owns no bucket group and has sent every gradient
    unit of the last step to its partner from its own backward hooks."""
    ranks = [o for o in out if o is not None]
    assert any(o["role"] == "degraded" for o in ranks), "the job has no degraded replica"
    for o in ranks:
        if o["role"] == "degraded":
            assert o["bucket_groups"] == o["in_flight_after_backward"] == 0, o
            assert o["sent_after_backward"] == o["transfer_groups"] > 1, o
            continue
        assert o["bucket_groups"] > 1, o["bucket_groups"]
        assert o["in_flight_after_backward"] == o["bucket_groups"], o


def _check_parity(out, ref, replicas, rtol=RTOL, weight_atol=WEIGHT_ATOL):
    ranks = [o for o in out if o is not None]
    per_replica = {}
    for o in ranks:
        per_replica.setdefault(o["replica"], []).append(o)
    assert sorted(per_replica) == list(range(replicas))
    assert any(o["degraded"] for o in ranks) and any(not o["degraded"] for o in ranks)
    first = [rs[0]["losses"] for _, rs in sorted(per_replica.items())]
    for rs in per_replica.values():  # every TP rank of a replica sees its replica's loss
        assert all(r["losses"] == rs[0]["losses"] for r in rs)
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, f"baseline did not learn: {ref['losses']}"
    for step, want in enumerate(ref["losses"]):
        got = sum(f[step] for f in first) / replicas
        assert abs(got - want) <= rtol * abs(want), f"step {step}: NTP {got} vs uniform {want}"
    heads = [o for o in ranks if o["final"] is not None]
    degraded = [o for o in heads if o["degraded"]]
    healthy = [o for o in heads if not o["degraded"]]
    assert degraded[0]["tp_size"] < healthy[0]["tp_size"]
    for name, want in ref["init"].items():
        for o in heads:  # the same global model at init, only laid out differently
            assert torch.equal(o["init"][name], want), name
        for o in degraded + healthy[1:]:  # a satellite holds its partner's weights, healthy replicas agree
            assert torch.equal(o["final"][name], healthy[0]["final"][name]), name
        assert not torch.equal(healthy[0]["final"][name], want) or name.endswith("bias")
        err = (healthy[0]["final"][name] - ref["final"][name]).abs().max().item()
        assert err <= weight_atol, f"{name}: {err}"


def _check_sharded_state_dicts(out):
    """``model_sharded_state_dict`` (what dist-checkpointing saves and loads): the healthy
    replicas' own Megatron description of their ``tp_base`` model (a uniform checkpoint, every
    healthy replica alike), nothing on degraded ranks, whose ``state_dict()`` refuses, naming who to
    save from."""
    ranks = [o for o in out if o is not None]
    healthy = {}
    for o in ranks:
        if o["degraded"]:
            assert o["sharded"] is None, o["tp_rank"]
            assert "state_dict() of a degraded replica" in o["state_dict_refusal"], o["state_dict_refusal"]
            assert "Save from them" in o["state_dict_refusal"]
            continue
        got = healthy.setdefault(o["tp_rank"], o["sharded"])
        assert got.keys() == o["sharded"].keys()
        for key, parts in o["sharded"].items():
            for g, w in zip(got[key], parts):
                assert g[:-1] == w[:-1], (key, g[:-1], w[:-1])
                if torch.is_tensor(w[-1]):
                    assert torch.equal(g[-1], w[-1]), key
    assert healthy, "no healthy rank"


def _nbytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())


def _check_memory_reports(out, chunk_bytes=64 * 2**20):
    """``ddp_memory_report`` / ``memory_report`` count exactly the tensors each rank holds
    (fp32 model and gradients, plain Adam, no distributed optimizer: no bucket padding).
    Healthy ranks hold a uniform ``tp_base`` rank's parameters, gradients and Adam state (two
    fp32 moments and an fp32 step per parameter); a partner holds the transfers' staging on top,
    at most one transfer unit (``chunk_bytes``: larger tensors are cut into slices, and no slice of
    these models is larger) per dtype moved. A degraded rank holds its ``tp_reduced`` parameters and
    gradients, the same staging, and no optimizer state."""
    ranks = [o for o in out if o is not None]
    for o in ranks:
        m, state = o["memory"], o["compute_state"]
        assert m.role == o["role"], (m, o["role"])
        assert m.params == m.grads == _nbytes(state), (m.role, m)
        assert m.optimizer_main_params == 0, m
        # one flat buffer per dtype: the fp32 gradients', and the parameters' where their dtype differs
        dtypes = {t.dtype for t in state.values()} | {torch.float32}
        if m.role == "degraded":
            assert m.optimizer_state == 0, m
            assert 0 < m.staging <= chunk_bytes * len(dtypes), m
        else:
            assert m.optimizer_state == 2 * _nbytes(state) + 4 * len(state), m
            if m.role == "partner":
                assert 0 < m.staging <= chunk_bytes * len(dtypes), m
            else:
                assert m.staging == 0, m
        assert m.total == m.params + m.grads + m.staging + m.optimizer_state


@pytest.mark.parametrize("backend", _backends(3))
def test_packed_tp2_one_failed_gpu_plain_optimizer(backend):
    """tp_base=2, replica 0 lost slot 1: 3 processes, replica 0 runs at TP=1."""
    ntp = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)})
    out = run_on_ranks(train, 3, args=(ntp, STEPS), timeout=300, backend=backend)
    _check_parity(out, _baseline(SPEC, backend), replicas=2)


def adam_drift_bound(lr: float, steps: int, weight_decay: float, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The largest ``|w_a - w_b|`` of one weight after ``steps`` AdamW steps from the
    same value, whatever the two gradient sequences (Megatron's defaults: betas
    0.9 / 0.999, decoupled weight decay, bias correction).

    Step ``t`` moves a weight by ``lr * m_t / (sqrt(v_t) + eps)`` with bias-corrected
    ``m_t = sum_i a_i g_i`` and ``v_t = sum_i b_i g_i**2`` (``a_i``, ``b_i`` the
    normalised EMA weights, each summing to 1). By Cauchy-Schwarz
    ``|m_t| <= sqrt(sum_i a_i**2 / b_i) * sqrt(v_t)``, so one step moves a weight by
    at most ``lr * B_t`` with ``B_t = sqrt(sum_i a_i**2 / b_i)`` (1 at ``t = 1``,
    1.0014 at ``t = 2``, ...), for any gradients, clipped or not. Two runs can move
    a weight in opposite directions every step: ``2 * lr * B_t``. Decoupled weight
    decay multiplies an existing difference by ``(1 + lr * wd)`` at most per step."""
    total = 0.0
    for t in range(1, steps + 1):
        a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1**t) for i in range(1, t + 1)]
        b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2**t) for i in range(1, t + 1)]
        total = total * (1 + lr * weight_decay) + 2 * lr * math.sqrt(sum(x * x / y for x, y in zip(a, b)))
    return total


def bf16_ulp(magnitude: float) -> float:
    """The spacing of bfloat16 numbers (8 significant bits) at ``magnitude``."""
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)


def test_packed_tp2_bf16_params_with_fp32_main_params():
    """bf16 model (Megatron's Float16Module and its fp32 main-param optimizer),
    against a bf16 single-rank baseline: bf16 rounding bounds the agreement.

    Weights: NTP computes the same gradients as the baseline, summed in another
    order (replica halves, TP partial sums) from bf16 operands, so each differs
    by bf16 rounding of its terms (unit roundoff 2**-8), relative to the sum of
    the terms' magnitudes, not to the gradient itself. Where the terms cancel
    (QKV biases start at 0 and get near-zero gradients) that rounding flips the
    gradient's sign, and Adam, which divides by sqrt(v), turns a flipped sign
    into a full step the other way: on such a weight reduction order alone can
    cost the whole Adam drift bound, ``adam_drift_bound`` (2.0e-2 here; the
    observed worst weight moved 1.07e-2 on one CPU and under 1e-2 on another).
    The compared weights are the bf16 roundings of the fp32 main params: one bf16
    spacing at the largest weight more. Gradient faults cannot exceed that bound
    either (Adam's steps are bounded whatever the gradient), so the losses catch
    those: rolling the folded gradients by one element puts the loss 8e-3..1e-1
    off the baseline from the second step on (rtol 1e-3; 8.8e-5 at most without it)."""
    ntp = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)})
    out = run_on_ranks(train, 3, args=(ntp, STEPS), kwargs=dict(bf16=True), timeout=300, backend="gloo")
    (ref,) = run_on_ranks(train, 1, args=(None, STEPS), kwargs=dict(bf16=True), timeout=240, backend="gloo")
    largest = max(t.abs().max().item() for t in ref["final"].values())
    bound = adam_drift_bound(LR, STEPS, WEIGHT_DECAY) + bf16_ulp(largest)
    _check_parity(out, ref, replicas=2, rtol=1e-3, weight_atol=bound)


@pytest.mark.parametrize("backend", _backends(4))
def test_simulated_tp2_distributed_optimizer_overlap_glu_gqa(backend):
    """Simulate mode (4 processes, slot 0 of replica 0 leaves), Megatron's
    distributed optimizer, overlapped bucketed reduction, fp32 grads reduced
    without grad_reduce_in_fp32, two micro-batches (``no_sync``), gated MLP
    and GQA."""
    ntp = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (0,)}, launch_mode="simulate")
    out = run_on_ranks(
        train,
        4,
        args=(ntp, STEPS),
        timeout=300,
        backend=backend,
        kwargs=dict(
            spec=SPEC_GLU_GQA, distributed_optimizer=True, overlap=True, grad_reduce_in_fp32=False, microbatches=2
        ),
    )
    assert out[0] is None, "the process of the failed slot must leave"
    _check_overlap(out)
    _check_parity(out, _baseline(SPEC_GLU_GQA, backend), replicas=2)
    _check_sharded_state_dicts(out)
    # Distributed optimizer over the one healthy replica (DP=1): each partner rank holds Adam's two
    # fp32 moments of its whole tp_base shard and an fp32 step per parameter, as a uniform TP=2 rank
    # with DP=1 would; the degraded rank holds no optimizer state.
    by_role = {}
    for o in out[1:]:
        by_role.setdefault(o["role"], []).append(o)
    assert sorted(by_role) == ["degraded", "partner"]
    (deg,) = by_role["degraded"]
    assert deg["memory"].optimizer == 0 and deg["memory"].params == _nbytes(deg["compute_state"]), deg["memory"]
    for o in by_role["partner"]:
        state = o["compute_state"]
        assert o["memory"].optimizer_state == 2 * _nbytes(state) + 4 * len(state), o["memory"]


@pytest.mark.parametrize("backend", _backends(6))
def test_packed_tp4_two_spares_sequence_parallel_overlap_and_checkpoint_conversion(backend):
    """tp_base=4, replica 0 lost slots 1 and 2: 6 processes, replica 0 at TP=2, with
    sequence parallelism on both replicas: degraded rank i's partial gradient of every norm
    and row-parallel bias (its half of the sequence) goes to partner rank i, whose TP sum
    then holds each part once. Faults fail it: those gradients routed as replicated ones
    (degraded rank j % 2 into partner rank j) put the second step's loss 6.2e-4 relative
    off, the norms left unmarked (no TP sum) the third step's 1.6e-5 (RTOL 1e-5). Then the
    NTP training state converts to the uniform TP=4 layout and back."""
    ntp = dict(tp_base=4, tp_spares=2, non_active_ranks_per_dp={0: (1, 2)})
    kwargs = dict(overlap=True, sequence_parallel=True)
    out = run_on_ranks(train, 6, args=(ntp, STEPS), kwargs=kwargs, timeout=300, backend=backend)
    assert all(o["sequence_parallel"] for o in out)
    _check_parity(out, _baseline(SPEC, backend), replicas=2)
    _check_overlap(out)
    _check_sharded_state_dicts(out)
    _check_memory_reports(out)

    degraded = sorted((o for o in out if o["degraded"]), key=lambda o: o["tp_rank"])
    healthy = sorted((o for o in out if not o["degraded"]), key=lambda o: o["tp_rank"])
    assert [o["tp_size"] for o in degraded + healthy] == [2, 2, 4, 4, 4, 4]
    specs = healthy[0]["specs"]
    # The degraded replica's TP=2 shards -> uniform TP=4: exactly what the healthy replica holds.
    uniform = ntp_to_uniform([d["compute_state"] for d in degraded], specs, tp_base=4)
    sharded = [n for n, s in specs.items() if s.dim is not None]
    assert any(specs[n].chunks == 1 for n in sharded) and sharded
    for rank, h in enumerate(healthy):
        for name, t in h["compute_state"].items():
            assert torch.equal(uniform[rank][name], t), name
    # ... and back: uniform TP=4 -> the degraded replica's TP=2 shards.
    back = uniform_to_ntp([h["compute_state"] for h in healthy], specs, tp_reduced=2)
    for rank, d in enumerate(degraded):
        for name, t in d["compute_state"].items():
            assert torch.equal(back[rank][name], t), name


SPEC_TP43 = tiny_gpt.TinyGPTSpec(hidden_size=96, num_attention_heads=12, ffn_hidden_size=192, vocab_size=192)


@pytest.mark.parametrize("backend", _backends(7))
def test_packed_tp4_one_spare_reduced_degree_three(backend):
    """tp_base=4, replica 1 lost slot 0: 7 processes, replica 1 at TP=3, so
    healthy shards straddle reduced shards (4 -> 3 resharding); distributed
    optimizer with overlap."""
    ntp = dict(
        tp_base=4,
        tp_spares=1,
        non_active_ranks_per_dp={1: (0,)},
        num_attention_heads=12,
        ffn_hidden_size=192,
        vocab_size=192,
    )
    out = run_on_ranks(
        train,
        7,
        args=(ntp, STEPS),
        timeout=300,
        backend=backend,
        kwargs=dict(spec=SPEC_TP43, distributed_optimizer=True, overlap=True),
    )
    assert sorted(o["tp_size"] for o in out) == [3, 3, 3, 4, 4, 4, 4]
    _check_overlap(out)
    _check_parity(out, _baseline(SPEC_TP43, backend), replicas=2)


@pytest.mark.parametrize("backend", _backends(3))
def test_packed_tp2_with_symmetric_memory_staging(backend):
    """NTP buckets staged by megatron_ext.fsdp_symm (mode 'on'): the same
    training as uniform TP. On gloo every bucket falls back to plain buffers
    and says why; on NCCL every uncoalesced bucket is symmetric."""
    ntp = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)})
    out = run_on_ranks(train, 3, args=(ntp, STEPS), kwargs=dict(symm_mem=dict(mode="on")), timeout=300, backend=backend)
    _check_parity(out, _baseline(SPEC, backend), replicas=2)
    for o in out:
        if o["role"] == "degraded":  # no bucket of its own to stage
            assert not o["symm_decisions"], o["symm_decisions"]
            continue
        assert o["symm_decisions"], "no bucket was considered for staging"
        for d in o["symm_decisions"]:
            if backend == "gloo":
                assert not d.symmetric and "nccl" in d.reason.lower(), d
            else:
                assert d.symmetric or "coalesces" in d.reason, d


def _by_tp_rank(out, role):
    return {o["tp_rank"]: o for o in out if o is not None and o["role"] == role}


def test_bystander_is_a_uniform_rank_and_two_degraded_replicas_train_like_uniform():
    """Three replicas at tp_base=2 (replica 0 lost a GPU: degraded; replica 1 its partner;
    replica 2 a bystander), overlapped reduction in small transfer units, and a uniform TP=2 x DP=2
    job of the healthy replicas alone. The bystander's ranks issue exactly the uniform ranks'
    collectives (op, group size, bytes; world-wide ones named as such) and hold exactly their
    tensors; the NTP job trains like a single rank. Then two degraded replicas with two partners
    (distributed optimizer, no overlap): parity again."""
    batch = 6
    ntp = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)}, transfer_chunk_mb=0.05)
    kw = dict(overlap=True, global_batch=batch, collectives=True)
    out = run_on_ranks(train, 5, args=(ntp, STEPS), kwargs=kw, timeout=300, backend="gloo")
    # the uniform job's replicas get as many samples each as the NTP job's (its TP all-reduces of
    # activations then match too)
    uniform = run_on_ranks(
        train, 4, args=(None, STEPS), kwargs=dict(kw, tp=2, global_batch=batch * 2 // 3), timeout=300, backend="gloo"
    )
    (ref,) = run_on_ranks(train, 1, args=(None, STEPS), kwargs=dict(global_batch=batch), timeout=240, backend="gloo")
    assert sorted(o["role"] for o in out) == ["bystander", "bystander", "degraded", "partner", "partner"]
    _check_parity(out, ref, replicas=3)
    _check_overlap(out)
    _check_memory_reports(out, chunk_bytes=int(0.05 * 2**20))
    assert max(o["transfer_units"] for o in out if o["role"] != "bystander") > max(
        o["transfer_groups"] for o in out if o["role"] != "bystander"
    ), "the small transfer chunk should split bucket groups into several units"
    bystanders, uniform = _by_tp_rank(out, "bystander"), {o["tp_rank"]: o for o in uniform if o["replica"] == 1}
    for j, o in bystanders.items():
        u = uniform[j]
        assert o["collectives"] == u["collectives"], (j, o["collectives"], u["collectives"])
        assert dataclasses.replace(o["memory"], role="uniform") == u["memory"], (o["memory"], u["memory"])
    partners = _by_tp_rank(out, "partner")
    assert len(partners[0]["collectives"]) > len(bystanders[0]["collectives"])  # the transfers

    ntp2 = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,), 2: (0,)})
    out2 = run_on_ranks(
        train, 6, args=(ntp2, STEPS), kwargs=dict(distributed_optimizer=True), timeout=300, backend="gloo"
    )
    assert sorted(o["role"] for o in out2) == ["degraded", "degraded"] + ["partner"] * 4
    _check_parity(out2, _baseline(SPEC, "gloo"), replicas=4)
    _check_sharded_state_dicts(out2)


def test_per_token_loss_needs_the_ntp_finalize_function():
    """With calculate_per_token_loss a satellite's token count must join its partner's before
    Megatron divides by the global count: Megatron's own finalize_model_grads is refused on
    every rank of the pair (before any transfer or collective, so nothing hangs), naming the
    function to use."""
    from .ntp_bodies import per_token_loss_without_the_wrapper

    ntp = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)})
    out = run_on_ranks(per_token_loss_without_the_wrapper, 3, args=(ntp,), timeout=120, backend="gloo")
    assert sorted(role for role, _ in out) == ["degraded", "partner", "partner"]
    for _, message in out:
        assert message and "megatron_ext.nonuniform_tp.finalize_model_grads" in message, message


def test_drop_policy_trains_the_healthy_replicas_alone():
    """--ntp-policy drop, packed: replica 0 lost a GPU, its surviving process leaves (an inactive
    state, no training) and the healthy replica trains the whole global batch with Megatron's own DDP:
    the single-rank baseline's losses."""
    ntp = dict(tp_base=2, tp_spares=1, non_active_ranks_per_dp={0: (1,)}, policy="drop")
    out = run_on_ranks(train, 3, args=(ntp, STEPS), timeout=300, backend="gloo")
    assert out[0] is None, "the dropped replica's process must leave"
    ref = _baseline(SPEC, "gloo")
    for o in out[1:]:
        assert (o["role"], o["replica"], o["tp_size"]) == ("uniform", 0, 2), o
        assert o["memory"].staging == 0 and o["transfer_groups"] is None
        for got, want in zip(o["losses"], ref["losses"]):
            assert abs(got - want) <= RTOL * abs(want), (o["losses"], ref["losses"])
