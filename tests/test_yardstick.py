"""The yardstick: Pareto frontiers, interpolation against hand-computed points, the judged
figures, refusals on ranges too thin to tell policies apart, and the oracle as a bound."""

import math

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


@pytest.mark.slow
def test_the_oracle_is_never_worse_than_every_rule_at_its_own_violation_rate(daily_trace):
    """On a test trace (two days, a daily cycle and bursts), the oracle's frontier lies below
    every rule's wherever both are defined, and its default point beats the best rule."""
    cfg = SimConfig(trace=TraceConfig(path=str(daily_trace(days=2)), columns=("requests",), smooth_s=0.0))
    fronts = {r: ys.sweep(r, cfg, vals, shards=4, replicas=1) for r, (_, vals) in
              (("hpa", ys.SWEEPS_V2["hpa"]), ("predictive", ys.SWEEPS_V2["predictive"]))}
    oracle = ys.sweep("oracle", cfg, ys.ORACLE_SWEEP[1], shards=4, replicas=1)
    windows = oracle[0]["slo_windows"]
    assert windows >= ys.MIN_WINDOWS
    ys.check_resolution(fronts, windows)
    for p in ys.pareto(oracle):
        rule, c = ys.best_rule_cost(fronts, p["slo_violation_rate"], 0.5 / windows)
        if c is not None:
            assert p["cost"] <= c, (p, rule, c)
    m = evaluate_policy(Oracle(), cfg, shards=4, replicas=1).metrics
    j = ys.judge(m, fronts, oracle)
    assert j["cost_saving_vs_best_rule"] > 0 and j["oracle_gap_closed"] == pytest.approx(1.0)
    # A rule's default point is on its own frontier: no saving against itself.
    h = evaluate_policy(HPA(), cfg, shards=4, replicas=1).metrics
    assert ys.judge(h, {"hpa": fronts["hpa"]}, oracle)["cost_saving_vs_best_rule"] == pytest.approx(0.0, abs=1e-9)
    # Every setting of a sweep met the same arrivals as a single run of that setting.
    p = evaluate_policy(Predictive(margin=1.2), cfg, shards=4, replicas=1).metrics
    assert p["cost"] == pytest.approx(fronts["predictive"][2]["cost"])
    assert p["slo_violation_rate"] == fronts["predictive"][2]["slo_violation_rate"]
