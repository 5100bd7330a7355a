"""The guard around the learned policy (apex_bdq/guard.py) and training-time trace
augmentation (platform v2's `sim.augment`)."""

import dataclasses

import numpy as np
import pytest
import torch

from apex_bdq.config import AugmentConfig, ConfigError, GuardConfig, SimConfig, TraceConfig, apply_overrides
from apex_bdq.evaluation import evaluate_learned, evaluate_policy
from apex_bdq.guard import (FEATURES, NF, Guard, GuardedPolicy, _layout, coverage, describe_shares, guard_for,
                            load_shape, measure_coverage)
from apex_bdq.networks import BDQNetwork
from apex_bdq.presets import PRESETS
from apex_bdq.sim import make_sim
from apex_bdq.sim.baselines import Predictive
from apex_bdq.sim.platform_v2 import default_action_v2

SIM = SimConfig(num_shards=8, seed=1)
K = SIM.num_classes
WIDE = (np.zeros(NF * K), np.full(NF * K, 1e9))  # a coverage every observation lies in


def macro_batch(n=6, seed=0):
    sim = make_sim(SIM.replace(num_shards=n, seed=seed), split="train", phases="random")
    return sim.reset(seed=seed).macro


def test_the_band_bounds_plans_and_admission_and_leaves_holds():
    g = Guard.build(GuardConfig(plan_below=1, plan_above=1, max_admission=1), SIM, *WIDE)
    rule = np.asarray(default_action_v2(SIM))
    assert g.plan_lo == rule[0] - 1 and g.plan_hi == rule[0] + 1
    rng = np.random.default_rng(0)
    a = rng.integers(0, SIM.sub_actions, size=(6, SIM.num_branches))
    out, clipped, capped, back = g.apply(macro_batch(), a)
    assert not back.any()
    assert ((out[:, :K] >= g.plan_lo) & (out[:, :K] <= g.plan_hi)).all() and (out[:, -1] <= 1).all()
    np.testing.assert_array_equal(out[:, K:2 * K], a[:, K:2 * K])  # holds are the policy's
    plan_in = (a[:, :K] >= g.plan_lo).all(1) & (a[:, :K] <= g.plan_hi).all(1)
    np.testing.assert_array_equal(clipped, ~plan_in)
    np.testing.assert_array_equal(capped, a[:, -1] > 1)  # the admission cap, counted apart
    inside = plan_in & (a[:, -1] <= 1)
    np.testing.assert_array_equal(out[inside], a[inside])  # a decision inside the band passes unchanged


def test_an_observation_outside_the_coverage_falls_back_to_the_rule():
    macro = macro_batch()
    idx, _ = _layout(SIM)
    f = load_shape(macro.astype(np.float64), idx)
    g = Guard.build(GuardConfig(ood_margin=0.0), SIM, f.min(0), f.max(0))  # exactly what these rows cover
    a = np.zeros((6, SIM.num_branches), dtype=np.int64)
    a[:, :K] = g.plan_lo
    assert g.inside(macro).all()
    burst = macro.copy()
    burst[2, idx[1, -1]] = 10.0 * f[:, 1].max() + 1.0  # class 1's newest 2-minute rate: a burst never seen
    out, clipped, capped, back = g.apply(burst, a)
    np.testing.assert_array_equal(back, np.arange(6) == 2)
    np.testing.assert_array_equal(out[2], g.rule)
    np.testing.assert_array_equal(out[back == 0], a[back == 0])
    assert not clipped[2] and not capped.any()  # counted once: as a fallback
    # The margin widens the coverage by its share of the range on each side.
    assert Guard.build(GuardConfig(ood_margin=100.0), SIM, f.min(0), f.max(0)).inside(burst).all()
    # A round trip through the dict form (what a weight store's meta carries) keeps the bounds.
    g2 = Guard.from_dict(g.to_dict(), SIM)
    np.testing.assert_allclose(g2.lo, g.lo) and np.testing.assert_allclose(g2.hi, g.hi)


