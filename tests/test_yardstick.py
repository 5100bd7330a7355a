"""The yardstick: Pareto frontiers, interpolation against hand-computed points, the judged
figures, refusals on ranges too thin to tell policies apart, and the oracle as a bound."""

import math

import numpy as np
import pytest

from apex_bdq import yardstick as ys
from apex_bdq.config import SimConfig, TraceConfig
from apex_bdq.evaluation import evaluate_policy
from apex_bdq.sim.baselines import HPA, Oracle, Predictive


def pt(v, c, s=None, se=0.0):
    return {"setting": s, "slo_violation_rate": v, "cost": c, "slo_violation_rate_se": se}


RULE = [pt(0.01, 3.0, 1), pt(0.04, 2.0, 2), pt(0.05, 2.2, 3), pt(0.16, 1.5, 4)]
ORACLE = [pt(0.001, 1.0), pt(0.1, 0.8)]


def test_pareto_drops_dominated_points_and_orders_by_violation():
    front = ys.pareto(RULE + [pt(0.04, 2.4, 5)])
    assert [p["setting"] for p in front] == [1, 2, 4]  # (0.05, 2.2) and (0.04, 2.4) are dominated


def test_first_target_judges_the_gap_and_the_saving_only_where_the_headroom_is():
    m = {"cost": 2.0, "slo_violation_rate": 0.02, "refused_share": 0.0, "slo_windows": 10_000}
    j = ys.judge(m, {"rule": RULE}, ORACLE)  # saving 20 %, headroom 1 - c_or / 2.5 ~ 65 %, gap ~ 31 %
    gap_line, saving_line = ys.first_target(j)
    assert "gap closed: not met (31 %)" in gap_line
    assert "headroom 65 % >= 20 %): met (+20.0 %)" in saving_line
    assert "not met" in ys.first_target(j, saving_target=0.25)[1]
    assert "gap closed: met" in ys.first_target(j, gap_target=0.3)[0]
    # Where the oracle has less room than 20 %, the saving target does not apply.
    near = ys.judge(m, {"rule": RULE}, [pt(0.001, 2.4), pt(0.1, 2.3)])
    assert "does not apply (headroom" in ys.first_target(near)[1]
    out = ys.judge({**m, "slo_violation_rate": 0.5}, {"rule": RULE}, ORACLE)
    assert ys.first_target(out) == [ys.first_target(out)[0]] and "not judged" in ys.first_target(out)[0]


def test_interpolation_is_linear_in_log_violation_between_frontier_points():
    front = ys.pareto(RULE)
    assert ys.cost_at(front, 0.02) == pytest.approx(2.5)  # halfway between 0.01 and 0.04 in log v
    assert ys.cost_at(front, 0.08) == pytest.approx(1.75)
    assert ys.cost_at(front, 0.04) == pytest.approx(2.0)
    assert ys.cost_at(front, 0.005) is None and ys.cost_at(front, 0.2) is None  # never extrapolated
    assert ys.violation_at(front, 2.5) == pytest.approx(0.02)
    assert ys.violation_at(front, 1.75) == pytest.approx(0.08)
    assert ys.violation_at(front, 3.5) is None


def test_judge_gives_saving_ratio_and_oracle_gap_by_hand():
    m = {"cost": 2.0, "slo_violation_rate": 0.02, "refused_share": 0.001, "slo_windows": 10_000}
    j = ys.judge(m, {"rule": RULE}, ORACLE)
    assert j["cost_saving_vs_best_rule"] == pytest.approx(0.2)  # 1 - 2.0 / 2.5
    assert j["violation_ratio_vs_best_rule"] == pytest.approx(0.5)  # 0.02 / 0.04
    c_or = 1.0 + (0.8 - 1.0) * math.log(20) / math.log(100)
    assert j["oracle_cost"] == pytest.approx(c_or)
    assert j["oracle_gap_closed"] == pytest.approx((2.5 - 2.0) / (2.5 - c_or))
    assert j["refused_share"] == 0.001 and j["best_rule_at_violation_rate"] == "rule"
    # The best of several rules is the cheapest at the policy's violation rate.
    cheaper = [pt(0.015, 2.2), pt(0.03, 1.9)]
    j2 = ys.judge(m, {"rule": RULE, "cheaper": cheaper}, ORACLE)
    assert j2["best_rule_at_violation_rate"] == "cheaper" and j2["cost_saving_vs_best_rule"] < 0.2
    # Against each rule's own frontier too: the best rule's figures are the headline ones.
    assert j2["vs_rules"]["rule"]["cost_saving"] == pytest.approx(0.2)
    assert j2["vs_rules"]["rule"]["violation_ratio"] == pytest.approx(0.5)
    assert j2["vs_rules"]["cheaper"]["cost_saving"] == pytest.approx(j2["cost_saving_vs_best_rule"])
    # Outside every sweep: no saving figure rather than an extrapolated one.
    out = ys.judge({**m, "slo_violation_rate": 0.5}, {"rule": RULE}, ORACLE)
    assert out["cost_saving_vs_best_rule"] is None and out["oracle_gap_closed"] is None


