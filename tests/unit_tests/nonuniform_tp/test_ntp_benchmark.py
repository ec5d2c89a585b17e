"""benchmarks/ntp.py: its four jobs run end to end on 4 gloo ranks and write every table to the JSON;
the cost model (megatron_ext.nonuniform_tp.cost_model) against values derived by hand; the flags the
benchmark refuses.

Model notation in the comments: c = one micro-batch's fwd+bwd on a healthy replica; a replica at TP=r
needs tp/r * c per micro-batch; a partner and its satellite each pay the pair's transfers o per step,
bystanders nothing; the step is the slowest replica's compute (+ o) + the DP collective over the
healthy replicas + the optimizer + the rest. With pp pipeline stages per replica: m micro-batches take
(m + pp - 1) * t / pp (the 1F1B bubble), o, the DP collective and the optimizer 1/pp of pp=1's."""

import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import ntp as bench  # spawned ranks unpickle its functions by this module name
from megatron_ext.nonuniform_tp import cost_model as cm

MODEL_ONLY = cm.StepCosts(microbatch_s=1.0)  # compute only: perfect scaling, no overheads
ROOT = pathlib.Path(__file__).resolve().parents[3]


# ---- the benchmark end to end ------------------------------------------------------------------
def test_benchmark_runs_all_four_jobs_on_four_gloo_ranks(tmp_path):
    out = tmp_path / "ntp.json"
    argv = ["--backend", "gloo", "--hidden", "64", "--layers", "1", "--heads", "4", "--vocab", "128", "--seq", "16"]
    argv += ["--micro-batch", "1", "--global-batch", "6", "--steps", "2", "--warmup", "0", "--model-failed", "3"]
    assert bench.main(argv + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())

    jobs = result["jobs"]
    assert list(jobs) == ["uniform", "ntp unbalanced", "ntp balanced", "drop"]
    # 6 micro-batches: equal shares 3/3; TP degrees 1:2 (replica 0 degraded) give 2/4; drop: one replica, all 6
    assert [j["microbatches"] for j in jobs.values()] == [[3, 3], [3, 3], [2, 4], [6]]
    assert [j["gpus"] for j in jobs.values()] == [4, 3, 3, 2]
    uniform = jobs["uniform"]["tokens_per_s"]
    for j in jobs.values():
        assert j["tokens_per_s"] == pytest.approx(6 * 16 / j["step"])
        assert j["vs_uniform"] == pytest.approx(j["tokens_per_s"] / uniform)
    assert jobs["drop"]["vs_ideal"] == pytest.approx(jobs["drop"]["tokens_per_s"] / (3 / 4 * uniform))
    # the 4-rank layout: replica 0 (TP=1) is the satellite of replica 1 (TP=2), no bystander
    balanced = jobs["ntp balanced"]["kinds"]
    assert set(balanced) == {"partner", "degraded"}
    assert (balanced["partner"]["ranks"], balanced["partner"]["microbatches"]) == (2, 4)
    assert (balanced["degraded"]["ranks"], balanced["degraded"]["microbatches"]) == (1, 2)
    for kind in ("partner", "degraded"):  # the pair's gradient all-to-alls ran in their own phase
        assert balanced[kind]["grad_transfer"] > 0 and balanced[kind]["transfers"] > 0
    assert jobs["ntp balanced"]["partner_overhead_pct"] > 0
    assert jobs["ntp balanced"]["bystander_overhead_pct"] is None  # no bystander in this layout
    assert jobs["uniform"]["partner_overhead_pct"] is None and set(jobs["uniform"]["kinds"]) == {"all"}

    ranks = result["per_rank"]
    assert [len(ranks[job]) for job in ("uniform", "ntp", "drop")] == [4, 3, 2]  # slot 1 left the NTP job
    assert sorted((r["replica"], r["degraded"], r["role"]) for r in ranks["ntp"]) == [
        (0, True, "degraded"),
        (1, False, "partner"),
        (1, False, "partner"),
    ]
    for r in ranks["ntp"]:
        assert list(r["phases"]) == ["ntp unbalanced", "ntp balanced"]
        assert all(len(v) == 2 for phase in r["phases"].values() for v in phase["times"].values())

    memory = result["memory"]
    assert set(memory) == {"uniform job, all ranks", "NTP partner", "NTP degraded"}
    uni, partner, degraded = memory["uniform job, all ranks"], memory["NTP partner"], memory["NTP degraded"]
    assert uni["staging"] == 0 and partner["staging"] > 0 and degraded["staging"] > 0
    # a partner holds a uniform rank's model memory (same TP shard, same optimizer) plus the transfer staging
    for field in ("params", "grads", "optimizer"):
        assert partner[field] == uni[field], field
    assert partner["total"] == uni["total"] + partner["staging"]
    # the tiny preset's transfer unit (0.0625 MiB of fp32 gradient) bounds the staging: one flat fp32 buffer
    assert partner["staging"] <= 2**16 and degraded["staging"] <= 2**16
    # the degraded rank (TP=1) holds the whole model and its gradients, and no optimizer state
    assert degraded["optimizer"] == 0 and degraded["params"] > uni["params"]

    model = result["model"]
    assert [c["job"] for c in model["check"]] == ["ntp balanced", "ntp unbalanced", "drop"]
    assert model["costs"]["microbatches_per_replica"] == 3
    assert model["costs"]["grad_transfer_s"] > 0 and model["costs"]["param_transfer_s"] > 0
    tables = model["large_jobs"]
    assert [(t["dp"], t["tp"]) for t in tables] == [(64, 8), (16, 32), (8, 64)]
    for t in tables:
        assert t["microbatches_per_replica"] == 3  # this run's samples per replica, one per micro-batch
        assert [(r["k"], r["placement"]) for r in t["rows"]] == [(k, p) for k in (1, 2, 3) for p in cm.PLACEMENTS]
        assert all(r["ntp policy"] >= r["drop"] for r in t["rows"])
        assert t["verdict"][0].startswith("NTP policy >= drop in 6 of 6 rows")
    assert len(result["targets"]) == 7
    mem = [t for t in result["targets"] if t.startswith("memory:")]
    assert (
        mem[0]
        == f"memory: healthy ranks vs a uniform rank: partner {partner['total'] / uni['total']:.3f}x; target <= 1.02x"
    )
    assert mem[1].startswith(f"memory: degraded rank (TP 2->1, fp32) {degraded['total'] / uni['total']:.3f}x; target")
    assert result["provenance"]["command"].startswith("python benchmarks/ntp.py --backend gloo")

    # --costs-from: the model alone, from this run's record: the same costs, the same large-job rows
    again = tmp_path / "model.json"
    assert bench.main(["--costs-from", str(out), "--model-failed", "3", "--out", str(again)]) == 0
    model_only = json.loads(again.read_text())
    assert model_only["model"]["transfers_from"] == "the run's partner transfers"
    for key in ("microbatch_s", "grad_transfer_s", "param_transfer_s", "sync_s"):
        assert model_only["model"]["costs"][key] == pytest.approx(model["costs"][key]), key
    assert [t["rows"] for t in model_only["model"]["large_jobs"]] == [t["rows"] for t in tables]
    assert model_only["targets"] == result["targets"][-3:]
    # --pp: the same costs with every large job's replica a pipeline of 2 stages (DP x 2 x TP GPUs)
    staged = tmp_path / "pp2.json"
    assert bench.main(["--costs-from", str(out), "--model-failed", "3", "--pp", "2", "--out", str(staged)]) == 0
    staged_tables = json.loads(staged.read_text())["model"]["large_jobs"]
    assert [(t["dp"], t["tp"], t["pp"]) for t in staged_tables] == [(64, 8, 2), (16, 32, 2), (8, 64, 2)]
    assert staged_tables[0]["rows"][0]["ideal"] == (64 * 2 * 8 - 1) / (64 * 2 * 8)
    # a record of the previous design (unfold + fold, no partner transfers): half of it per direction, per shard
    old = dict(result, model=dict(result["model"], costs={**model["costs"], "ntp_overhead_s": 0.02}))
    del old["model"]["costs"]["grad_transfer_s"], old["model"]["costs"]["param_transfer_s"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    costs, source = bench.costs_from_record(json.loads((tmp_path / "old.json").read_text()))
    assert (costs.grad_transfer_s, costs.param_transfer_s) == (0.005, 0.005) and "previous design" in source


# ---- the cost model: the plans -----------------------------------------------------------------
def test_cost_model_imports_no_torch():
    # the package's __init__ imports modules that use torch; the module itself must not: load it alone
    code = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('cost_model', 'megatron_ext/nonuniform_tp/cost_model.py'); "
        "m = sys.modules['cost_model'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(m.best_plan.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "best_plan"


def test_no_failed_gpu_retains_the_whole_throughput():
    costs = cm.StepCosts(microbatch_s=1.0, sync_s=0.3, other_s=0.2, grad_transfer_s=0.4, param_transfer_s=0.1)
    for mode in cm.MODES:
        assert cm.predict_retained(costs, 8, (0, 0, 0, 0), 32, mode) == 1.0


def test_balanced_ntp_with_perfect_scaling_retains_the_surviving_gpus():
    # DP=2 x TP=8, one GPU lost: shares 14 and 16 of 30; the TP=7 replica needs 14 * 8/7 = 16 c, its
    # partner 16 c; uniform 15 c: 15/16 = (16 - 1) / 16 GPUs.
    assert cm.predict_retained(MODEL_ONLY, 8, (1, 0), 30, "ntp balanced") == pytest.approx(15 / 16)
    # DP=4 x TP=2, one replica at TP=1: 28 micro-batches split 4, 8, 8, 8 -> 8 c (4 * 2 c for TP=1); uniform 7 c
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 0, 0, 0), 28, "ntp balanced") == pytest.approx(7 / 8)
    # two replicas at TP=1 (two partners): 24 split 4, 4, 8, 8 -> 8 c; uniform 6 c: 6/8 GPUs
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 1, 0, 0), 24, "ntp balanced") == pytest.approx(6 / 8)
    # with equal shares the TP=1 replica needs 7 * 2 c: every replica waits for it
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 0, 0, 0), 28, "ntp unbalanced") == pytest.approx(1 / 2)


