"""Baseline rules behave as their documentation says, on the real simulator.

Platform v1 (one shared pool; kept so that checkpoints trained on it still evaluate):
`SimConfig` here is v1's. Platform v2 has its own tests (test_platform_v2.py, test_yardstick.py).
"""

import math

import numpy as np
import pytest

import functools

from apex_bdq.config import ConfigError, TraceConfig
from apex_bdq.config import SimConfig as _SimConfig
from apex_bdq.evaluation import evaluate_policy
from apex_bdq.sim.baselines import HPA, QueueThreshold, RandomPolicy, StaticPeak, TargetTracking, make_baseline
from apex_bdq.sim.platform import PlatformSim

SimConfig = functools.partial(_SimConfig, platform="v1")


def steady_sim(step_trace, rate=(200.0, 4.0, 1.0, 0.04), high=None, at=10 ** 9, **kw):
    """One shard on a synthetic 1 s trace whose evaluation range starts at tick 3000.

    Rates are normalised so that the training range [0, 3000) averages mean_load_erlangs;
    a step inside the evaluation range scales the load by high/low."""
    path = step_trace(low=rate, high=high, at=at, n=6000)
    cfg = SimConfig(num_shards=1, provisioning_delay_s=0.0, trace=TraceConfig(
        path=str(path), columns=("c0", "c1", "c2", "c3"), poisson_noise=False, eval_fraction=0.5), **kw)
    return PlatformSim(cfg, split="eval")


def run(policy, sim, ticks):
    obs = sim.reset(seed=0)
    policy.reset(sim)
    caps = []
    for _ in range(ticks):
        a, cap = policy.act(sim, obs)
        obs, _, _, info = sim.step(a, capacity_target=cap)
        caps.append(int(sim.target[0, 0]))
    return caps, info


def test_hpa_converges_to_the_target_utilisation(step_trace):
    sim = steady_sim(step_trace)
    caps, info = run(HPA(target_utilisation=0.5), sim, 900)
    offered = float(info["offered_erlangs"][0])
    # Settles where util is within the 10 % tolerance of the 50 % target.
    assert abs(offered / caps[-1] / 0.5 - 1) <= 0.1 + 1e-6
    assert len(set(caps[-100:])) == 1  # and stays there


def test_hpa_scale_up_limit_and_scale_down_stabilisation(step_trace):
    low, high = (20.0, 0.4, 0.1, 0.004), (400.0, 8.0, 2.0, 0.08)
    sim = steady_sim(step_trace, rate=low, high=high, at=3000 + 60, mean_load_erlangs=10.0)
    hpa = HPA(target_utilisation=0.5)
    caps, _ = run(hpa, sim, 60)
    start = caps[-1]
    # Load jumps 20x: each 15 s period may at most add max(100 %, 4 pods).
    seen = []
    for t in range(60, 200):
        a, cap = hpa.act(sim, None)
        sim.step(a, capacity_target=cap)
        seen.append(int(sim.target[0, 0]))
    prev = start
    for i in range(0, len(seen), 15):
        assert seen[i] <= max(2 * prev, prev + 4)
        prev = seen[i]
    assert seen[-1] > 4 * start


def test_hpa_waits_out_the_downscale_window(step_trace):
    high, low = (400.0, 8.0, 2.0, 0.08), (40.0, 0.8, 0.2, 0.008)
    sim = steady_sim(step_trace, rate=high, high=low, at=3000 + 400)
    hpa = HPA(target_utilisation=0.5)
    caps, _ = run(hpa, sim, 400 + 30 + 270)  # the drop reaches metrics at ~415 s
    before = caps[399]
    assert min(caps[400:400 + 300]) == before  # 300 s stabilisation: no scale-down yet
    more = []
    for _ in range(120):
        a, cap = hpa.act(sim, None)
        sim.step(a, capacity_target=cap)
        more.append(int(sim.target[0, 0]))
    assert more[-1] < before / 2


