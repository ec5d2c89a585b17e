"""benchmarks/ntp.py: its four jobs run end to end on 4 gloo ranks and write every table to the JSON;
the large-job model against values derived by hand; the flags it refuses.

Model notation in the comments: c = one micro-batch's fwd+bwd on a healthy replica, a replica at TP=r
needs tp/r * c per micro-batch, the step is the slowest replica's compute (+ unfold + fold on healthy
NTP replicas) + DP collective + the rest (both x tp/r under NTP)."""

import json

import pytest

from benchmarks import ntp as bench  # spawned ranks unpickle its functions by this module name

MODEL_ONLY = bench.StepCosts(microbatch_s=1.0)  # compute only: perfect scaling, no overheads


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
    balanced = jobs["ntp balanced"]["kinds"]
    assert (balanced["healthy"]["ranks"], balanced["healthy"]["microbatches"]) == (2, 4)
    assert (balanced["degraded"]["ranks"], balanced["degraded"]["microbatches"]) == (1, 2)
    assert jobs["ntp balanced"]["healthy_overhead_pct"] > 0 and jobs["uniform"]["healthy_overhead_pct"] is None

    ranks = result["per_rank"]
    assert [len(ranks[job]) for job in ("uniform", "ntp", "drop")] == [4, 3, 2]  # slot 1 left the NTP job
    assert sorted((r["replica"], r["degraded"], r["healthy_ntp"]) for r in ranks["ntp"]) == [
        (0, True, False),
        (1, False, True),
        (1, False, True),
    ]
    for r in ranks["ntp"]:
        assert list(r["phases"]) == ["ntp unbalanced", "ntp balanced"]
        assert all(len(v) == 2 for phase in r["phases"].values() for v in phase["times"].values())
    assert set(result["memory"]) == {
        "uniform DDP, all ranks",
        "NTP healthy core",
        "NTP healthy spare",
        "NTP degraded replica",
    }

    model = result["model"]
    assert [c["job"] for c in model["check"]] == ["ntp balanced", "ntp unbalanced", "drop"]
    assert model["costs"]["microbatches_per_replica"] == 3
    rows = model["large_job"]["rows"]
    assert [(r["k"], r["placement"]) for r in rows] == [(k, p) for k in (1, 2, 3) for p in ("spread", "packed")]
    assert (model["large_job"]["dp"], model["large_job"]["tp"]) == (64, 8)
    assert model["large_job"]["verdict"][0].startswith("balanced NTP beats dropping")
    assert len(result["targets"]) == 3
    assert result["provenance"]["command"].startswith("python benchmarks/ntp.py --backend gloo")


# ---- the large-job model -----------------------------------------------------------------------
def test_no_failed_gpu_retains_the_whole_throughput():
    costs = bench.StepCosts(microbatch_s=1.0, sync_s=0.3, other_s=0.2, ntp_overhead_s=0.4)
    for mode in bench.MODES:
        assert bench.predict_retained(costs, 4, 8, (0, 0, 0, 0), 32, mode) == 1.0


def test_balanced_ntp_with_perfect_scaling_retains_the_surviving_gpus():
    # DP=2 x TP=8, one GPU lost: shares 7:8 of 30 micro-batches = 14 and 16; the TP=7 replica needs
    # 14 * 8/7 = 16 c, the healthy one 16 c; uniform 15 c: 15/16 = (16 - 1) / 16 GPUs.
    assert bench.predict_retained(MODEL_ONLY, 2, 8, (1, 0), 30, "ntp balanced") == pytest.approx(15 / 16)
    # DP=4 x TP=2, one replica at TP=1: 28 micro-batches split 4, 8, 8, 8 -> 8 c (4 * 2 c for TP=1); uniform 7 c
    assert bench.predict_retained(MODEL_ONLY, 4, 2, (1, 0, 0, 0), 28, "ntp balanced") == pytest.approx(7 / 8)
    # two replicas at TP=1: 24 split 4, 4, 8, 8 -> 8 c; uniform 6 c: 6/8 GPUs
    assert bench.predict_retained(MODEL_ONLY, 4, 2, (1, 1, 0, 0), 24, "ntp balanced") == pytest.approx(6 / 8)
    # with equal shares the TP=1 replica needs 7 * 2 c: every replica waits for it
    assert bench.predict_retained(MODEL_ONLY, 4, 2, (1, 0, 0, 0), 28, "ntp unbalanced") == pytest.approx(1 / 2)