def test_dropping_k_replicas_retains_the_others():
    # 12 micro-batches: 3 per replica of 4; 4 per replica of 3 -> 3/4; 6 per replica of 2 -> 1/2
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 0, 0, 0), 12, "drop") == pytest.approx(3 / 4)
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 1, 0, 0), 12, "drop") == pytest.approx(2 / 4)
    # every replica degraded: dropping them leaves nothing
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 1), 12, "drop") == 0.0


def test_partner_and_satellite_take_smaller_shares_to_absorb_their_transfers():
    # DP=4 x TP=2, replica 0 at TP=1 (t = 2 c), transfers 0.5 c per healthy shard -> o = 0.5 * 2/1 = 1 c on
    # the satellite and on its partner (replica 1). 26 micro-batches: at a level of 8 c the satellite fits
    # 3 (3 * 2 + 1 = 7), the partner 7 (7 + 1), each bystander 8: 3 + 7 + 8 + 8 = 26 exactly.
    costs = cm.StepCosts(microbatch_s=1.0, grad_transfer_s=0.3, param_transfer_s=0.2)
    plan = cm.plan_step(costs, 2, (1, 0, 0, 0), 26, "ntp balanced")
    assert plan.roles == ("satellite", "partner", "bystander", "bystander")
    assert plan.shares == (3, 7, 8, 8) and plan.busy_s == pytest.approx((7, 8, 8, 8))
    # uniform: 26 over 4 -> 7 c; shares by TP degree alone (4, 8, 7, 7) would leave the pair at 9 c
    assert cm.predict_retained(costs, 2, (1, 0, 0, 0), 26, "ntp balanced") == pytest.approx(7 / 8)
    assert cm.predict_retained(costs, 2, (1, 0, 0, 0), 26, "ntp balanced", shares=(4, 8, 7, 7)) == pytest.approx(7 / 9)
    # fluid shares: every replica finishes at one level T: (T-1)/2 + (T-1) + 2T = 26 -> T = 27.5/3.5
    fluid = cm.plan_step(costs, 2, (1, 0, 0, 0), 26, "ntp balanced", fluid=True)
    level = 27.5 / 3.5
    assert fluid.busy_s == pytest.approx((level,) * 4)
    assert fluid.shares == pytest.approx(((level - 1) / 2, level - 1, level, level))