def test_target_tracking_scales_out_fast_and_in_slowly(step_trace):
    low, high = (40.0, 0.8, 0.2, 0.008), (200.0, 4.0, 1.0, 0.04)
    sim = steady_sim(step_trace, rate=high, high=low, at=3000 + 60, mean_load_erlangs=20.0)
    tt = TargetTracking(target_utilisation=0.5)
    caps, _ = run(tt, sim, 1200)
    # Load falls 5x after a minute; scale-in needs 15 one-minute datapoints below target.
    assert min(caps[:15 * 60]) == caps[0]
    assert caps[-1] < caps[0] / 2
    sim = steady_sim(step_trace, rate=low, high=high, at=3000 + 600, mean_load_erlangs=20.0)
    caps, _ = run(TargetTracking(target_utilisation=0.5), sim, 1200)
    # Scale-out after three datapoints above target (+ the 15 s monitoring lag).
    out_at = next(i for i in range(600, len(caps)) if caps[i] > caps[599])
    assert out_at - 600 <= 4 * 60 + 15
    assert caps[-1] > 3 * caps[599]


def test_static_provisions_the_training_peak():
    sim = PlatformSim(SimConfig(num_shards=2), split="eval")
    pol = StaticPeak(target_utilisation=0.8)
    pol.reset(sim)
    lo, hi = sim.rates.train
    peak = (sim.lam_table[lo:hi] * sim.inv_mu).sum(1).max()
    assert pol.servers[0, 0] == min(sim.pool_max, math.ceil(peak / 0.8))


def test_queue_threshold_sheds_while_queues_are_long(step_trace):
    # Ten times the training load from the start of the evaluation range: beyond max_servers.
    sim = steady_sim(step_trace, rate=(200.0, 4.0, 1.0, 0.04), high=(2000.0, 40.0, 10.0, 0.4), at=3000)
    pol = QueueThreshold(threshold_slo=1.0)
    obs = sim.reset(seed=0)
    pol.reset(sim)
    levels = []
    for _ in range(30):
        a, cap = pol.act(sim, obs)
        levels.append(int(a[0, -2]))
        obs, _, _, info = sim.step(a, capacity_target=cap)
    assert levels[0] == 0 and max(levels) == sim.n - 2
    assert info["dropped"].sum() > 0


def test_rule_baselines_refuse_per_class_pools_and_unknown_names():
    sim = PlatformSim(SimConfig(num_shards=1, per_class_capacity=True))
    with pytest.raises(ValueError, match="per_class_capacity=True"):
        HPA().reset(sim)
    with pytest.raises(ValueError, match="unknown baseline 'nope'"):
        make_baseline("nope")
    r = RandomPolicy()
    r.reset(sim)
    a, cap = r.act(sim, None)
    assert a.shape == (1, 6) and cap is None


def test_evaluation_replicas_cover_the_range_again_with_their_own_arrivals():
    """`replicas` runs R copies of the evaluation phases in one simulator: with deterministic
    arrivals every copy reproduces the single-copy run exactly; with Poisson arrivals the
    copies start at the same phases but draw their own requests."""
    from apex_bdq.evaluation import evaluate_policy
    quiet = SimConfig(trace=TraceConfig(poisson_noise=False))
    one = evaluate_policy(HPA(), quiet, shards=2, ticks=700).metrics
    three = evaluate_policy(HPA(), quiet, shards=2, ticks=700, replicas=3).metrics
    assert three["shards"] == 6 and three["replicas"] == 3 and three["slo_windows"] == 3 * one["slo_windows"] > 0
    assert three["reward"] == pytest.approx(one["reward"], rel=1e-9)
    assert three["slo_violation_rate_per_replica"] == pytest.approx([one["slo_violation_rate"]] * 3)
    assert three["slo_violation_rate"] == pytest.approx(one["slo_violation_rate"])

    sim = PlatformSim(SimConfig(num_shards=6), split="eval", eval_replicas=3)
    sim.reset(seed=0)
    assert list(sim.offset[:2]) == list(sim.offset[2:4]) == list(sim.offset[4:])
    assert sim.offset[0] != sim.offset[1]
    rp = RandomPolicy(seed=0)
    rp.reset(sim)
    a = rp.act(sim, None)[0]
    arrivals = [sim.step(a)[3]["arrivals"] for _ in range(5)]
    assert any((x[0] != x[2]).any() for x in arrivals)  # same phase, its own requests
    with pytest.raises(ValueError, match="eval_replicas must be an int >= 1 dividing num_shards=6"):
        PlatformSim(SimConfig(num_shards=6), split="eval", eval_replicas=4)
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        evaluate_policy(HPA(), quiet, shards=2, ticks=10, replicas=0)