def test_dropping_k_replicas_retains_the_others():
    # 12 micro-batches: 3 per replica of 4; 4 per replica of 3 -> 3/4; 6 per replica of 2 -> 1/2
    assert bench.predict_retained(MODEL_ONLY, 4, 2, (1, 0, 0, 0), 12, "drop") == pytest.approx(3 / 4)
    assert bench.predict_retained(MODEL_ONLY, 4, 2, (1, 1, 0, 0), 12, "drop") == pytest.approx(2 / 4)


def test_micro_batch_granularity_costs_balanced_shares_a_computable_amount():
    # DP=2 x TP=2, 4 micro-batches, replica 0 at TP=1: the best integer split is 1:3 -> max(1 * 2 c, 3 c)
    # = 3 c against 2 c uniform: 2/3, not the 3/4 of the GPUs; fluid shares 4/3 : 8/3 reach 3/4.
    assert bench.predict_retained(MODEL_ONLY, 2, 2, (1, 0), 4, "ntp balanced") == pytest.approx(2 / 3)
    assert bench.predict_retained(MODEL_ONLY, 2, 2, (1, 0), 4, "ntp balanced", fluid=True) == pytest.approx(3 / 4)
    # DP=64 x TP=8, 16 micro-batches per replica (1024), one GPU lost: the TP=7 replica takes at most 14
    # (15 * 8/7 > 17), so 1010 go to 63 healthy replicas, some get 17 -> 16/17. Dropping it: 1024 over 63,
    # some get 17 -> 16/17 as well: at this granularity both keep one extra micro-batch on a replica.
    failed = bench.place_failures(64, 8, 1, "spread")
    assert bench.predict_retained(MODEL_ONLY, 64, 8, failed, 1024, "ntp balanced") == pytest.approx(16 / 17)
    assert bench.predict_retained(MODEL_ONLY, 64, 8, failed, 1024, "drop") == pytest.approx(16 / 17)


def test_ntp_overheads_and_the_reduced_layout_lengthen_the_step():
    costs = bench.StepCosts(microbatch_s=1.0, sync_s=1.0, sync_replicas=2, other_s=0.5, ntp_overhead_s=0.5)
    # uniform: 3 c + 1 + 0.5 = 4.5. Balanced NTP (2:4): TP=1 replica 2 * 2 = 4, healthy 4 + 0.5 unfold/fold;
    # collective and rest over the TP=1 layout: (1 + 0.5) * 2 = 3 -> 7.5: 4.5 / 7.5 = 0.6.
    assert bench.predict_retained(costs, 2, 2, (1, 0), 6, "ntp balanced") == pytest.approx(0.6)
    # drop: one replica, 6 c, no DP collective (ring factor 2(n-1)/n = 0 at n = 1), rest 0.5 -> 4.5 / 6.5
    assert bench.predict_retained(costs, 2, 2, (1, 0), 6, "drop") == pytest.approx(4.5 / 6.5)
    # the collective scales as a ring all-reduce: measured 1.0 at DP=4 (factor 3/2), DP=3 (factor 4/3):
    # uniform 3 + 1 = 4, drop 4 + 8/9 -> 9/11
    ring = bench.StepCosts(microbatch_s=1.0, sync_s=1.0, sync_replicas=4)
    assert bench.predict_retained(ring, 4, 2, (1, 0, 0, 0), 12, "drop") == pytest.approx(9 / 11)


def test_degraded_efficiency_scales_the_degraded_compute():
    # equal shares of 6: the TP=1 replica needs 3 * 2 c / 1.25 = 4.8 c against 3 c
    costs = bench.StepCosts(microbatch_s=1.0, degraded_efficiency=1.25)
    assert bench.predict_retained(costs, 2, 2, (1, 0), 6, "ntp unbalanced") == pytest.approx(3 / 4.8)