def test_bystanders_cost_nothing():
    # DP=4 x TP=2, replica 0 at TP=1, heavy transfers (o = 2 c), shares that leave the bystanders the slowest:
    # their busy time is their share alone, the DP collective runs over the 3 healthy replicas (ring 4/3
    # of the 2-replica time measured) at TP=2 (no tp/r factor), the optimizer at TP=2.
    costs = cm.StepCosts(microbatch_s=1.0, sync_s=1.0, optimizer_s=0.5, other_s=0.25, grad_transfer_s=1.0)
    plan = cm.plan_step(costs, 2, (1, 0, 0, 0), 28, "ntp unbalanced", shares=(2, 6, 10, 10))
    assert plan.busy_s == pytest.approx((2 * 2 + 2, 6 + 2, 10, 10))
    assert plan.dp_replicas == 3
    assert plan.step_s == pytest.approx(10 + 4 / 3 + 0.5 + 0.25)
    # the same bystanders' time in a job without a degraded replica (uniform job, 10 micro-batches each)
    bystanders_only = cm.plan_step(costs, 2, (0, 0, 0), 30, "ntp balanced")
    assert bystanders_only.busy_s == (10, 10, 10) and bystanders_only.roles == ("replica",) * 3
    # more bystanders never add transfers: every row of a larger job pays the pair's o on two replicas only
    large = cm.plan_step(costs, 2, (1,) + (0,) * 15, 160, "ntp balanced")
    paying = [b - m * costs.microbatch_at(2, t) for b, m, t in zip(large.busy_s, large.shares, large.degrees)]
    assert paying == pytest.approx([2.0, 2.0] + [0.0] * 14)


