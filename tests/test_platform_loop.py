"""Into a real platform: Prometheus -> reader -> policy -> KEDA scaler (gRPC) -> replicas.

The Prometheus tests run Debian's `prometheus` (and `promtool`) for real and skip, naming
the reason, where it is not installed (`.ci/run` installs it); the KEDA side is exercised
by a real gRPC client built from the same .proto.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from apex_bdq.config import GuardConfig, NetConfig, SimConfig
from apex_bdq.control import (FALLBACK_REASONS, ControlConfig, ControlError, Controller, hpa_desired, read_log,
                              reading_from_sim)
from apex_bdq.networks import BDQNetwork
from apex_bdq.replay_platform import PrometheusUnavailable, ReplayPlatform, prometheus_binaries
from apex_bdq.serving import Policy
from apex_bdq.sim.platform_v2 import MICRO_FEATURES_V2, macro_names
from apex_bdq.telemetry import Reading, TelemetryConfig, TelemetryError, TelemetryReader

CFG = SimConfig()


def _have_prometheus() -> str:
    try:
        prometheus_binaries()
        return ""
    except PrometheusUnavailable as e:
        return str(e)


needs_prometheus = pytest.mark.skipif(bool(_have_prometheus()), reason=_have_prometheus() or "-")


def random_policy(seed: int = 0, guard=None) -> Policy:
    import torch
    torch.manual_seed(seed)
    return Policy(BDQNetwork(NetConfig.for_sim(CFG)).eval(), 0, "random-test", guard=guard)


def telemetry_for(p: ReplayPlatform, url: str, **kw) -> TelemetryConfig:
    return TelemetryConfig(url=url, classes=tuple(p.classes), deployments=tuple(f"shop-{c}" for c in p.classes),
                           selector='service="shop"', clock_offset_s=p.clock_offset_s, **kw)


# -- without Prometheus ---------------------------------------------------------------------------
def test_hpa_desired_follows_the_hpa_formula():
    cur = np.array([10, 10, 10, 0, 4])
    val = np.array([10.0, 10.9, 12.0, 3.0, 1.0])
    # within 10 % of the current: unchanged; beyond: ceil(value / target); from zero: the value
    assert hpa_desired(cur, val).tolist() == [10, 10, 12, 3, 1]
    assert hpa_desired(cur, val, tolerance=0.0).tolist() == [10, 11, 12, 3, 1]
    assert hpa_desired(np.array([4]), np.array([9.0]), target=2.0).tolist() == [5]


def test_bad_telemetry_and_control_configs_are_named():
    with pytest.raises(TelemetryError, match="url"):
        TelemetryConfig(url="localhost:9090", classes=("a",), deployments=("a",))
    with pytest.raises(TelemetryError, match="one entry per class"):
        TelemetryConfig(url="http://x", classes=("a", "b"), deployments=("a",))
    with pytest.raises(TelemetryError, match="unknown telemetry keys"):
        TelemetryConfig.from_dict({"url": "http://x", "classes": ["a"], "deployments": ["a"], "lag": 3})
    with pytest.raises(TelemetryError, match="policy has 4"):
        TelemetryReader(TelemetryConfig(url="http://x", classes=("a",), deployments=("a",)), CFG)
    with pytest.raises(ControlError, match="mode"):
        ControlConfig(mode="auto")
    with pytest.raises(ControlError, match="band_below"):
        ControlConfig(band_below=1.5)
    with pytest.raises(ControlError, match="unknown control keys"):
        ControlConfig.from_dict({"modee": "shadow"})


def _sim_reading(seed=3, ticks=200):
    p = ReplayPlatform(CFG, seed=seed)
    for _ in range(ticks):
        p.step()
    return p, reading_from_sim(p.sim, p.obs)


def test_controller_guards_the_learned_replicas():
    class Greedy:  # always the largest plan factor and the longest hold: far above the rule
        guard = None

        def decide(self, macro, micro):
            return np.full((1, CFG.num_branches), CFG.sub_actions - 1) * np.r_[np.ones(2 * CFG.num_classes), 0], None

    p, r = _sim_reading()
    ctl = ControlConfig(mode="control", band_below=0.1, band_above=0.05, step_up_pods=1, step_up_pct=5.0)
    c = Controller(CFG, Greedy(), ctl, classes=p.classes)
    d = c.decide(0.0, r)
    assert d.fallback is None and d.rule is not None
    cur = r.spec.astype(np.int64)
    assert (d.guarded <= d.learned).all() and (d.guarded < d.learned).any()
    # within the band around the rule and within one step of what is in place
    assert (d.guarded <= np.ceil(d.rule * 1.05)).all()
    assert (d.guarded <= np.maximum(np.floor(cur * 1.05), cur + 1)).all()
    assert (d.applied == d.guarded).all()
    assert c.counts["band"] + c.counts["rate_limit"] > 0
    text = _exposition(c)
    assert 'apex_scaler_guarded_total{class="class0",kind="band"}' in text


def _exposition(c: Controller) -> str:
    from prometheus_client import generate_latest
    return generate_latest(c.metrics.registry).decode()


def test_shadow_mode_applies_the_rule_and_logs_the_policy(tmp_path):
    p, r = _sim_reading()
    log = tmp_path / "shadow.jsonl"
    c = Controller(CFG, random_policy(), ControlConfig(mode="shadow"), classes=p.classes, log_path=str(log))
    d1 = c.decide(0.0, r)
    p.step()
    d2 = c.decide(15.0, reading_from_sim(p.sim, p.obs))
    c.close()
    for d in (d1, d2):
        assert d.fallback is None and d.learned is not None
        assert (d.applied == d.rule).all()
    rows = read_log(log)
    assert [row["t"] for row in rows] == [0.0, 15.0]
    assert rows[0]["applied"] == d1.rule.tolist() and rows[0]["learned"] == d1.learned.tolist()
    assert "apex_scaler_shadow_decisions_total 2.0" in _exposition(c)


def test_every_fallback_path_falls_back_to_the_rule_and_is_counted():
    from apex_bdq.guard import NF, Guard
    p, good = _sim_reading()
    ctl = ControlConfig(mode="control")

    def bad(problem, keep_rule=True):
        return Reading(t=0.0, obs=None, utilisation=good.utilisation if keep_rule else None,
                       ready=good.ready if keep_rule else None, spec=good.spec, problems=[problem], query_s=0.0)

    for reason in ("timeout", "missing", "stale", "query_failed", "not_finite"):
        c = Controller(CFG, random_policy(), ctl, classes=p.classes)
        d = c.decide(0.0, bad(f"{reason}:x:class0"))
        assert d.fallback == reason and d.learned is None
        assert (d.applied == d.rule).all()
        assert c.counts[reason] == 1
        assert f'apex_scaler_fallbacks_total{{reason="{reason}"}} 1.0' in _exposition(c)
    # the rule's own inputs missing too: the replicas in place (the Deployment's spec) are held
    c = Controller(CFG, random_policy(), ctl, classes=p.classes)
    d = c.decide(0.0, bad("missing:ready:class0", keep_rule=False))
    assert d.rule is None and (d.applied == good.spec.astype(np.int64)).all()
    # ... and with no replica count known at all, no decision (KEDA is told UNAVAILABLE)
    c = Controller(CFG, random_policy(), ctl, classes=p.classes)
    nothing = Reading(t=0.0, obs=None, utilisation=None, ready=None, spec=None, problems=["timeout:spec: x"],
                      query_s=0.0)
    d = c.decide(0.0, nothing)
    assert d.applied is None and d.fallback == "timeout" and c.applied is None
    # out of range: coverage that no load shape lies in
    K = CFG.num_classes
    narrow = Guard.build(GuardConfig(ood_margin=0.0), CFG, np.full(NF * K, 100.0), np.full(NF * K, 101.0))
    c = Controller(CFG, random_policy(guard=narrow), ctl, classes=p.classes)
    d = c.decide(0.0, good)
    assert d.fallback == "out_of_range" and (d.applied == d.rule).all()

    class Broken:
        guard = None

        def decide(self, macro, micro):
            raise RuntimeError("weights gone")

    c = Controller(CFG, Broken(), ctl, classes=p.classes)
    d = c.decide(0.0, good)
    assert d.fallback == "policy_error" and any("weights gone" in x for x in d.problems)
    assert set(FALLBACK_REASONS) >= {"timeout", "missing", "stale", "query_failed", "not_finite", "out_of_range",
                                     "policy_error"}


def test_is_active_scales_an_idle_class_to_zero_only_where_allowed():
    from apex_bdq.keda_scaler import ScalerServer, client
    p, r = _sim_reading()
    r.in_flight = r.in_flight.copy()
    r.in_flight[3] = 0.0  # class3 idle
    c = Controller(CFG, random_policy(), ControlConfig(mode="control"), read=lambda t, lv: r, classes=p.classes,
                   clock=lambda: 0.0)
    srv = ScalerServer(c, loop=False)
    stub, pb, channel = client(f"127.0.0.1:{srv.port}")
    try:
        def active(cls, allow):
            md = {"class": cls, **({"allowZero": "true"} if allow else {})}
            return stub.IsActive(pb.ScaledObjectRef(name=cls, namespace="default", scalerMetadata=md)).result
        assert active("class3", True) is False
        assert active("class3", False) is True
        assert active("class0", True) is True
        stream = stub.StreamIsActive(pb.ScaledObjectRef(name="class3", namespace="default",
                                                        scalerMetadata={"class": "class3", "allowZero": "true"}))
        assert next(stream).result is False
        stream.cancel()
    finally:
        channel.close()
        srv.stop()


# -- with a real Prometheus ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replay():
    if _have_prometheus():
        pytest.skip(_have_prometheus())
    from apex_bdq.replay_platform import ReplayLoop
    p = ReplayPlatform(CFG, seed=1)
    loop = ReplayLoop(p, horizon_ticks=400)
    yield p, loop
    loop.close()


@needs_prometheus
@pytest.mark.slow
def test_reader_builds_the_simulators_observation_from_prometheus(replay):
    from apex_bdq.sim.baselines import Predictive
    p, loop = replay
    rd = TelemetryReader(telemetry_for(p, loop.url, stale_s=5), p.cfg)
    forecaster = Predictive()
    forecaster.reset(p.sim)
    try:
        first = rd.read(p.now)  # no live history yet: counters and gauges of the last minutes are missing
        assert not first.ok and any(x.startswith("missing:") for x in first.problems)
        while p.tick < 200:
            loop.step()
        names = np.array(macro_names(CFG))
        coarse = np.array(["rate_block" in n for n in names])
        for _ in range(3):
            r = rd.read(p.now)
            assert r.ok, r.problems
            a, b = r.obs.macro[0], p.obs.macro[0]
            # History before the replay: the trace's mean over a block vs the simulator's
            # sample at its middle; every other macro feature matches closely.
            assert np.abs(a - b)[coarse].max() < 0.05 * max(1.0, np.abs(b[coarse]).max()), names[coarse]
            err = np.abs(a - b)[~coarse]
            assert err.max() < 0.02, (names[~coarse][np.argmax(err)], err.max())
            ma, mb = r.obs.micro[0], p.obs.micro[0]
            exact = [i for i, f in enumerate(MICRO_FEATURES_V2) if f != "p99_over_slo"]
            np.testing.assert_allclose(ma[..., exact], mb[..., exact], rtol=1e-4, atol=1e-4)
            # The predictive rule's forecast from last week's series in Prometheus (rates over
            # 60 s at 15-s steps) against the simulator's (the trace's rate tick by tick).
            fc = forecaster.forecast(p.sim)[0]
            assert fc.min() > 0
            np.testing.assert_allclose(r.forecast, fc, rtol=0.05)
            # The static ceiling's peak: the highest 5-min rate of the past week (backfilled a
            # sample a minute) against the trace's 5-min means.
            a = max(p.W0, p.now - 7 * 86400)
            c = np.cumsum(p.rates.rates[a - p.W0:p.now - p.W0].astype(np.float64), axis=0)
            np.testing.assert_allclose(r.peak, ((c[300:] - c[:-300]) / 300).max(0), rtol=0.05)
            p99 = MICRO_FEATURES_V2.index("p99_over_slo")
            assert np.median(np.abs(ma[..., p99] - mb[..., p99])) < 0.1  # interpolated within histogram buckets
            for _ in range(37):
                loop.step()
    finally:
        rd.close()


@needs_prometheus
@pytest.mark.slow
def test_reader_reports_stale_series_timeouts_and_bad_queries(replay):
    p, loop = replay
    while p.tick < 150:
        loop.step()
    bad_cases = [
        (telemetry_for(p, loop.url, stale_s=5), p.now + 30, "stale:"),  # nothing scraped for 30 s
        (telemetry_for(p, loop.url, timeout_s=1e-6), p.now, "timeout:"),
        (TelemetryConfig(url=loop.url, classes=("class0", "class1", "class2", "nope"),
                         deployments=tuple(f"shop-{c}" for c in p.classes), selector='service="shop"'),
         p.now, "missing:"),
        (TelemetryConfig(url=loop.url, classes=tuple(p.classes), deployments=tuple(f"shop-{c}" for c in p.classes),
                         selector='service=~"('), p.now, "query_failed:"),
    ]
    for tel, t, want in bad_cases:
        rd = TelemetryReader(tel, p.cfg)
        try:
            r = rd.read(t)
        finally:
            rd.close()
        assert r.obs is None and any(x.startswith(want) for x in r.problems), (want, r.problems[:4])
        if want == "missing:":
            assert any(x.endswith(":nope") for x in r.problems)


@needs_prometheus
@pytest.mark.slow
def test_keda_closed_loop_follows_the_simulators_decisions(tmp_path):
    """Prometheus -> reader -> policy -> KEDA scaler (real gRPC client) -> HPA's formula ->
    the replaying platform, over 7.5 minutes of a held-out day; the same policy decided on
    the simulator's own state gives nearly the same replica curve."""
    import grpc
    from prometheus_client import generate_latest

    from apex_bdq.keda_scaler import ScalerServer, client
    from apex_bdq.replay_platform import ReplayLoop
    warm, n, sync = 150, 450, 15
    policy = random_policy(seed=7)
    log = tmp_path / "decisions.jsonl"

    p = ReplayPlatform(CFG, seed=5)
    live, answered = [], []
    with ReplayLoop(p, horizon_ticks=warm + n + 10) as loop:
        rd = TelemetryReader(telemetry_for(p, loop.url, stale_s=5), p.cfg)
        ctl = Controller(p.cfg, policy, ControlConfig(mode="control"), read=rd.read, classes=p.classes,
                         clock=lambda: p.now, log_path=str(log))
        srv = ScalerServer(ctl, loop=False)
        stub, pb, channel = client(f"127.0.0.1:{srv.port}")
        try:
            refs = [pb.ScaledObjectRef(name=f"shop-{c}", namespace="default", scalerMetadata={"class": c})
                    for c in p.classes]
            specs = [stub.GetMetricSpec(r).metricSpecs[0] for r in refs]
            assert [s.metricName for s in specs] == [f"apex-bdq-{c}" for c in p.classes]
            assert all(s.targetSize == 1 and s.targetSizeFloat == 1.0 for s in specs)
            with pytest.raises(grpc.RpcError) as e:
                stub.GetMetricSpec(pb.ScaledObjectRef(name="x", namespace="default", scalerMetadata={"class": "zz"}))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "zz" in e.value.details()
            for _ in range(warm):
                loop.step()
            reps = None
            for i in range(n):
                if i % sync == 0:
                    vals = [stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=r, metricName=s.metricName))
                            .metricValues[0].metricValueFloat for r, s in zip(refs, specs)]
                    answered.append([int(v) for v in vals])
                    reps = hpa_desired(p.sim.target[0], np.array(vals), specs[0].targetSizeFloat)
                    live.append(reps.copy())
                loop.step(actions=ctl.actions(), replicas=reps)
            assert stub.IsActive(refs[0]).result is True
            stream = stub.StreamIsActive(refs[1])
            assert next(stream).result is True
            stream.cancel()
            metrics = generate_latest(ctl.metrics.registry).decode()
        finally:
            channel.close()
            srv.stop()
            rd.close()
    # one decision per sync period of the loop, one more for IsActive a period after the last
    assert ctl.counts["decisions"] == n // sync + 1 and all(ctl.counts[r] == 0 for r in FALLBACK_REASONS)
    assert "apex_scaler_decision_seconds_bucket" in metrics and 'apex_scaler_decisions_total{mode="control"}' in metrics
    rows = read_log(log)
    assert len(rows) == n // sync + 1 and all(r["fallback"] is None for r in rows)
    assert [r["applied"] for r in rows[:-1]] == answered  # what KEDA was told is what the log says

    # The same policy on the simulator's own state, same arrivals (same seed), same cadence.
    q = ReplayPlatform(CFG, seed=5)
    ref_ctl = Controller(q.cfg, policy, ControlConfig(mode="control"), classes=q.classes)
    for _ in range(warm):
        q.step()
    sim_curve = []
    for i in range(n):
        if i % sync == 0:
            d = ref_ctl.decide(float(q.tick), reading_from_sim(q.sim, q.obs))
            reps = hpa_desired(q.sim.target[0], d.applied.astype(float))
            sim_curve.append(reps.copy())
        q.step(actions=ref_ctl.actions(), replicas=reps)
    a, b = np.array(live), np.array(sim_curve)
    rel = np.abs(a - b) / np.maximum(b, 1)
    (tmp_path / "curves.json").write_text(json.dumps({"live": a.tolist(), "sim": b.tolist()}))
    assert rel.mean() < 0.08 and (a == b).mean() > 0.5, (rel.mean(), (a == b).mean())