def test_spare_parity_and_replicas_that_lost_every_gpu():
    # TP=4: replicas lose 2 and 1 GPUs; both run at TP=2 (parity). 12 micro-batches split 2, 2, 4, 4 ->
    # 2 * 4/2 = 4 c everywhere; uniform 3 c: 3/4, below the 13/16 of the GPUs.
    assert bench.predict_retained(MODEL_ONLY, 4, 4, (2, 1, 0, 0), 12, "ntp balanced") == pytest.approx(3 / 4)
    # TP=2, both GPUs of replica 0 lost: it is gone under NTP too; 12 over 3 replicas -> 3/4 for every mode
    failed = bench.place_failures(4, 2, 2, "packed")
    assert failed == (2, 0, 0, 0)
    for mode in bench.MODES:
        assert bench.predict_retained(MODEL_ONLY, 4, 2, failed, 12, mode) == pytest.approx(3 / 4)


def test_place_failures():
    assert bench.place_failures(4, 2, 3, "spread") == (1, 1, 1, 0)
    assert bench.place_failures(4, 8, 5, "spread") == (2, 1, 1, 1)
    assert bench.place_failures(4, 8, 10, "packed") == (8, 2, 0, 0)
    with pytest.raises(ValueError, match="placement must be one of"):
        bench.place_failures(4, 8, 1, "random")
    with pytest.raises(ValueError, match="0..dp\\*tp = 32"):
        bench.place_failures(4, 8, 33, "spread")


def test_verdict_names_the_rows_where_balanced_ntp_does_not_win_and_why():
    # DP=4 x TP=2, 24 micro-batches, compute only. k=1: NTP 3, 7, 7, 7 -> 7 c (6/7), drop 8 each (6/8).
    # k=2 spread: NTP 4, 4, 8, 8 (6/8), drop 12 each (1/2). k=2 packed: replica 0 is gone: equal.
    rows = bench.large_job_table(MODEL_ONLY, 4, 2, 2, 24)
    assert [(r["k"], r["placement"]) for r in rows] == [(1, "spread"), (1, "packed"), (2, "spread"), (2, "packed")]
    assert [r["ntp balanced"] for r in rows] == pytest.approx([6 / 7, 6 / 7, 6 / 8, 6 / 8])
    assert [r["drop"] for r in rows] == pytest.approx([6 / 8, 6 / 8, 6 / 12, 6 / 8])
    lines = bench.verdict(MODEL_ONLY, 4, 2, 24, rows)
    assert lines[0] == "balanced NTP beats dropping in 3 of 4 rows; not in:"
    assert lines[1:] == ["  k=2 packed: equal (75.00%): the failures take out whole replicas, NTP has none to keep"]
    # DP=64 x TP=8, 16 per replica: k=1 ties (one extra micro-batch either way, see above); the line says so
    rows = bench.large_job_table(MODEL_ONLY, 64, 8, 1, 1024)
    (spread, *_) = bench.verdict(MODEL_ONLY, 64, 8, 1024, rows)[1:]
    assert spread.startswith("  k=1 spread: balanced NTP 94.12% <= drop 94.12%")
    assert "computes 17 healthy micro-batch times under NTP (17 micro-batches at TP=8) and 17 under drop" in spread
    # every row won (k=1 only, DP=4 x TP=2): one line says so
    rows = bench.large_job_table(MODEL_ONLY, 4, 2, 1, 24)
    assert bench.verdict(MODEL_ONLY, 4, 2, 24, rows) == [
        "balanced NTP beats dropping the affected replicas in every row (2)"
    ]


def test_step_costs_are_validated():
    with pytest.raises(ValueError, match="microbatch_s must be a finite number > 0"):
        bench.StepCosts(microbatch_s=0.0)
    with pytest.raises(ValueError, match="sync_replicas must be an int >= 2"):
        bench.StepCosts(microbatch_s=1.0, sync_replicas=1)
    with pytest.raises(ValueError, match="each replica needs at least one"):
        bench.predict_retained(MODEL_ONLY, 4, 2, (1, 0, 0, 0), 3, "ntp balanced")


# ---- flags -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--spares", "2"], "--spares must be in 1..1"),
        (["--global-batch", "10"], "--global-batch 10 must be a multiple of --micro-batch x 2 replicas = 4"),
        (["--heads", "6", "--hidden", "48", "--tp-base", "4", "--spares", "1"], "--heads 6 must be divisible"),
        (["--replicas", "1"], "--replicas must be >= 2"),
        (["--global-batch", "4"], "--global-batch 4 / --micro-batch 2: NonuniformTPConfig.balance='tp'"),
    ],
)
def test_bad_flags_are_refused_at_parse_time(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--backend", "gloo"] + argv)
    assert message in capsys.readouterr().err