def test_micro_batch_granularity_costs_ntp_and_drop_alike():
    # DP=2 x TP=2, 4 micro-batches, replica 0 at TP=1: the best integer split is 1:3 -> max(1 * 2 c, 3 c)
    # = 3 c against 2 c uniform: 2/3, not the 3/4 of the GPUs; fluid shares 4/3 : 8/3 reach 3/4.
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 0), 4, "ntp balanced") == pytest.approx(2 / 3)
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 0), 4, "ntp balanced", fluid=True) == pytest.approx(3 / 4)
    # DP=64 x TP=8, 16 micro-batches per replica (1024), one GPU lost: the TP=7 replica takes at most 14
    # (15 * 8/7 > 17), so 1010 go to 63 healthy replicas, some get 17 -> 16/17. Dropping it: 1024 over 63,
    # some get 17 -> 16/17 as well: the policy drops it (a tie goes to drop). Fluid: NTP keeps 511/512 of
    # the GPUs' throughput, drop 63/64.
    failed = cm.place_failures(64, 8, 1, "spread")
    for mode in ("ntp balanced", "drop", "ntp policy"):
        assert cm.predict_retained(MODEL_ONLY, 8, failed, 1024, mode) == pytest.approx(16 / 17)
    assert cm.best_plan(MODEL_ONLY, 8, failed, 1024).choice == "drop"
    assert cm.predict_retained(MODEL_ONLY, 8, failed, 1024, fluid=True) == pytest.approx(511 / 512)
    assert cm.predict_retained(MODEL_ONLY, 8, failed, 1024, "drop", fluid=True) == pytest.approx(63 / 64)


def test_shrinking_batch_keeps_every_replica_s_work():
    # DP=4 x TP=8, 24 micro-batches per replica, replica 0 at TP=7: the healthy replicas keep 24, the
    # satellite does the 21 that fit in 24 c (21 * 8/7 = 24): 93 of 96 per step in the uniform step time.
    plan = cm.plan_step(MODEL_ONLY, 8, (1, 0, 0, 0), 96, "ntp shrink")
    assert plan.shares == (21, 24, 24, 24) and plan.batch_fraction == pytest.approx(93 / 96)
    assert cm.predict_retained(MODEL_ONLY, 8, (1, 0, 0, 0), 96, "ntp shrink") == pytest.approx(93 / 96)
    # bounded: at most 2% of 96 = 1.92 left out -> the satellite takes 23 (23 * 8/7 c), the step grows
    bounded = cm.plan_step(MODEL_ONLY, 8, (1, 0, 0, 0), 96, "ntp shrink", max_shrink=0.02)
    assert bounded.shares == (23, 24, 24, 24)
    assert bounded.throughput / cm.uniform_plan(MODEL_ONLY, 4, 8, 96).throughput == pytest.approx(
        (95 / 96) * 24 / (23 * 8 / 7)
    )
    # nothing may be left out: every satellite takes its whole share
    assert cm.plan_step(MODEL_ONLY, 8, (1, 0, 0, 0), 96, "ntp shrink", max_shrink=0.0).shares == (24,) * 4


def test_more_degraded_than_healthy_replicas_run_every_replica_at_the_reduced_degree():
    # DP=8 x TP=64, 5 GPUs lost one per replica: 5 degraded replicas, 3 healthy: the layout refuses NTP
    # (every satellite needs its own partner); the policy runs all 8 replicas at TP=63 (6 micro-batches each
    # in 6 * 64/63 c; uniform 6 c): 63/64. Dropping the 5 leaves 3 replicas: 16 each -> 6/16.
    failed = cm.place_failures(8, 64, 5, "spread")
    assert cm.plan_step(MODEL_ONLY, 64, failed, 48, "ntp balanced") is None
    plan = cm.best_plan(MODEL_ONLY, 64, failed, 48)
    assert plan.choice == "all at r" and plan.tp_reduced == 63 and plan.describe() == "every replica at TP 63"
    assert cm.predict_retained(MODEL_ONLY, 64, failed, 48) == pytest.approx(63 / 64)
    assert cm.predict_retained(MODEL_ONLY, 64, failed, 48, "drop") == pytest.approx(6 / 16)
    # with 3 healthy partners the policy may also keep 3 satellites and drop 2 (not better here)
    keep3 = cm.plan_step(MODEL_ONLY, 64, failed, 48, "ntp balanced", keep=3)
    assert (keep3.kept, keep3.dropped, keep3.roles.count("partner")) == (3, 2, 3)