@needs_prometheus
@pytest.mark.slow
def test_scaler_bench_reports_each_stage_and_the_hpa_share():
    from launch.bench_scaler import bench_scaler
    r = bench_scaler(decisions=8, checkpoint=None)
    stages = ("reading", "policy_guard", "answer", "decision", "cached_answer")
    assert all(r[f"{s}_ms_p50"] > 0 and r[f"{s}_ms_p99"] >= r[f"{s}_ms_p50"] for s in stages)
    # the stages add up to the end-to-end figure at the median (each measured on its own clock)
    parts = r["reading_ms_p50"] + r["policy_guard_ms_p50"] + r["answer_ms_p50"]
    assert abs(parts - r["decision_ms_p50"]) < 0.25 * r["decision_ms_p50"]
    assert r["hpa_sync_share_p99"] == pytest.approx(r["decision_ms_p99"] / 15e3)
    assert r["queries_per_decision"] >= 15


def test_counters_are_differenced_per_series_before_the_sum():
    """A pod's counter that restarts (or a pod that goes away) is a reset of its own series:
    the class's per-tick increase is the sum of each series' increases, not a difference of
    sums (which would read the whole remaining total as one tick's arrivals)."""
    rd = TelemetryReader(TelemetryConfig(url="http://127.0.0.1:9", classes=("a", "b", "c", "d"),
                                         deployments=("a", "b", "c", "d")), CFG)
    try:
        times = np.arange(100, 106)
        pod1 = [1000, 1010, 1020, 3, 13, 23]  # restarts after t=102
        pod2 = [5000, 5005, 5010, 5015, None, None]  # goes away after t=103
        data = {"result": [
            {"metric": {"class": "a", "pod": "1"}, "values": [[int(t), str(v)] for t, v in zip(times, pod1)]},
            {"metric": {"class": "a", "pod": "2"}, "values": [[int(t), str(v)] for t, v in zip(times, pod2) if v]},
        ]}
        inc = rd._increments(data, times)
        assert inc[0].tolist() == [15.0, 15.0, 8.0, 10.0, 10.0]
        assert 1 not in inc  # class b has no series: missing, not zero
    finally:
        rd.close()