def test_comparisons_with_too_few_windows_or_alike_settings_are_refused():
    with pytest.raises(ys.YardstickError, match="at least 2,000 are needed"):
        ys.check_resolution({"rule": RULE}, 500)
    alike = [pt(0.0, 3.0, se=0.0), pt(0.0, 2.0, se=0.0)]
    noisy = [pt(0.01, 3.0, se=0.02), pt(0.02, 2.0, se=0.02)]
    with pytest.raises(ys.YardstickError, match="every setting looks alike"):
        ys.check_resolution({"a": alike, "b": noisy}, 50_000)
    ys.check_resolution({"rule": RULE, "a": alike}, 50_000)  # one rule that separates is enough


def test_the_frontier_cache_knows_a_trace_by_its_content_not_its_path_or_mtime(daily_trace, tmp_path):
    """A trace copied elsewhere, or checked out again (a new mtime), keys the same frontiers;
    changed bytes or another layout key new ones."""
    import os
    import shutil

    def key(path, shards=4):
        cfg = SimConfig(trace=TraceConfig(path=str(path), columns=("requests",), smooth_s=0.0))
        return ys._key(cfg, shards, 1, 12345, "eval", None)

    a = daily_trace(days=2, name="a.csv")
    (tmp_path / "elsewhere").mkdir()
    b = shutil.copy(a, tmp_path / "elsewhere" / "b.csv")
    os.utime(b, ns=(1_000_000_000, 1_000_000_000))
    assert key(a) == key(b)
    other = daily_trace(days=2, name="c.csv", seed=1)
    assert key(other) != key(a)
    assert key(a, shards=8) != key(a)
    # the validation days' share moves the validation range, not the held-out one
    vf = SimConfig(trace=TraceConfig(path=str(a), columns=("requests",), smooth_s=0.0, validation_fraction=0.3))
    assert ys._key(vf, 4, 1, 12345, "eval", None) == key(a)
    assert ys._key(vf, 4, 1, 12345, "val", None) != ys._key(vf.replace(trace=TraceConfig(
        path=str(a), columns=("requests",), smooth_s=0.0)), 4, 1, 12345, "val", None)
    shutil.copy(other, b)  # the same path, new bytes
    assert key(b) != key(a)


@pytest.mark.slow
def test_the_oracle_is_never_worse_than_every_rule_at_its_own_violation_rate(daily_trace):
    """On a test trace (two days, a daily cycle and bursts), the oracle's frontier lies below
    every rule's wherever both are defined, and its default point beats the best rule."""
    cfg = SimConfig(trace=TraceConfig(path=str(daily_trace(days=2)), columns=("requests",), smooth_s=0.0))
    fronts = {r: ys.sweep(r, cfg, vals, shards=16, replicas=1) for r, (_, vals) in
              (("hpa", ys.SWEEPS_V2["hpa"]), ("predictive", ys.SWEEPS_V2["predictive"]))}
    oracle = ys.sweep("oracle", cfg, ys.ORACLE_SWEEP[1], shards=16, replicas=1)
    windows = oracle[0]["slo_windows"]
    assert windows >= ys.MIN_WINDOWS
    ys.check_resolution(fronts, windows)
    for p in ys.pareto(oracle):
        rule, c = ys.best_rule_cost(fronts, p["slo_violation_rate"], 0.5 / windows)
        if c is not None:
            assert p["cost"] <= c, (p, rule, c)
    m = evaluate_policy(Oracle(), cfg, shards=16, replicas=1).metrics
    j = ys.judge(m, fronts, oracle)
    assert j["cost_saving_vs_best_rule"] > 0 and j["oracle_gap_closed"] == pytest.approx(1.0)
    # A rule's default point is on its own frontier: no saving against itself.
    h = evaluate_policy(HPA(), cfg, shards=16, replicas=1).metrics
    assert ys.judge(h, {"hpa": fronts["hpa"]}, oracle)["cost_saving_vs_best_rule"] == pytest.approx(0.0, abs=1e-9)
    # Every setting of a sweep met the same arrivals as a single run of that setting.
    p = evaluate_policy(Predictive(margin=1.2), cfg, shards=16, replicas=1).metrics
    assert p["cost"] == pytest.approx(fronts["predictive"][2]["cost"])
    assert p["slo_violation_rate"] == fronts["predictive"][2]["slo_violation_rate"]