def test_spare_parity_and_replicas_that_lost_every_gpu():
    # TP=4: replicas lose 2 and 1 GPUs; both run at TP=2 (parity). 12 micro-batches split 2, 2, 4, 4 ->
    # 2 * 4/2 = 4 c everywhere; uniform 3 c: 3/4, below the 13/16 of the GPUs.
    assert cm.reduced_degree(4, (2, 1, 0, 0)) == 2
    assert cm.predict_retained(MODEL_ONLY, 4, (2, 1, 0, 0), 12, "ntp balanced") == pytest.approx(3 / 4)
    # TP=2, both GPUs of replica 0 lost: it is gone in every plan; 12 over 3 replicas -> 3/4 for every mode
    failed = cm.place_failures(4, 2, 2, "packed")
    assert failed == (2, 0, 0, 0)
    for mode in cm.MODES:
        assert cm.predict_retained(MODEL_ONLY, 2, failed, 12, mode) == pytest.approx(3 / 4)


def test_reduced_degree_splits_the_model():
    assert cm.reduced_degree(8, (1, 0)) == 7 and cm.reduced_degree(8, (0, 0)) is None
    assert cm.reduced_degree(8, (1, 0), sizes=(32,)) == 4  # 32 heads split at 4, not 7, 6, 5
    assert cm.reduced_degree(64, (1, 0), sizes=(128, 8192)) == 32


def test_large_job_rows_run_at_the_degree_the_model_splits_at():
    # 128 heads: a TP=64 replica that lost one GPU runs at 32 (63..33 do not divide 128), 2 c per micro-batch.
    # Compute only, 8 micro-batches per replica (64): as a satellite it takes 4, the 7 healthy replicas 60
    # (some 9): 9 c (8/9); dropping it: 64 over 7 -> 10 c (8/10); every replica at TP 32: 8 * 2 c (1/2).
    rows = cm.large_job_table(MODEL_ONLY, 8, 64, 1, 64, sizes=(128,))
    assert [r["tp_reduced"] for r in rows] == [32, 32]
    assert rows[0]["ntp policy"] == pytest.approx(8 / 9) and rows[0]["choice"] == "keep 1 degraded replica(s) at TP 32"
    assert rows[0]["drop"] == pytest.approx(8 / 10) and rows[0]["all at r"] == pytest.approx(1 / 2)


def test_place_failures():
    assert cm.place_failures(4, 2, 3, "spread") == (1, 1, 1, 0)
    assert cm.place_failures(4, 8, 5, "spread") == (2, 1, 1, 1)
    assert cm.place_failures(4, 8, 10, "packed") == (8, 2, 0, 0)
    with pytest.raises(ValueError, match="placement must be one of"):
        cm.place_failures(4, 8, 1, "random")
    with pytest.raises(ValueError, match="0..dp\\*tp = 32"):
        cm.place_failures(4, 8, 33, "spread")


# ---- the cost model: pipeline stages -----------------------------------------------------------
def test_pipeline_stages_pay_the_bubble_and_split_the_transfers_and_the_sync():
    # DP=4 x PP=2 x TP=2, replica 0 at TP=1 (t = 2 c), transfers 0.5 c per healthy shard at pp=1 -> o = 0.5 *
    # 2/1 / 2 stages = 0.5 c on the satellite and its partner. Busy (m + 1) * t / 2 + o: satellite m + 1.5,
    # partner m/2 + 1, bystanders m/2 + 0.5. 26 micro-batches at a level of 4.5 c: 3 + 7 + 8 + 8 = 26.
    costs = cm.StepCosts(
        microbatch_s=1.0, sync_s=1.0, optimizer_s=0.5, other_s=0.25, grad_transfer_s=0.3, param_transfer_s=0.2
    )
    plan = cm.plan_step(costs, 2, (1, 0, 0, 0), 26, "ntp balanced", pp=2)
    assert plan.shares == (3, 7, 8, 8) and plan.busy_s == pytest.approx((4.5,) * 4)
    # step: 4.5 + (DP collective over 3 healthy replicas, ring 4/3 of the 2-replica 1 c, + optimizer 0.5) / 2
    # stages + rest 0.25 = 17/3. Uniform: 7, 7, 6, 6 -> (7 + 1) / 2 = 4 + (ring 3/2 + 0.5) / 2 + 0.25 = 5.25.
    assert plan.step_s == pytest.approx(17 / 3)
    assert cm.uniform_plan(costs, 4, 2, 26, pp=2).step_s == pytest.approx(5.25)
    assert cm.predict_retained(costs, 2, (1, 0, 0, 0), 26, "ntp balanced", pp=2) == pytest.approx(63 / 68)
    # pp=1 is the model without stages: the same job's pp=1 plan (test_partner_and_satellite_take_smaller_...)
    assert cm.plan_step(costs, 2, (1, 0, 0, 0), 26, "ntp balanced", pp=1) == cm.plan_step(
        costs, 2, (1, 0, 0, 0), 26, "ntp balanced"
    )
    assert cm.plan_step(costs, 2, (1, 0, 0, 0), 26, "ntp balanced").busy_s == pytest.approx((7, 8, 8, 8))