def test_training_range_yardstick_with_even_phases():
    """split="train" with even phases covers the training range once per copy (a yardstick
    that leaves the held-out range unseen)."""
    cfg = SimConfig(num_shards=4)
    tr = PlatformSim(cfg, split="train", phases="even")
    lo, hi = tr.rates.train
    assert sorted(tr.offset.tolist()) == [lo + i * (hi - lo) // 4 for i in range(4)]
    ev = PlatformSim(cfg, split="eval")
    assert (ev.offset >= ev.rates.eval[0]).all() and not np.isin(tr.offset, ev.offset).any()
    m = evaluate_policy(HPA(), cfg, shards=4, ticks=40, split="train").metrics
    e = evaluate_policy(HPA(), cfg, shards=4, ticks=40).metrics
    assert m["ticks"] == e["ticks"] == 40 and m["reward"] != e["reward"]
    with pytest.raises(ValueError, match="phases must be 'random' or 'even'"):
        PlatformSim(cfg, phases="spread")
    with pytest.raises(ValueError, match=r"eval_replicas=2 needs evenly spaced phases"):
        PlatformSim(cfg, split="train", eval_replicas=2)


def test_validation_range_lies_between_training_and_held_out_and_leaves_the_test_set_alone():
    """trace.validation_fraction carves the last part of the pre-held-out trace into a
    validation range: the three ranges partition the trace, the held-out range and the rates
    (normalised over training + validation) are what they were without it, training shards
    start only in the shortened training range, and split="val" without one says so."""
    plain = SimConfig(num_shards=8, trace=TraceConfig(validation_fraction=0.0))
    cfg = plain.replace(trace=TraceConfig(validation_fraction=0.2))
    r0, r = PlatformSim(plain).rates, PlatformSim(cfg).rates
    assert r.train[0] == 0 and r.train[1] == r.val[0] and r.val[1] == r.eval[0] == r0.eval[0]
    assert r.eval == r0.eval and r.train[1] == round(r0.train[1] * 0.8)
    np.testing.assert_array_equal(r.rates, r0.rates)
    tr = PlatformSim(cfg.replace(num_shards=256))
    assert (tr.offset >= r.train[0]).all() and (tr.offset < r.train[1]).all()
    va = PlatformSim(cfg, split="val")
    lo, hi = r.val
    assert sorted(va.offset.tolist()) == [lo + i * (hi - lo) // 8 for i in range(8)]
    e0 = evaluate_policy(HPA(), plain, shards=4, ticks=60).metrics
    e1 = evaluate_policy(HPA(), cfg, shards=4, ticks=60).metrics
    assert e0["reward"] == e1["reward"] and e0["slo_violation_rate"] == e1["slo_violation_rate"]
    v = evaluate_policy(HPA(), cfg, shards=4, ticks=60, split="val").metrics
    assert v["reward"] != e1["reward"]
    with pytest.raises(ValueError, match=r"no 'val' range \(set trace.validation_fraction > 0\)"):
        PlatformSim(plain, split="val")
    with pytest.raises(ConfigError, match="validation_fraction must be in"):
        TraceConfig(validation_fraction=1.0)
