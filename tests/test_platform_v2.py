"""Platform v2: per-class pools sized by the queueing model, lead / hold actions, billing,
refused work in the SLO accounting, foresight observations."""

import numpy as np
import pytest

from apex_bdq.config import ConfigError, SimConfig, TraceConfig
from apex_bdq.sim import PlatformSim, PlatformSimV2, make_sim
from apex_bdq.sim.platform_v2 import MACRO_CLASS_V2, MACRO_GLOBAL_V2, MICRO_FEATURES_V2, default_action_v2, macro_names
from apex_bdq.sizing import replicas_for

from conftest import random_actions


def actions(sim, plan=2, hold=4, admission=0):
    a = np.empty((sim.S, sim.D), dtype=np.int64)
    a[:, :sim.K] = plan
    a[:, sim.K:2 * sim.K] = hold
    a[:, -1] = admission
    return a


def step_sim(step_trace, low, high, at, n=8000, **kw):
    """One shard from tick 0 of a synthetic 1-s trace that steps from `low` to `high` at `at`."""
    path = step_trace(low=low, high=high, at=at, n=n)
    cfg = SimConfig(num_shards=1, trace=TraceConfig(path=str(path), columns=("c0", "c1", "c2", "c3"),
                                                     poisson_noise=False, eval_fraction=0.2,
                                                     validation_fraction=0.0), **kw)
    return make_sim(cfg, split="train", phases="even")


def test_conservation_shapes_and_billing_under_random_actions():
    sim = make_sim(SimConfig(num_shards=16, seed=3))
    assert isinstance(sim, PlatformSimV2) and sim.D == 9
    rng = np.random.default_rng(0)
    obs = sim.reset(seed=3)
    assert obs.macro.shape == (16, len(macro_names(sim.cfg))) == (16, len(MACRO_GLOBAL_V2) + 4 * (
        len(MACRO_CLASS_V2) + sim.cfg.coarse_history + 2 * len(sim.cfg.seasonal_leads_s)))
    assert obs.micro.shape == (16, 4, sim.cfg.history, len(MICRO_FEATURES_V2))
    for _ in range(200):
        before = sim.backlog.copy()
        obs, r, _, info = sim.step(random_actions(rng, 16, sim.D, sim.n))
        served, refused = info["served_requests"], info["dropped"]
        np.testing.assert_allclose(before + info["arrivals"], served + refused + info["backlog"], rtol=1e-5, atol=1e-3)
        # Every ready or booting replica is billed for the tick, busy or not.
        np.testing.assert_allclose(info["cost"], (info["servers"] + info["pending"]) / sim.mean_load, rtol=1e-6)
        assert (info["busy"] <= info["cost"] + 1e-9).all()
        assert np.isfinite(obs.macro).all() and np.isfinite(obs.micro).all() and np.isfinite(r).all()
        assert (sim.active <= sim.caps).all() and (sim.active >= sim.cfg.min_servers).all()


def test_pools_hold_the_traces_peak_and_start_at_the_default_plan():
    sim = make_sim(SimConfig(num_shards=4))
    peak = sim.lam_table.max(0) * sim.inv_mu
    assert (sim.caps >= sim.cfg.pool_cap_factor * peak).all()
    lam = sim.lam_table[sim.trace_index()]
    d = default_action_v2(sim.cfg)
    assert d == (2,) * 4 + (4,) * 4 + (0,)
    np.testing.assert_array_equal(sim.target, replicas_for(lam * sim.plan[d[0]], sim.sizing))