def test_the_bubble_moves_micro_batches_from_the_satellite():
    # DP=2 x TP=2, replica 0 at TP=1 (t = 2 c), compute only, 12 micro-batches. pp=1: 4 and 8 -> 8 c each.
    # pp=4: (m + 3) * t / 4: the satellite's bubble is 3 * 2/4 = 1.5 c against the healthy replica's 0.75 c:
    # 3 and 9 -> (3 + 3) * 2/4 = 3 c and (9 + 3) / 4 = 3 c; pp=1's 4 and 8 would leave the satellite at 3.5 c.
    # Uniform pp=4: 6 each, (6 + 3) / 4 = 2.25 c.
    assert cm.plan_step(MODEL_ONLY, 2, (1, 0), 12, "ntp balanced").shares == (4, 8)
    assert cm.plan_step(MODEL_ONLY, 2, (1, 0), 12, "ntp balanced", pp=4).shares == (3, 9)
    assert cm.plan_step(MODEL_ONLY, 2, (1, 0), 12, "ntp balanced", pp=4, fluid=True).shares == pytest.approx((3, 9))
    assert cm.predict_retained(MODEL_ONLY, 2, (1, 0), 12, "ntp balanced", pp=4) == pytest.approx(2.25 / 3)
    retained = cm.predict_retained(MODEL_ONLY, 2, (1, 0), 12, "ntp balanced", pp=4, shares=(4, 8))
    assert retained == pytest.approx(2.25 / 3.5)
    # shrink: DP=4 x TP=8, 24 each, replica 0 at TP=7. pp=1: 21 fit in 24 c; pp=2: a healthy replica takes
    # (24 + 1) / 2 = 12.5 c, the satellite (x + 1) * 8/7 / 2 <= 12.5 -> x = 20.
    assert cm.plan_step(MODEL_ONLY, 8, (1, 0, 0, 0), 96, "ntp shrink").shares == (21, 24, 24, 24)
    shrink = cm.plan_step(MODEL_ONLY, 8, (1, 0, 0, 0), 96, "ntp shrink", pp=2)
    assert shrink.shares == (20, 24, 24, 24) and shrink.batch_fraction == pytest.approx(92 / 96)


def test_dropping_a_replica_removes_its_pp_x_tp_gpus():
    # DP=4 x PP=2 x TP=2 (16 GPUs), one GPU lost in replica 0's stage 1: every stage of replica 0 is degraded.
    # Dropping it leaves 3 x 2 x 2 = 12 GPUs; 12 micro-batches: 4 each in (4 + 1) / 2 = 2.5 c against the
    # uniform 3 each in (3 + 1) / 2 = 2 c: 0.8 (a larger share pays the same bubble: above the 3/4 of GPUs).
    per_stage = ((0, 1), (0, 0), (0, 0), (0, 0))
    drop = cm.plan_step(MODEL_ONLY, 2, per_stage, 12, "drop", pp=2)
    assert (drop.gpus, cm.uniform_plan(MODEL_ONLY, 4, 2, 12, pp=2).gpus) == (12, 16)
    assert drop.replicas == (1, 2, 3) and drop.dropped == 1
    assert cm.predict_retained(MODEL_ONLY, 2, per_stage, 12, "drop", pp=2) == pytest.approx(0.8)
    assert cm.plan_step(MODEL_ONLY, 2, (1, 0, 0, 0), 12, "drop", pp=2) == drop  # a replica's loss: its worst stage's
    # kept as a satellite, every stage of it runs at TP=1 (parity: the degree is the worst stage's)
    ntp = cm.plan_step(MODEL_ONLY, 2, per_stage, 12, "ntp balanced", pp=2)
    assert ntp.degrees == (1, 2, 2, 2) and ntp.gpus == 2 * (1 + 2 + 2 + 2)
    # replica 0 lost both GPUs of stage 0: dead, gone in every plan
    dead = ((2, 0), (0, 0), (0, 0), (0, 0))
    for mode in cm.MODES:
        assert cm.predict_retained(MODEL_ONLY, 2, dead, 12, mode, pp=2) == pytest.approx(0.8)
    # the large-job row: the ideal counts all DP x PP x TP GPUs; the verdict names the stages
    rows = cm.large_job_table(MODEL_ONLY, 4, 2, 1, 12, pp=2)
    assert (rows[0]["pp"], rows[0]["ideal"], rows[0]["drop"]) == (2, 15 / 16, pytest.approx(0.8))
    assert cm.verdict(rows)[1].startswith("  4x2 PP=2 k=1 spread: drops:")