def test_a_failed_query_still_leaves_the_rule_its_inputs(monkeypatch):
    """Only the seasonal query times out: no observation (the policy cannot decide), but HPA's
    rule still gets utilisation, ready replicas and the spec, so the controller falls back to
    the rule, not to holding."""
    p, r = _sim_reading()
    rd = TelemetryReader(TelemetryConfig(url="http://127.0.0.1:9", classes=tuple(p.classes),
                                         deployments=tuple(p.classes)), CFG)
    rd.close()
    t = 1_000_000
    qs = rd.queries(t)
    K = CFG.num_classes

    def answer(name):
        kind, _, kube, params = qs[name]
        label = "deployment" if kube else "class"
        names = p.classes
        if kind == "q":
            return {"result": [{"metric": {label: n}, "value": [t, "1.0"]} for n in names]}
        steps = np.arange(params["start"], params["end"] + 1, params["step"])
        series = [{"metric": {label: n}, "values": [[int(s), str(float(i + 1))] for i, s in enumerate(steps)]}
                  for n in names]
        return {"result": series}

    res = {n: answer(n) for n in qs if not n.startswith("season_7d")}
    problems = [f"timeout:{n}: deadline" for n in qs if n.startswith("season_7d")]
    reading = rd._assemble(t, qs, res, {"plan": np.zeros(K, int), "hold": np.zeros(K, int), "admission": 0},
                           problems, 0.0, 0.0, {n for n in qs if n.startswith("season_7d")})
    assert reading.obs is None and reading.utilisation is not None and reading.spec is not None
    c = Controller(CFG, random_policy(), ControlConfig(mode="control"), classes=p.classes)
    d = c.decide(0.0, reading)
    assert d.fallback == "timeout" and d.rule is not None and (d.applied == d.rule).all()
    # ... and the predictive rule its own (requests in flight, the forecast), but scale to
    # zero does not trust a reading without an observation
    assert reading.in_flight is not None and reading.forecast is not None
    c = Controller(CFG, random_policy(), ControlConfig(mode="control", rule="predictive"), classes=p.classes)
    d = c.decide(0.0, reading)
    assert d.fallback == "timeout" and d.rule is not None and d.in_flight is None and not d.idle(0)
    levels = {"plan": np.zeros(K, int), "hold": np.zeros(K, int), "admission": 0}

    def assemble_failing(names):
        res = {n: answer(n) for n in qs if n not in names}
        return rd._assemble(t, qs, res, levels, [f"timeout:{n}: deadline" for n in names], 0.0, 0.0, set(names))
    # A failed freshness query: the predictive rule's inputs are not trusted either.
    r2 = assemble_failing({"age_app"})
    assert r2.obs is None and r2.in_flight is None and r2.forecast is None
    # A failed forecast query does not stop the observation: the policy decides, and only a
    # policy whose guard needs the forecast (a replica floor) falls back, naming the query.
    r3 = assemble_failing({"fc_peak_7d"})
    assert r3.ok and r3.forecast is None and r3.forecast_problems[0].startswith("timeout:fc_peak_7d")
    assert Controller(CFG, random_policy(), ControlConfig(mode="control"), classes=p.classes).decide(
        0.0, r3).fallback is None
    from apex_bdq.guard import NF, Guard
    wide = Guard.build(GuardConfig(floor_margin=1.1), CFG, np.full(NF * K, -1e9), np.full(NF * K, 1e9))
    d = Controller(CFG, random_policy(guard=wide), ControlConfig(mode="control"), classes=p.classes).decide(0.0, r3)
    assert d.fallback == "missing" and d.learned is None and any("fc_peak_7d" in x for x in d.problems)
    # Forecast per class: a week back where it is there, else a day back, else none (0).
    res = {n: answer(n) for n in qs}
    res["fc_peak_7d"] = {"result": [{"metric": {"class": p.classes[0]}, "value": [t, "5.0"]}]}
    r4 = rd._assemble(t, qs, res, levels, [], 0.0, 0.0, set())
    res["fc_peak_1d"] = {"result": []}
    r5 = rd._assemble(t, qs, res, levels, [], 0.0, 0.0, set())
    assert r4.ok and r4.forecast[0] == 5 * r4.forecast[1] > 0 and (r4.forecast[1:] == r4.forecast[1]).all()
    assert r5.forecast[0] == r4.forecast[0] and (r5.forecast[1:] == 0).all()
    # The static ceiling's peak: its own query; a failed one leaves the forecast, and only a
    # policy whose guard has the ceiling falls back; a class without a series has no ceiling.
    assert (r4.peak == 1.0).all()
    r6 = assemble_failing({"fc_history_peak"})
    assert r6.ok and r6.peak is None and r6.forecast is not None
    assert r6.forecast_problems[0].startswith("timeout:fc_history_peak")
    capped = Guard.build(GuardConfig(floor_margin=0.0, static_ceiling=0.75), CFG, np.full(NF * K, -1e9),
                         np.full(NF * K, 1e9))
    d = Controller(CFG, random_policy(guard=capped), ControlConfig(mode="control"), classes=p.classes).decide(0.0, r6)
    assert d.fallback == "missing" and any("fc_history_peak" in x for x in d.problems)
    assert Controller(CFG, random_policy(guard=wide), ControlConfig(mode="control"), classes=p.classes).decide(
        0.0, dataclasses.replace(r4, peak=None)).fallback == "missing"  # the default guard has the ceiling
    res["fc_history_peak"] = {"result": [{"metric": {"class": p.classes[0]}, "value": [t, "2.0"]}]}
    r7 = rd._assemble(t, qs, res, levels, [], 0.0, 0.0, set())
    assert r7.peak[0] == 2.0 and np.isnan(r7.peak[1:]).all()