def test_a_lead_tier_has_capacity_ready_when_a_ramp_arrives(step_trace):
    """Planning above the rate ahead of a step (a lead of the provisioning delay) has the
    replicas the step needs ready when it comes; the plan of the moment gets them only a
    monitoring lag + provisioning delay later."""
    low, high, at = (100.0, 2.0, 0.5, 0.02), (150.0, 3.0, 0.75, 0.03), 3000
    reactive, ahead = step_sim(step_trace, low, high, at), step_sim(step_trace, low, high, at)
    L, lag = reactive.L, reactive.lag
    need = replicas_for(reactive.lam_table[at][None], reactive.sizing)[0]
    for t in range(at + 1):
        reactive.step(actions(reactive, plan=0, hold=0))
        # Plan factor 1.75 from a delay (+ a margin of 10 ticks) before the step.
        ahead.step(actions(ahead, plan=4 if t >= at - L - 10 else 0, hold=0))
    assert (ahead.active[0] >= need).all()
    assert (reactive.active[0] < need).all()
    for _ in range(lag + L + 60):  # the reactive plan catches up after the lag and the delay
        reactive.step(actions(reactive, plan=0, hold=0))
    # (Classes 0-2; class 3's requests take 321 s, so its requests in flight, what the plan
    # sizes for, rise on that time scale.)
    assert (reactive.active[0, :3] >= need[:3] - 1).all()


def test_the_hold_keeps_the_highest_plan_and_release_follows_the_load_down(step_trace):
    high, low, at = (150.0, 3.0, 0.75, 0.03), (100.0, 2.0, 0.5, 0.02), 3000
    quick, held = step_sim(step_trace, high, low, at), step_sim(step_trace, high, low, at)
    for _ in range(at):
        quick.step(actions(quick, hold=0))
        held.step(actions(held, hold=4))
    top = held.target.copy()
    for _ in range(150):  # the monitored load has fallen; 150 s < the 300-s hold
        quick.step(actions(quick, hold=0))
        held.step(actions(held, hold=4))
    plan_low = replicas_for(quick.lam_table[at + 150][None] * quick.plan[2], quick.sizing)
    fast = slice(0, 3)  # class 3's 321-s requests leave its pool on their own time scale
    assert (quick.target[:, fast] <= plan_low[:, fast] + 1).all() and (quick.target[:, fast] < top[:, fast]).all()
    np.testing.assert_array_equal(held.target, top)
    for _ in range(200):  # past the hold (300 s + one 15-s block), the held pool is released too
        held.step(actions(held, hold=4))
    assert (held.target[:, fast] < top[:, fast]).all()


def test_refused_requests_count_against_the_slo():
    """Refused work is late work: a window whose refusals alone pass 1 % of its requests is
    broken, whatever the admitted requests' latency."""
    sim = make_sim(SimConfig(num_shards=2, accounting_window_s=60.0, seed=1))
    cap = np.full((2, 4), 1, dtype=np.int64)
    cap[:, 0] = sim.caps[0]  # class 0 well provisioned; the others starve and queue
    req = np.zeros((2, 4))
    refused = np.zeros((2, 4))
    for t in range(sim.W):
        _, _, _, info = sim.step(actions(sim, admission=sim.n - 1), capacity_target=cap)
        assert (info["late_requests"] >= info["dropped"] - 1e-6).all()
        req += info["arrivals"]
        refused += info["dropped"]
    v = info["window_violated"]
    assert v is not None and refused[:, 1:].sum() > 0
    share = refused / np.maximum(req, 1)
    assert v[share > 0.01].all()