def test_place_failures_over_pipeline_stages():
    # 5 failures over DP=4 x PP=2 x TP=2: spread deals 2, 1, 1, 1 to the replicas, each replica's to its
    # stages in turn: the worst stage lost 1 everywhere; packed fills replica 0's stage 0 (dead), stage 1, then
    # replica 1's stage 0.
    assert cm.place_failures(4, 2, 5, "spread", pp=2) == (1, 1, 1, 1)
    assert cm.place_failures(4, 2, 5, "packed", pp=2) == (2, 1, 0, 0)
    with pytest.raises(ValueError, match="0..dp\\*pp\\*tp = 64"):
        cm.place_failures(4, 8, 65, "spread", pp=2)


@pytest.mark.parametrize("pp", [0, -1, 1.5, True, "2", None])
def test_a_bad_pp_is_refused_by_name(pp):
    calls = [
        lambda: cm.plan_step(MODEL_ONLY, 2, (1, 0), 4, "ntp balanced", pp=pp),
        lambda: cm.best_plan(MODEL_ONLY, 2, (1, 0), 4, pp=pp),
        lambda: cm.uniform_plan(MODEL_ONLY, 2, 2, 4, pp=pp),
        lambda: cm.predict_retained(MODEL_ONLY, 2, (1, 0), 4, pp=pp),
        lambda: cm.large_job_table(MODEL_ONLY, 2, 2, 1, 4, pp=pp),
        lambda: cm.place_failures(2, 2, 1, "spread", pp=pp),
        lambda: cm.reduced_degree(2, (1, 0), pp=pp),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="pp must be an int >= 1 \\(pipeline stages per replica\\)"):
            call()
    # per-stage losses must list every stage
    with pytest.raises(ValueError, match="failed must list"):
        cm.plan_step(MODEL_ONLY, 2, ((0, 1, 0), (0, 0)), 4, "drop", pp=2)


# ---- the cost model: the tables ----------------------------------------------------------------
@pytest.mark.parametrize(
    "costs",
    [
        MODEL_ONLY,
        cm.StepCosts(microbatch_s=1.0, sync_s=2.0, optimizer_s=0.5, other_s=0.3, grad_transfer_s=0.2),
        # transfers longer than a step's compute, a slow degraded replica: keeping it never pays
        cm.StepCosts(microbatch_s=1.0, grad_transfer_s=20.0, param_transfer_s=20.0, degraded_efficiency=0.5),
    ],
)
def test_ntp_policy_is_never_below_drop_in_any_row(costs):
    for dp, tp in bench._model_jobs(bench.MODEL_JOBS):
        rows = cm.large_job_table(costs, dp, tp, 8, 24 * dp)
        assert len(rows) == 16
        for row in rows:
            assert row["ntp policy"] >= row["drop"], row
            assert row["ntp policy fluid"] >= row["drop fluid"], row
            assert row["granularity_ntp"] == pytest.approx(row["ntp policy fluid"] - row["ntp policy"])
        assert cm.verdict(rows)[0].startswith("NTP policy >= drop in 16 of 16 rows (same global batch)")
    if costs.grad_transfer_s >= 20:
        failed = cm.place_failures(64, 8, 1, "spread")
        assert cm.best_plan(costs, 8, failed, 24 * 64).choice == "drop"


def test_scale_up_rows_and_the_issue_s_targets_with_compute_only():
    # DP=64 x TP=8 and scale-up domains of 32 and 64 GPUs per replica (512 GPUs each), 24 samples per replica
    assert bench._model_jobs(bench.MODEL_JOBS) == [(64, 8), (16, 32), (8, 64)]
    for dp, tp in ((64, 8), (16, 32), (8, 64)):
        rows = cm.large_job_table(MODEL_ONLY, dp, tp, 8, 24 * dp)
        k1 = rows[0]
        assert (k1["k"], k1["placement"], k1["tp_reduced"]) == (1, "spread", tp - 1)
        for row in rows:  # fluid shares: within 1% of the ideal
            assert row["ntp policy fluid"] >= row["ideal"] - 0.01, row
    # TP 8 -> 7, k=1: fluid 511/512 >= 98.5%; integer shares tie with drop at 24/25 (one more sample on a
    # healthy replica: granularity costs up to 1/24); shrinking the batch avoids it: 1533/1536
    k1 = cm.large_job_table(MODEL_ONLY, 64, 8, 1, 24 * 64)[0]
    assert k1["ntp policy fluid"] == pytest.approx(511 / 512)
    assert k1["ntp policy"] == pytest.approx(24 / 25) and k1["drop"] == pytest.approx(24 / 25)
    assert k1["granularity_drop"] == pytest.approx(63 / 64 - 24 / 25)
    assert k1["ntp shrink"] == pytest.approx(1533 / 1536) and k1["shrink_batch"] == pytest.approx(1533 / 1536)