def test_the_controllers_predictive_rule_is_the_simulators():
    """rule "predictive": on the simulator's own readings (its forecast carried by the
    reading) the controller's rule asks, sync by sync, for exactly the replicas the
    simulator's predictive rule sets; bad settings are named."""
    from apex_bdq.sim.baselines import Predictive
    p = ReplayPlatform(CFG, seed=2)
    sim_rule, forecaster = Predictive(), Predictive()
    sim_rule.reset(p.sim)
    forecaster.reset(p.sim)
    c = Controller(CFG, random_policy(), ControlConfig(rule="predictive", max_replicas=10_000), classes=p.classes)
    syncs = 0
    for _ in range(900):
        _, reps = sim_rule.act(p.sim, p.obs)
        if p.sim.t % 15 == 0:
            d = c.decide(float(p.sim.t), reading_from_sim(p.sim, p.obs, forecaster))
            np.testing.assert_array_equal(d.rule, reps[0])
            assert (d.applied == d.rule).all()  # shadow mode applies the rule
            syncs += 1
        p.step(replicas=reps[0])
    assert syncs == 60 and forecaster.forecast(p.sim)[0].min() > 0  # a forecast from last week's history
    # without the forecast the predictive rule has no inputs: the replicas in place are held
    d = c.decide(1e4, reading_from_sim(p.sim, p.obs))
    assert d.rule is None and d.fallback is None
    for bad, msg in (({"rule": "vpa"}, "rule must be one of"), ({"rule_margin": 0}, "rule_margin"),
                     ({"rule_margin": float("nan")}, "rule_margin")):
        with pytest.raises(ControlError, match=msg):
            ControlConfig(**bad)