def test_minute_scale_burstiness_alone_falls_back_to_the_rule():
    """Roughness: the same newest rate, growth and 32-minute mean, but 2-minute rates that
    zigzag as a smoothed training trace never does: out of coverage on that feature alone."""
    macro = macro_batch()
    idx, Hc = _layout(SIM)
    f = load_shape(macro.astype(np.float64), idx)
    g = Guard.build(GuardConfig(ood_margin=0.5), SIM, f.min(0), f.max(0))
    rough = macro.copy()
    blocks = rough[4, idx[0]]
    zigzag = 0.8 * blocks.mean() * np.array([1.0, -1.0] * ((Hc - 2) // 2) + [0.0] * (2 + (Hc - 2) % 2))
    rough[4, idx[0]] = blocks + zigzag  # the newest two blocks and the mean unchanged
    f2 = load_shape(rough.astype(np.float64), idx)
    r = FEATURES.index("roughness") * K  # class 0's roughness column
    others = [c for c in range(NF * K) if not r <= c < r + K]
    np.testing.assert_allclose(f2[4, others], f[4, others], rtol=1e-5)  # rate, growth, trend: as before
    assert f2[4, r] > 5 * f[:, r].max()
    _, _, _, back = g.apply(rough, np.zeros((6, SIM.num_branches), dtype=np.int64))
    np.testing.assert_array_equal(back, np.arange(6) == 4)


def test_the_guarded_policy_reports_its_shares_and_a_full_fallback_is_the_rule():
    torch.manual_seed(0)
    cfg = PRESETS["smoke"]
    net = BDQNetwork(cfg.net)
    from apex_bdq.checkpoint import GreedyPolicy
    nothing = (np.full(NF * K, 1e9), np.full(NF * K, 2e9))  # a coverage no observation lies in
    pol = GuardedPolicy(GreedyPolicy(net, cfg.agent.decision_ticks), Guard.build(GuardConfig(), cfg.sim, *nothing))
    m = evaluate_policy(pol, cfg.sim, shards=2, ticks=120).metrics
    s = pol.shares()
    assert s["guard_decisions"] == 2 * (120 + 900) // cfg.agent.decision_ticks  # warm-up ticks decide too
    assert s["guard_fallback_share"] == 1.0 and s["guard_clipped_share"] == s["guard_admission_capped_share"] == 0.0
    # Falling back everywhere is the best rule: the predictive rule's replicas, the default admission.
    rule = evaluate_policy(Predictive(), cfg.sim, shards=2, ticks=120).metrics
    assert m["cost"] == rule["cost"] and m["slo_violation_rate"] == rule["slo_violation_rate"]
    assert s["guard_floor_raised_share"] == s["guard_ceiling_lowered_share"] == 0.0  # pinned, not counted
    unfloored = GuardedPolicy(GreedyPolicy(net, cfg.agent.decision_ticks),
                              Guard.build(GuardConfig(floor_margin=0.0), cfg.sim, *nothing))
    m0 = evaluate_policy(unfloored, cfg.sim, shards=2, ticks=120).metrics  # the fallback needs no floor
    assert m0["cost"] == rule["cost"] and m0["slo_violation_rate"] == rule["slo_violation_rate"]
    # Within a wide coverage nothing falls back, and every clipped decision was outside the band.
    pol = GuardedPolicy(GreedyPolicy(net, cfg.agent.decision_ticks), Guard.build(GuardConfig(), cfg.sim, *WIDE))
    evaluate_policy(pol, cfg.sim, shards=2, ticks=120)
    assert pol.shares()["guard_fallback_share"] == 0.0 and 0.0 <= pol.shares()["guard_clipped_share"] <= 1.0


def test_the_best_rules_replicas_bound_the_learned_ones():
    """A band collapsed onto the predictive rule's margin is that rule; a high floor raises
    nearly every pool and costs at least what the rule costs at that margin; no floor and no
    ceiling leave the learned replicas alone."""
    torch.manual_seed(0)
    cfg = PRESETS["smoke"]
    net = BDQNetwork(cfg.net)
    from apex_bdq.checkpoint import GreedyPolicy

    def run(**kw):  # the predictive rule's bounds alone (no static ceiling)
        pol = GuardedPolicy(GreedyPolicy(net, cfg.agent.decision_ticks),
                            Guard.build(GuardConfig(static_ceiling=0.0, **kw), cfg.sim, *WIDE))
        return evaluate_policy(pol, cfg.sim, shards=2, ticks=300).metrics, pol.shares()

    def rule(margin):
        return evaluate_policy(Predictive(margin=margin), cfg.sim, shards=2, ticks=300).metrics

    pinned, s = run(floor_margin=1.5, ceiling_margin=1.5)
    assert pinned["cost"] == rule(1.5)["cost"] and pinned["slo_violation_rate"] == rule(1.5)["slo_violation_rate"]
    assert s["guard_floor_raised_share"] + s["guard_ceiling_lowered_share"] > 0
    high, s = run(floor_margin=3.0)
    assert s["guard_floor_raised_share"] > 0.5 and s["guard_ceiling_lowered_share"] == 0.0
    assert high["cost"] >= rule(3.0)["cost"]
    free, s = run(floor_margin=0.0)

    class SubActionsOnly(GuardedPolicy):  # the guarded sub-actions, no replica bounds sent
        def act(self, sim, obs):
            return super().act(sim, obs)[0], None

    bare = evaluate_policy(SubActionsOnly(GreedyPolicy(net, cfg.agent.decision_ticks),
                                          Guard.build(GuardConfig(static_ceiling=0.0), cfg.sim, *WIDE)),
                           cfg.sim, shards=2, ticks=300).metrics
    assert s["guard_floor_raised_share"] == 0.0 and free["cost"] == bare["cost"] < high["cost"]
    with pytest.raises(ConfigError, match="guard.ceiling_margin"):
        GuardConfig(floor_margin=1.2, ceiling_margin=1.1)


def test_static_provisionings_replicas_cap_the_learned_ones():
    """`static_ceiling`: each class keeps at most the replicas static provisioning asks for
    (the training days' per-class peak over the utilisation) and never less than the floor:
    under a floor far above it the guarded policy is the floored one, tick for tick; it is
    lifted for a class whose load lies above the peak; a ceiling is counted in
    `guard_ceiling_lowered_share`; bad values are named."""
    torch.manual_seed(0)
    cfg = PRESETS["smoke"]
    net = BDQNetwork(cfg.net)
    from apex_bdq.checkpoint import GreedyPolicy
    from apex_bdq.sim.baselines import StaticPeak

    def run(**kw):
        pol = GuardedPolicy(GreedyPolicy(net, cfg.agent.decision_ticks), Guard.build(GuardConfig(**kw), cfg.sim, *WIDE))
        return evaluate_policy(pol, cfg.sim, shards=2, ticks=300).metrics, pol.shares()

    static = evaluate_policy(StaticPeak(target_utilisation=0.9), cfg.sim, shards=2, ticks=300).metrics
    floored, s = run(floor_margin=50.0, static_ceiling=0.9)
    floor_only, _ = run(floor_margin=50.0, static_ceiling=0.0)
    assert floored["cost"] == floor_only["cost"] > static["cost"]  # the floor wins over the static ceiling
    assert s["guard_ceiling_lowered_share"] == 0.0 and s["guard_floor_raised_share"] > 0.9
    low, s = run(floor_margin=0.0, static_ceiling=1.0)
    free, s0 = run(floor_margin=0.0, static_ceiling=0.0)
    assert s["guard_ceiling_lowered_share"] > 0 and s0["guard_ceiling_lowered_share"] == 0.0
    assert low["cost"] < free["cost"]  # the untouched policy asked for more than the peak in places

    class BelowEveryLoad(GuardedPolicy):  # training days whose peak every load lies above
        def reset(self, sim):
            super().reset(sim)
            self.peak = np.full_like(self.peak, -1.0)

    lifted = BelowEveryLoad(GreedyPolicy(net, cfg.agent.decision_ticks),
                            Guard.build(GuardConfig(floor_margin=0.0, static_ceiling=1.0), cfg.sim, *WIDE))
    m = evaluate_policy(lifted, cfg.sim, shards=2, ticks=300).metrics
    assert lifted.shares()["guard_ceiling_lowered_share"] == 0.0 and m["cost"] == free["cost"]
    assert "its ceiling lowered" in describe_shares(s) and "ceiling" not in describe_shares(s0)
    for bad in (1.5, -0.1, True, float("nan"), "0.8"):
        with pytest.raises(ConfigError, match="guard.static_ceiling"):
            GuardConfig(static_ceiling=bad)


def test_coverage_spans_the_training_days_and_evaluate_learned_runs_under_the_guard(step_trace, monkeypatch):
    # A trace whose training days hold one step: its rates (in units of the class mean) are the coverage.
    path = step_trace(low=(100.0, 2.0, 0.5, 0.02), high=(200.0, 4.0, 1.0, 0.04), at=6000, n=12_000)
    sim = SimConfig(num_shards=4, seed=2, episode_s=600.0,
                    trace=TraceConfig(path=str(path), columns=("c0", "c1", "c2", "c3"), poisson_noise=False,
                                      eval_fraction=0.25, validation_fraction=0.0))
    lo, hi = coverage(sim, use_cache=False)
    rate_lo, rate_hi = lo[:K], hi[:K]
    assert (rate_hi / np.maximum(rate_lo, 1e-9) > 1.5).all()  # both levels of the step seen
    # The training days' coverage, not the run's: a run's seed does not change it.
    noisy = dataclasses.replace(sim, trace=dataclasses.replace(sim.trace, poisson_noise=True))
    a, b = measure_coverage(noisy, shards=4), measure_coverage(dataclasses.replace(noisy, seed=9), shards=4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    lo2, hi2 = coverage(sim)  # through the cache: the same figures
    lo3, hi3 = coverage(sim)
    np.testing.assert_allclose(lo2, lo) and np.testing.assert_allclose(hi3, hi)
    cfg = dataclasses.replace(PRESETS["smoke"], sim=sim)
    net = BDQNetwork(cfg.net)
    m = evaluate_learned(net, cfg, ticks=60, shards=2)
    assert m["guarded"] and m["guard_decisions"] > 0
    bare = evaluate_learned(net, dataclasses.replace(cfg, guard=GuardConfig(enabled=False)), ticks=60, shards=2)
    assert not bare["guarded"] and "guard_decisions" not in bare
    assert guard_for(dataclasses.replace(cfg, guard=GuardConfig(enabled=False))) is None


def test_guard_and_augment_settings_are_checked_by_name():
    cfg = PRESETS["smoke"]
    assert apply_overrides(cfg, ["guard.plan_above=1"]).guard.plan_above == 1
    assert apply_overrides(cfg, ["sim.augment.enabled=true"]).sim.augment.enabled
    with pytest.raises(ConfigError, match="guard.plan_below"):
        GuardConfig(plan_below=-1)
    with pytest.raises(ConfigError, match="sim.augment.time_warp"):
        AugmentConfig(time_warp=(2.0, 1.0))
    with pytest.raises(ConfigError, match="sim.augment is a platform v2 option"):
        SimConfig(platform="v1", augment=AugmentConfig(enabled=True))


# -- augmentation ----------------------------------------------------------------------------------
def _episode_arrivals(cfg: SimConfig, split="train", phases="random"):
    """(sim, arrivals [T, S], the trace's own mean arrivals at the ticks each shard read [T, S])."""
    sim = make_sim(cfg, split=split, phases=phases)
    a = np.tile(np.asarray(default_action_v2(cfg)), (cfg.num_shards, 1))
    tot, trace = [], []
    for _ in range(cfg.episode_ticks):
        trace.append(sim.lam_table[sim.trace_index()].sum(1) * cfg.tick_s)
        _, _, trunc, info = sim.step(a)
        tot.append(info["arrivals"].sum(1))
    return sim, np.asarray(tot), np.asarray(trace)


def test_augmentation_is_seeded_shaped_and_training_only():
    base = SimConfig(num_shards=8, seed=5, episode_s=1800.0)
    on = base.replace(augment=AugmentConfig(enabled=True, scale=(2.0, 2.0), time_warp=(1.0, 1.0),
                                            bursts_per_hour=0.0))
    _, plain, trace0 = _episode_arrivals(base)
    _, scaled, trace1 = _episode_arrivals(on)
    assert np.allclose(plain.sum(0) / trace0.sum(0), 1.0, rtol=0.02)  # off: the trace's own rate
    assert np.allclose(scaled.sum(0) / trace1.sum(0), 2.0, rtol=0.02)  # a pure x2 scale doubles every shard's
    # Time warp: the episode reads warp x its length of the trace.
    warp = base.replace(augment=AugmentConfig(enabled=True, scale=(1.0, 1.0), time_warp=(2.0, 2.0),
                                              bursts_per_hour=0.0))
    sw = make_sim(warp, split="train", phases="random")
    i0 = sw.trace_index().copy()
    a = np.tile(np.asarray(default_action_v2(warp)), (8, 1))
    for _ in range(100):
        sw.step(a)
    np.testing.assert_array_equal(sw.trace_index() - i0, 200)
    # Bursts only add load, on top of the scaled rate.
    bursts = base.replace(augment=AugmentConfig(enabled=True, scale=(1.0, 1.0), time_warp=(1.0, 1.0),
                                                bursts_per_hour=6.0, burst_height=(1.0, 1.0)))
    sb = make_sim(bursts, split="train", phases="random")
    assert (sb.aug_mult >= 1.0).all() and sb.aug_mult.max() > 1.5
    # Determinism: one seed draws one set of shapes; another seed others.
    full = base.replace(augment=AugmentConfig(enabled=True))
    _, x1, _ = _episode_arrivals(full)
    _, x2, _ = _episode_arrivals(full)
    _, x3, _ = _episode_arrivals(full.replace(seed=6))
    np.testing.assert_array_equal(x1, x2)
    assert not np.array_equal(x1, x3)
    # Never outside training episodes: evaluation and validation layouts read the trace as it is.
    for split, phases in (("eval", "even"), ("val", "even"), ("train", "even")):
        sim = make_sim(full, split=split, phases=phases)
        assert not sim.augmenting and sim.aug_mult is None
    with pytest.raises(ValueError, match="time_warp"):
        make_sim(base.replace(episode_s=3600.0, augment=AugmentConfig(enabled=True, time_warp=(900.0, 900.0))),
                 split="train", phases="random")


def test_mixed_training_traces_draw_per_shard_and_read_only_training_days(tmp_path):
    """sim.augment.traces: each training episode every shard replays the training days of
    one of the traces (the run's own or an extra one), with that trace's own history; the
    extra traces' held-out days are never read, and evaluation reads the run's trace only."""
    from apex_bdq.sim.platform import make_rates
    extra = tmp_path / "square_1min.csv"  # 12 days of a square wave: nothing like NASA-HTTP
    extra.write_text("minute,req\n" + "\n".join(f"{i},{400 if (i // 90) % 2 else 40}" for i in range(12 * 1440)) + "\n")
    base = SimConfig(num_shards=16, seed=5, episode_s=1800.0)
    mixed = base.replace(augment=AugmentConfig(traces=(str(extra),)))
    own = make_rates(base)
    other = make_rates(base.replace(trace=dataclasses.replace(base.trace, path=str(extra))))
    sim = make_sim(mixed, split="train", phases="random")
    assert sim.mixing and sim.augmenting and len(sim.lam_table) == len(own.rates) + other.train[1]
    a = np.tile(np.asarray(default_action_v2(mixed)), (16, 1))
    seen_extra = seen_own = False
    for episode in range(3):
        if episode:
            sim.reset()
        on_extra = np.asarray(sim.mix_base) > 0
        assert (np.asarray(sim.mix_base)[on_extra] == len(own.rates)).all()
        seen_extra |= on_extra.any()
        seen_own |= (~on_extra).any()
        for _ in range(sim.cfg.episode_ticks):
            idx = sim.trace_index()
            local = idx - np.asarray(sim.mix_base)
            assert (local[on_extra] < other.train[1]).all() and (local[~on_extra] < own.train[1]).all()
            np.testing.assert_array_equal(sim.lam_table[idx[on_extra]], other.rates[local[on_extra]])
            np.testing.assert_array_equal(sim.lam_table[idx[~on_extra]], own.rates[idx[~on_extra]])
            _, _, ok_d, _ = sim.seasonal(idx)
            np.testing.assert_array_equal(ok_d, local >= sim.day)  # history from the shard's own trace
            sim.step(a)
    assert seen_extra and seen_own
    # The reshaping is off: each trace is replayed at its own rate, tick for tick.
    assert sim.aug_mult is None and sim.aug_scale is None and sim.aug_warp is None
    # Seeded: the same seed draws the same traces and starts.
    again = make_sim(mixed, split="train", phases="random")
    other_seed = make_sim(mixed.replace(seed=6), split="train", phases="random")
    np.testing.assert_array_equal(again.offset, make_sim(mixed, split="train", phases="random").offset)
    assert not np.array_equal(again.offset, other_seed.offset)
    # Evaluation and validation read the run's own trace only.
    for split in ("eval", "val"):
        ev = make_sim(mixed, split=split, phases="even")
        assert not ev.mixing and len(ev.lam_table) == len(own.rates)
    with pytest.raises(Exception, match="nope.csv"):
        make_sim(base.replace(augment=AugmentConfig(traces=(str(tmp_path / "nope.csv"),))), split="train",
                 phases="random")
    with pytest.raises(ConfigError, match="sim.augment.traces"):
        AugmentConfig(traces=("",))