def test_foresight_observations_read_the_traces_history_and_calendar():
    sim = make_sim(SimConfig(num_shards=3), split="eval", phases="even")
    obs = sim.reset(seed=0)
    names = macro_names(sim.cfg)
    idx = sim.trace_index()
    col = {n: i for i, n in enumerate(names)}
    for lead in sim.cfg.seasonal_leads_s:
        for k in range(4):
            j = col[f"rate_1d_plus_{int(lead)}s[{k}]"]
            want = sim.lam_table[idx - sim.day + int(lead), k] / sim.class_rate[k]
            np.testing.assert_allclose(obs.macro[:, j], want, rtol=1e-5)
            j7 = col[f"rate_7d_plus_{int(lead)}s[{k}]"]
            np.testing.assert_allclose(obs.macro[:, j7], sim.lam_table[idx - sim.week + int(lead), k] /
                                       sim.class_rate[k], rtol=1e-5)
    assert (obs.macro[:, col["history_7d_ok"]] == 1).all()  # the held-out days have a week behind them
    # The bundled trace starts on Friday 4 August 1995: tick 0 is 4 days into the week.
    assert sim.rates.time_of_week[0] == pytest.approx(4 / 7, abs=1e-5)
    train = make_sim(SimConfig(num_shards=1), split="train", phases="even")
    o = train.reset(seed=0)
    assert o.macro[0, col["history_1d_ok"]] == 0 and (o.macro[0, [col["rate_7d_plus_0s[0]"]]] == 0).all()
    # Capacity still booting shows up by when it arrives.
    sim.step(actions(sim), capacity_target=sim.target + 10)
    o = sim._observe()
    for k in range(4):
        assert o.macro[0, col[f"booting[{k}]"]] == pytest.approx(10 / sim.class_load[k], rel=1e-5)
        assert o.macro[0, col[f"booting_soon[{k}]"]] == 0.0  # launched now: ready in 60 s, not within 30 s


def test_v2_config_errors_and_the_v1_class_refuses_a_v2_config():
    with pytest.raises(ConfigError, match="plan_factors needs one value per sub-action"):
        SimConfig(plan_factors=(1.0, 2.0))
    with pytest.raises(ConfigError, match="per_class_capacity is a v1 option"):
        SimConfig(per_class_capacity=True)
    with pytest.raises(ConfigError, match="sim.platform must be one of"):
        SimConfig(platform="v3")
    with pytest.raises(ValueError, match="PlatformSim is platform v1"):
        PlatformSim(SimConfig())
    assert isinstance(make_sim(SimConfig(platform="v1", num_shards=1)), PlatformSim)
    sim = make_sim(SimConfig(num_shards=2))
    with pytest.raises(Exception, match=r"shape \[S=2, D=9\]"):
        sim.step(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(Exception, match="capacity_target must be integers of shape"):
        sim.step(actions(sim), capacity_target=np.zeros((2, 1), dtype=np.int64))


def test_capacity_bounds_keep_the_branches_target_within_them():
    """A guard's bounds: the target is the branches' own where it lies inside [lo, hi], lo or
    hi where it does not (reported in sim.raised / sim.lowered); bad bounds are named."""
    from apex_bdq.sim.provisioning import CapacityBounds
    a, b = make_sim(SimConfig(num_shards=2, seed=4)), make_sim(SimConfig(num_shards=2, seed=4))
    a.reset(seed=4)
    b.reset(seed=4)
    for _ in range(5):
        a.step(actions(a))
    b_acts = actions(b)
    for _ in range(4):
        b.step(b_acts)
    free = a.target.copy()  # the branches' target at tick 5
    lo = free.copy()
    lo[0, 1] += 7  # raise one pool
    hi = np.full_like(free, 10**6)
    hi[1, 2] = max(free[1, 2] - 3, 1)  # lower another
    b.step(b_acts, capacity_bounds=CapacityBounds(lo.astype(np.int64), hi.astype(np.int64)))
    want = free.copy()
    want[0, 1] += 7
    want[1, 2] = hi[1, 2]
    np.testing.assert_array_equal(b.target, want)
    assert b.raised.sum() == 1 and b.raised[0, 1] and b.lowered.sum() == 1 and b.lowered[1, 2]
    t, target = b.t, b.target.copy()
    with pytest.raises(Exception, match="capacity_bounds.lo must be integers of shape"):
        b.step(b_acts, capacity_bounds=CapacityBounds(np.zeros((2, 4))))
    assert b.t == t and (b.target == target).all()  # refused before anything moved
    b.step(b_acts)
    assert b.raised is None and b.lowered is None  # no bounds this tick: nothing reported moved
    with pytest.raises(Exception, match="takes no capacity_bounds"):
        b.step(b_acts, capacity_target=b.target, capacity_bounds=CapacityBounds(hi=hi))