def test_the_policys_replica_floor_holds_behind_the_controller(tmp_path):
    """The guard's replica floor (the predictive rule at `floor_margin`, as in evaluation)
    bounds the learned replicas in the controller too, is counted, logged, and needs the
    forecast: a reading without it falls back to the rule."""
    from apex_bdq.guard import NF, Guard
    from apex_bdq.sim.baselines import Predictive, predictive_replicas
    K = CFG.num_classes
    wide = Guard.build(GuardConfig(floor_margin=1.1), CFG, np.full(NF * K, -1e9), np.full(NF * K, 1e9))

    class Lowest:  # the smallest plan factor and no hold: below what the rules ask for
        guard = wide

        def decide(self, macro, micro):
            return np.zeros((1, CFG.num_branches), dtype=np.int64), None

    p = ReplayPlatform(CFG, seed=3)
    forecaster = Predictive()
    forecaster.reset(p.sim)
    for _ in range(200):
        p.step()
    r = reading_from_sim(p.sim, p.obs, forecaster)
    log = tmp_path / "decisions.jsonl"
    c = Controller(CFG, Lowest(), ControlConfig(mode="control", band_below=0.9, step_down_pct=100.0),
                   classes=p.classes, log_path=str(log))
    d = d0 = c.decide(0.0, r)
    assert d.fallback is None and d.floor is not None
    floor = predictive_replicas(r.in_flight[None] * c.mu[None], r.forecast[None], 1.1, c.sizing)[0]
    np.testing.assert_array_equal(d.floor, floor)
    # the floor comes first; the band (down to 10 % of HPA's) and the step limit (-100 %) here leave it be
    assert (d.learned < d.floor).any() and (d.guarded >= d.floor).all()
    assert c.counts["floor"] == int((d.learned < d.floor).sum()) > 0
    assert 'apex_scaler_guarded_total{class="class0",kind="floor"}' in _exposition(c)
    d = c.decide(15.0, reading_from_sim(p.sim, p.obs))  # no forecast: no floor to keep, so the rule
    assert d.fallback == "missing" and d.learned is None and (d.applied == d.rule).all()
    assert any("forecast" in x for x in d.problems)
    c.close()
    # the shadow report counts the class-decisions the floor raised (of those with a floor)
    from launch.shadow_report import summarise
    rows = read_log(log)
    assert rows[0]["floor"] == floor.tolist() and rows[1]["floor"] is None
    per = summarise(rows)[0]["per_class"]
    assert [v["floor_raised_share"] for v in per.values()] == [float(x) for x in (d0.learned < floor)]