def test_verdict_says_what_the_policy_does_and_why_it_drops():
    # DP=4 x TP=2, 24 micro-batches, compute only. k=1: NTP 3, 7, 7, 7 -> 7 c (6/7), drop 8 each (6/8).
    # k=2 spread: NTP 4, 4, 8, 8 (6/8), drop 12 each (1/2). k=2 packed: replica 0 is gone: equal.
    rows = cm.large_job_table(MODEL_ONLY, 4, 2, 2, 24)
    assert [(r["k"], r["placement"]) for r in rows] == [(1, "spread"), (1, "packed"), (2, "spread"), (2, "packed")]
    assert [r["ntp policy"] for r in rows] == pytest.approx([6 / 7, 6 / 7, 6 / 8, 6 / 8])
    assert [r["drop"] for r in rows] == pytest.approx([6 / 8, 6 / 8, 6 / 12, 6 / 8])
    lines = cm.verdict(rows)
    assert lines[0].startswith(
        "NTP policy >= drop in 4 of 4 rows (same global batch): it keeps degraded replicas in 3, runs every "
        "replica at TP r in 0, drops them in 1; above drop in 3 rows"
    )
    assert lines[1:] == ["  4x2 k=2 packed: the failures take out whole replicas: nothing to keep (75.00%)"]
    # DP=64 x TP=8, 16 per replica: k=1 ties (one extra micro-batch either way): the line says why
    rows = cm.large_job_table(MODEL_ONLY, 64, 8, 1, 1024)
    spread = cm.verdict(rows)[1]
    assert spread.startswith(
        "  64x8 k=1 spread: drops: balanced NTP 94.12% (slowest replica 17 micro-batch times) vs drop 94.12% (17): "
        "integer shares; fluid NTP 99.80% vs drop 98.44%"
    )


def test_cost_model_inputs_are_validated():
    with pytest.raises(ValueError, match="microbatch_s must be a finite number > 0"):
        cm.StepCosts(microbatch_s=0.0)
    with pytest.raises(ValueError, match="grad_transfer_s must be a finite number >= 0"):
        cm.StepCosts(microbatch_s=1.0, grad_transfer_s=-1.0)
    with pytest.raises(ValueError, match="sync_replicas must be an int >= 2"):
        cm.StepCosts(microbatch_s=1.0, sync_replicas=1)
    with pytest.raises(ValueError, match="each replica needs at least one"):
        cm.predict_retained(MODEL_ONLY, 2, (1, 0, 0, 0), 3, "ntp balanced")
    with pytest.raises(ValueError, match="mode must be one of"):
        cm.predict_retained(MODEL_ONLY, 2, (1, 0), 4, "fold")
    with pytest.raises(ValueError, match="shares must list 2 numbers >= 0"):
        cm.predict_retained(MODEL_ONLY, 2, (1, 0), 4, "ntp balanced", shares=(1, 2))
    with pytest.raises(ValueError, match="keep must be an int in 0..1"):
        cm.plan_step(MODEL_ONLY, 2, (1, 0), 4, "ntp balanced", keep=2)
    with pytest.raises(ValueError, match="'ntp policy' chooses its shares"):
        cm.plan_step(MODEL_ONLY, 2, (1, 0), 4, "ntp policy", keep=1)
    with pytest.raises(ValueError, match="failed must list"):
        cm.plan_step(MODEL_ONLY, 2, (3, 0), 4, "drop")


# ---- flags -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--spares", "2"], "--spares must be in 1..1"),
        (["--global-batch", "10"], "--global-batch 10 must be a multiple of --micro-batch x 2 replicas = 4"),
        (["--heads", "6", "--hidden", "48", "--tp-base", "4", "--spares", "1"], "--heads 6 must be divisible"),
        (["--replicas", "1"], "--replicas must be >= 2"),
        (["--global-batch", "4"], "--global-batch 4 / --micro-batch 2: NonuniformTPConfig.balance='tp'"),
        (["--model-jobs", "64x8,16"], "argument --model-jobs: expected DPxTP entries"),
        (["--model-max-shrink", "1.5"], "argument --model-max-shrink: expected a number in [0, 1)"),
        (["--model-jobs", "2x2", "--model-failed", "5"], "--model-failed 5 is more than the 4 GPUs"),
        (["--model-jobs", "2x2", "--model-failed", "9", "--pp", "2"], "--model-failed 9 is more than the 8 GPUs"),
        (["--pp", "0"], "argument --pp: expected an int >= 1, got 0"),
        (["--model-micro-batch", "4"], "--model-micro-batch 4 must divide this run's samples per replica"),
        (["--model-divides", "64,x"], "argument --model-divides: expected ints >= 1"),
    ],
)
def test_bad_flags_are_refused_at_parse_time(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--backend", "gloo"] + argv)
    assert message in capsys.readouterr().err
