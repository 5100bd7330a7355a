"""PlatformSim dynamics: conservation, determinism, delays, delayed reward, errors.

Platform v1 (one shared pool; kept so that checkpoints trained on it still evaluate):
`SimConfig` here is v1's. Platform v2 has its own tests (test_platform_v2.py, test_yardstick.py).
"""

import numpy as np
import pytest

import functools

from apex_bdq.config import ConfigError, TraceConfig
from apex_bdq.config import SimConfig as _SimConfig
from apex_bdq.sim.platform import MACRO_FEATURES, MACRO_MONITORED, MICRO_FEATURES, ActionError, PlatformSim
from apex_bdq.sim.queueing import wait_quantile

from conftest import random_actions

SimConfig = functools.partial(_SimConfig, platform="v1")


def hold(sim, admission=0, speed=None):
    a = np.full((sim.S, sim.D), sim.n // 2)
    a[:, -2] = admission
    a[:, -1] = sim.n - 1 if speed is None else speed
    return a


def test_conservation_every_tick_under_random_actions():
    sim = PlatformSim(SimConfig(num_shards=16, seed=3))
    rng = np.random.default_rng(0)
    backlog = sim.backlog.astype(np.float64).copy()
    for _ in range(400):
        _, _, _, info = sim.step(random_actions(rng, sim.S, sim.D, sim.n))
        arrivals = info["arrivals"].astype(np.float64)
        lhs = arrivals
        rhs = info["served_requests"] + info["dropped"] + (info["backlog"] - backlog)
        np.testing.assert_allclose(lhs, rhs, atol=1e-3 * (1 + arrivals.max()))
        backlog = info["backlog"].astype(np.float64).copy()
    assert info["dropped"].sum() > 0 or backlog.sum() > 0  # random actions do overload


def test_shapes_dtypes_and_finite_observations():
    cfg = SimConfig(num_shards=5)
    sim = PlatformSim(cfg)
    obs = sim.reset(seed=1)
    rng = np.random.default_rng(1)
    for _ in range(50):
        obs, r, trunc, info = sim.step(random_actions(rng, 5, 4, 5))
    assert obs.macro.shape == (5, len(MACRO_FEATURES)) and obs.macro.dtype == np.float32
    assert obs.micro.shape == (5, 4, cfg.history, len(MICRO_FEATURES)) and obs.micro.dtype == np.float32
    assert np.isfinite(obs.macro).all() and np.isfinite(obs.micro).all()
    assert r.shape == (5,) and np.isfinite(r).all() and trunc is False
    for key in ("served", "cost", "slo_penalty", "drop_penalty", "overload", "fairness", "slo_violation"):
        assert info[key].shape == (5,)
    assert ((info["fairness"] > 0) & (info["fairness"] <= 1 + 1e-6)).all()


def test_deterministic_for_a_seed_and_different_across_seeds():
    def run(seed):
        sim = PlatformSim(SimConfig(num_shards=4, seed=seed))
        rng = np.random.default_rng(5)
        out = []
        for _ in range(120):
            o, r, _, _ = sim.step(random_actions(rng, 4, 4, 5))
            out.append((o.macro.copy(), o.micro.copy(), r.copy()))
        return out

    a, b, c = run(11), run(11), run(12)
    for (m1, u1, r1), (m2, u2, r2) in zip(a, b):
        np.testing.assert_array_equal(m1, m2)
        np.testing.assert_array_equal(u1, u2)
        np.testing.assert_array_equal(r1, r2)
    assert any(not np.array_equal(x[2], y[2]) for x, y in zip(a, c))


def test_micro_history_is_time_ordered_and_views_are_opt_in():
    sim = PlatformSim(SimConfig(num_shards=2, history=4), copy_obs=False)
    frames = []
    a = hold(sim)
    for _ in range(6):
        obs, _, _, info = sim.step(a)
        frames.append(info["arrivals"] * sim.inv_mean_n)
    np.testing.assert_allclose(obs.micro[:, :, -1, 0], frames[-1], rtol=1e-6)
    np.testing.assert_allclose(obs.micro[:, :, 0, 0], frames[-4], rtol=1e-6)
    view = obs.micro
    before = view.copy()
    sim.step(a)
    assert not np.array_equal(before, view)  # a view: valid until the next step
    sim2 = PlatformSim(SimConfig(num_shards=2, history=4), copy_obs=True)
    o = sim2.step(a)[0].micro
    keep = o.copy()
    sim2.step(a)
    np.testing.assert_array_equal(o, keep)


def test_provisioning_delay_and_cancel_newest_pending_first():
    cfg = SimConfig(num_shards=1, provisioning_delay_s=10.0)
    sim = PlatformSim(cfg)
    a = hold(sim)
    start = int(sim.active[0, 0])
    sim.step(a, capacity_target=np.array([[start + 20]], dtype=np.int64))
    assert int(sim.active[0, 0]) == start and int(sim.pending[0, 0]) == 20
    for _ in range(9):
        sim.step(a, capacity_target=np.array([[start + 20]], dtype=np.int64))
    assert int(sim.active[0, 0]) == start  # launched at tick 0; ticks 1..9: still booting
    sim.step(a, capacity_target=np.array([[start + 20]], dtype=np.int64))
    assert int(sim.active[0, 0]) == start + 20 and int(sim.pending[0, 0]) == 0  # tick 10

    # Launch 10 at t0 and 6 at t0+3; shrinking by 8 cancels the 6 newest, then 2 of the older.
    base = int(sim.active[0, 0])
    sim.step(a, capacity_target=np.array([[base + 10]], dtype=np.int64))
    for _ in range(2):
        sim.step(a, capacity_target=np.array([[base + 10]], dtype=np.int64))
    sim.step(a, capacity_target=np.array([[base + 16]], dtype=np.int64))
    assert int(sim.pending[0, 0]) == 16
    sim.step(a, capacity_target=np.array([[base + 8]], dtype=np.int64))
    assert int(sim.pending[0, 0]) == 8 and int(sim.active[0, 0]) == base
    seen = []
    for _ in range(10):
        sim.step(a, capacity_target=np.array([[base + 8]], dtype=np.int64))
        seen.append(int(sim.active[0, 0]))
    # The 8 survivors are from the first launch: they arrive 10 ticks after it, all at once.
    assert seen[5] == base + 8 and seen[4] == base
    # Removal beyond pending takes active servers at once, never below the floor.
    sim.step(a, capacity_target=np.array([[0]], dtype=np.int64))
    assert int(sim.active[0, 0]) == cfg.min_servers


def test_capacity_tiers_track_the_monitored_demand():
    sim = PlatformSim(SimConfig(num_shards=3, provisioning_delay_s=0.0, scale_down_window_s=0.0,
                                headroom_min=1.0, headroom_max=3.0))
    a = hold(sim)
    a[:, 0] = [0, 2, 4]  # headroom 1.0, 1.73, 3.0 over the demand the monitoring reports
    for _ in range(5):
        demand = sim.monitored()["load"] * sim.mean_load  # what the tier multiplies (lagged)
        sim.step(a)
        want = np.clip(np.ceil(demand * sim.headroom[[0, 2, 4]]), 1, sim.pool_max)
        np.testing.assert_allclose(sim.target[:, 0], want, rtol=1e-5, atol=1)
    assert (sim.active[:, 0] == sim.target[:, 0]).all()  # no delay configured
    np.testing.assert_allclose(sim.headroom, np.geomspace(1.0, 3.0, 5))


def test_capacity_tiers_scale_down_only_after_the_stabilisation_window():
    """With a 120-s window the tier multiplies the peak monitored demand of the last 120 s
    (kept in 15-s blocks, so the window is 105-135 s long); without one it tracks the demand."""
    base = dict(num_shards=4, provisioning_delay_s=0.0, seed=3)
    plain = PlatformSim(SimConfig(scale_down_window_s=0.0, **base))
    stab = PlatformSim(SimConfig(scale_down_window_s=120.0, **base))
    a = hold(plain)
    a[:, 0] = 2
    h = plain.headroom[2]
    demand, higher = [], 0
    for t in range(600):
        demand.append(plain.mon_class[(plain.mon_ptr - plain.lag) % (plain.lag + 1)].sum(1))
        plain.step(a)
        stab.step(a)
        np.testing.assert_array_equal(plain.target[:, 0], np.clip(np.ceil(demand[-1] * h), 1, plain.pool_max))
        hist = np.stack(demand)  # [t+1, S]
        lo = np.ceil(hist[-min(len(hist), 105):].max(0) * h * (1 - 1e-6))
        hi = np.ceil(hist[-min(len(hist), 136):].max(0) * h * (1 + 1e-6))
        assert (stab.target[:, 0] >= lo).all() and (stab.target[:, 0] <= hi).all(), t
        higher += int((stab.target[:, 0] > plain.target[:, 0]).sum())
    assert higher > 100  # the window held capacity up after demand fell


def test_slo_penalty_is_settled_once_per_window():
    cfg = SimConfig(num_shards=8, accounting_window_s=30.0)
    sim = PlatformSim(cfg)
    a = hold(sim)
    a[:, 0] = 0  # shed capacity every tick: SLOs break
    penalties = []
    for t in range(90):
        _, _, _, info = sim.step(a)
        penalties.append(info["slo_penalty"].sum())
        assert (info["window_violated"] is not None) == ((t + 1) % 30 == 0)
    pen = np.array(penalties)
    assert pen[[29, 59, 89]].sum() > 0
    mask = np.ones(90, bool)
    mask[[29, 59, 89]] = False
    assert (pen[mask] == 0).all()


def test_monitoring_lag_delays_the_macro_load_signal(step_trace):
    # Evaluation split, one shard: the shard starts at the first held-out tick (1000).
    path = step_trace(low=(50.0, 1.0, 0.25, 0.01), high=(200.0, 4.0, 1.0, 0.04), at=1030, n=2000)
    cfg = SimConfig(num_shards=1, monitor_lag_s=15.0, trace=TraceConfig(
        path=str(path), columns=("c0", "c1", "c2", "c3"), poisson_noise=False, eval_fraction=0.5))
    sim = PlatformSim(cfg, split="eval")
    assert int(sim.offset[0]) == 1000
    idx = MACRO_MONITORED.index("load")
    a = hold(sim)
    loads = []
    for _ in range(60):
        obs, _, _, info = sim.step(a)
        loads.append(float(obs.macro[0, idx]))
    # Step t = 30 sees the higher rate; the monitored value shows it 15 ticks later.
    assert loads[44] == pytest.approx(loads[0], rel=1e-5)
    assert loads[45] > loads[0] * 1.05


def test_p99_matches_erlang_c_at_steady_load(step_trace):
    path = step_trace(low=(100.0, 1.0, 0.25, 0.01), at=10 ** 9, n=3000)
    cfg = SimConfig(num_shards=1, trace=TraceConfig(path=str(path), columns=("c0", "c1", "c2", "c3"),
                                                    poisson_noise=False), provisioning_delay_s=0.0)
    sim = PlatformSim(cfg)
    a = hold(sim)
    for _ in range(30):
        _, _, _, info = sim.step(a, capacity_target=np.array([[60]], dtype=np.int64))
    c = sim.servers_k[0]
    lam = info["arrivals"][0]  # noise off: arrivals = rate x 1 s
    for k in range(4):
        if c[k] * sim.mu[k] > lam[k]:
            expect = 1.0 / sim.mu[k] + wait_quantile(c[k], lam[k], sim.mu[k], 0.99)
            assert info["p99_s"][0, k] == pytest.approx(min(expect, sim.lat_cap[k]), rel=2e-3)


@pytest.mark.parametrize("bad,match", [
    (np.zeros((3, 4), dtype=np.int64), r"shape \[S=2, D=4\]"),
    (np.full((2, 4), 5), "out of range: shard 0 branch 'capacity' = 5"),
    (np.array([[0, 0, -1, 0], [0, 0, 0, 0]]), "branch 'admission' = -1"),
    (np.full((2, 4), 1.5), "must be integers"),
    (np.full((2, 4), np.nan), "must be integers"),
])
def test_bad_actions_are_refused_with_a_clear_error(bad, match):
    sim = PlatformSim(SimConfig(num_shards=2))
    with pytest.raises(ActionError, match=match):
        sim.step(bad)
    sim.step(np.full((2, 4), 2.0))  # integral floats are fine
    with pytest.raises(ActionError, match="capacity_target"):
        sim.step(np.zeros((2, 4), dtype=np.int64), capacity_target=np.zeros((2, 2), dtype=np.int64))


@pytest.mark.parametrize("kw,match", [
    (dict(num_classes=3), "service_time_s needs one value per class"),
    (dict(tick_s=0.0), "tick_s must be > 0"),
    (dict(sub_actions=1), "sub_actions must be >= 2"),
    (dict(max_servers=2, min_servers=1, per_class_capacity=True), "below min_servers x pools"),
    (dict(slo_factor=(1.0, -1.0, 1.0, 1.0)), "slo_factor values must be > 0"),
])
def test_bad_config_fails_early(kw, match):
    with pytest.raises(ConfigError, match=match):
        SimConfig(**kw)
    with pytest.raises(ConfigError, match="eval_fraction must be in"):
        TraceConfig(eval_fraction=1.5)


def test_per_class_capacity_is_a_config_change():
    cfg = SimConfig(num_shards=3, per_class_capacity=True)
    assert cfg.num_branches == 6 and cfg.branch_names[:4] == tuple(f"capacity_{k}" for k in range(4))
    sim = PlatformSim(cfg)
    rng = np.random.default_rng(0)
    for _ in range(100):
        _, r, _, info = sim.step(random_actions(rng, 3, 6, 5))
    assert sim.active.shape == (3, 4) and np.isfinite(r).all()
    np.testing.assert_array_equal(sim.servers_k, sim.active)
    # Eight classes, per-class capacity: D = 10 branches.
    cfg8 = SimConfig(num_classes=8, per_class_capacity=True, service_time_s=(0.1,) * 8, slo_factor=(2.0,) * 8,
                     trace=TraceConfig(columns=("c0_lt200ms",)),
                     num_shards=2)
    sim8 = PlatformSim(cfg8)
    sim8.step(np.zeros((2, 10), dtype=np.int64))


def test_eval_split_covers_the_held_out_range():
    cfg = SimConfig(num_shards=4)
    sim = PlatformSim(cfg, split="eval")
    lo, hi = sim.rates.eval
    assert (sim.offset >= lo).all() and (sim.offset < hi).all()
    np.testing.assert_array_equal(np.diff(sim.offset), (hi - lo) // 4)