def test_the_static_ceiling_holds_behind_the_controller(tmp_path):
    """The guard's static ceiling (`static_ceiling`) in serving: each class keeps at most the
    replicas static provisioning asks for on the reading's peak rate, sized as the simulator's
    `StaticPeak` sizes them, never below the floor; it is counted; a reading without the peak
    falls back, naming it."""
    from apex_bdq.guard import NF, Guard
    from apex_bdq.sim.baselines import Predictive, StaticPeak
    K = CFG.num_classes
    wide = Guard.build(GuardConfig(floor_margin=0.0, static_ceiling=0.9), CFG, np.full(NF * K, -1e9),
                       np.full(NF * K, 1e9))

    class Highest:  # the largest plan factor and the longest hold: above what the rules ask for
        guard = wide

        def decide(self, macro, micro):
            return np.full((1, CFG.num_branches), CFG.sub_actions - 1, dtype=np.int64), None

    p = ReplayPlatform(CFG, seed=3)
    for _ in range(200):
        p.step()
    ctl = ControlConfig(mode="control", band_below=0.99, band_above=100.0, step_up_pct=1000.0, step_up_pods=1000,
                        step_down_pct=100.0)
    log = tmp_path / "decisions.jsonl"
    c = Controller(CFG, Highest(), ctl, classes=p.classes, log_path=str(log))
    static = StaticPeak(target_utilisation=0.9)
    static.reset(p.sim)
    r = reading_from_sim(p.sim, p.obs)
    d = c.decide(0.0, r)  # the simulator's own training-days peak: the evaluation's ceiling
    within = r.in_flight <= r.peak / c.mu
    assert d.fallback is None and (d.guarded <= np.maximum(static.servers[0], CFG.min_servers))[within].all()
    at = dataclasses.replace(r, peak=r.in_flight * c.mu * 1.0001)  # a past whose peak is the load of the moment
    cap = np.ceil(at.peak / c.mu / 0.9)
    d = c.decide(15.0, at)
    assert (d.learned > cap).all()  # the highest plan asks for ~1.75x the load, the ceiling ~1.1x
    np.testing.assert_array_equal(d.guarded, np.maximum(cap, ctl.min_replicas))
    assert c.counts["ceiling"] >= K
    np.testing.assert_array_equal(d.ceiling, cap)
    assert d.to_json(p.classes)["ceiling"] == cap.astype(int).tolist() and d.floor is None
    n = c.counts["ceiling"]
    d = c.decide(30.0, dataclasses.replace(r, peak=r.in_flight * c.mu * 0.99))  # a load above the past's peak
    assert (d.guarded == d.learned).all() and c.counts["ceiling"] == n  # lifts the ceiling
    d = c.decide(45.0, dataclasses.replace(r, peak=None))
    assert d.fallback == "missing" and d.learned is None and any("peak" in x for x in d.problems)
    c.close()
    floored = Guard.build(GuardConfig(floor_margin=3.0, static_ceiling=0.9), CFG, np.full(NF * K, -1e9),
                          np.full(NF * K, 1e9))

    class HighestFloored(Highest):
        guard = floored

    c3 = Controller(CFG, HighestFloored(), ctl, classes=p.classes)
    fc = Predictive()
    fc.reset(p.sim)
    # a floor (3x the forecast) above the static ceiling (~1.1x the load) wins
    d = c3.decide(0.0, dataclasses.replace(at, problems=[], forecast=fc.forecast(p.sim)[0].astype(np.float64)))
    assert d.fallback is None, (d.fallback, d.problems)
    assert (d.floor > cap).all() and (d.ceiling == d.floor).all()
    np.testing.assert_array_equal(d.guarded, np.clip(d.floor, ctl.min_replicas, ctl.max_replicas))
    assert c3.counts["ceiling"] == 0 and c3.counts["floor"] >= K
    c3.close()
    from launch.shadow_report import summarise  # the report counts the class-decisions the ceiling lowered
    rows = read_log(log)
    per = summarise(rows)[0]["per_class"]
    assert rows[3]["ceiling"] is None
    learned, ceiling = (np.array([r[x] for r in rows[:3]], dtype=np.float64) for x in ("learned", "ceiling"))
    assert [v["ceiling_lowered_share"] for v in per.values()] == (learned > ceiling).mean(0).tolist()