def test_the_oracle_without_its_privileges_sizes_for_the_lagged_held_true_rate():
    """lead_s=0, lag_s and hold_s: the replicas of margin x the highest true rate of
    [t - lag - hold, t - lag]; the default still sizes for the next provisioning delay.
    (Seconds are ticks here: tick_s is 1 s.)"""
    from apex_bdq.sim import make_sim
    from apex_bdq.sizing import replicas_for
    sim = make_sim(SimConfig(num_shards=3, seed=2))
    sim.reset(seed=2)
    lam = sim.lam_table.astype(float)
    weak, full = Oracle(margin=1.1, lead_s=0, lag_s=15, hold_s=120), Oracle(margin=1.1)
    weak.reset(sim)
    full.reset(sim)
    for _ in range(200):
        _, cap = weak.act(sim, None)
        sim.step(full.act(sim, None)[0], capacity_target=cap)
    idx = sim.trace_index()
    held = [lam[max(i - 15 - 120, 0):i - 15 + 1].max(0) for i in idx]
    assert (weak.act(sim, None)[1] == replicas_for(1.1 * np.array(held), sim.sizing)).all()
    ahead = [lam[i:i + sim.L + 1].max(0) for i in idx]
    assert (full.act(sim, None)[1] == replicas_for(1.1 * np.array(ahead), sim.sizing)).all()
    for bad in ({"lag_s": -1.0}, {"hold_s": float("nan")}, {"lead_s": "60"}, {"lag_s": None}, {"hold_s": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Oracle(**bad)


@pytest.mark.slow
def test_evaluate_ladder_splits_the_oracles_room(daily_trace, tmp_path, monkeypatch, capsys):
    """`launch.evaluate --ladder` on a test trace: four rungs in the JSON; the first rung is
    the oracle of the frontiers (same points on the same arrivals), and taking its foresight
    away never makes it cheaper at the same violation rate."""
    import json

    from launch import evaluate
    monkeypatch.setenv("APEX_BDQ_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ladder.json"
    rc = evaluate.main(["--policy", "predictive", "--trace", str(daily_trace(days=2)), "--columns", "requests",
                        "--shards", "16", "--replicas", "1", "--ladder", "--json", str(out), "--quiet"])
    assert rc == 0
    res = json.loads(out.read_text())
    rungs = res["oracle_ladder"]
    frontier = {p["setting"]: p for p in res["oracle_frontier"]}
    for p in rungs[0]["points"]:
        if p["setting"] in frontier:
            assert p["cost"] == frontier[p["setting"]]["cost"]
            assert p["slo_violation_rate"] == frontier[p["setting"]]["slo_violation_rate"]
    assert [r["rung"] for r in rungs][:2] == ["oracle", "no foresight"] and len(rungs) == 4
    assert rungs[3]["options"] == {"lead_s": 0.0, "lag_s": 15.0, "hold_s": 300.0}
    defined = 0
    for full, blind in zip(rungs[0]["at"], rungs[1]["at"]):
        if full["gap_closed"] is not None:
            assert full["gap_closed"] == pytest.approx(1.0)
        if full["cost"] is not None and blind["cost"] is not None:
            assert blind["cost"] >= full["cost"]
            defined += 1
    assert defined >= 1
    with pytest.raises(SystemExit) as e:  # v1 has no oracle to take apart
        evaluate.main(["--platform", "v1", "--ladder", "--policy", "hpa"])
    assert e.value.code == 2 and "--ladder needs platform v2" in capsys.readouterr().err
