"""From a reading of the platform to the replicas of each Deployment: the learned decision,
HPA's rule on the same telemetry, the guard between them, shadow mode and guarded control.

Every `sync_s` (HPA's sync period, 15 s) `Controller.decide(t)`
  1. reads the platform (`TelemetryReader`; or `reading_from_sim` inside the simulator);
  2. computes the rule on that telemetry, the reference of the band, the shadow report and the
     fallback: HPA's (`baselines.HPA.sync`: the autoscaler a platform runs today; `rule`
     "hpa", the default) or the predictive rule's (`rule` "predictive": on platform v2 the best
     rule, the one the guard bounds the learned policy by in evaluation; the replicas
     `baselines.predictive_replicas` sizes for the larger of the monitored rate and the
     reading's seasonal forecast times `rule_margin`, held 300 s);
  3. runs the policy on the observation: the greedy sub-actions (under the policy's own
     observation guard, `apex_bdq.guard`), then per class the replicas the simulator would
     ask for — the plan (`sizing.replicas_for` of the monitored rate x the plan factor) held
     by `sizing.HoldWindow` over 15-s blocks: one definition, shared with the simulator;
  4. guards it: first the policy's own replica bounds (its `GuardConfig`: at least the
     predictive rule's replicas at `floor_margin`, at most at `ceiling_margin`, and at most
     static provisioning's for the past week's peak 5-min rate at `static_ceiling` while the
     monitored load lies within that peak and never below the floor, as in evaluation; a
     reading without the forecast or the peak then falls back), then within
     [rule x (1 - band_below), rule x (1 + band_above)], at most
     max(step_up_pods, step_up_pct %) more and step_down_pct % fewer replicas than now per
     decision, within [min_replicas, max_replicas];
  5. falls back to the rule (or, when the rule's own inputs are missing, to the replicas in
     place: the last applied or the Deployment's spec; with neither there is no decision and
     KEDA's GetMetrics answers UNAVAILABLE, so HPA keeps the replicas) on a query timeout, a missing or stale series, a non-finite value, an
     observation outside what training covered, or a policy error; every fallback is
     counted by reason.
mode "shadow" applies the rule's replicas (what the running autoscaler does) and logs the
policy's beside them; mode "control" applies the guarded learned replicas. Each decision is
one JSON line in `log_path` (the shadow report's input) and updates Prometheus metrics in
`registry` (decision latency histogram, fallback / guard / decision counters, replicas).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from apex_bdq.config import SimConfig
from apex_bdq.features import Scales
from apex_bdq.sim.baselines import predictive_replicas
from apex_bdq.sizing import HoldWindow, SizingTable, replicas_for

IDLE_IN_FLIGHT = 1e-3  # requests in flight (an exponential average) below which a class is idle
FALLBACK_REASONS = ("timeout", "missing", "stale", "query_failed", "not_finite", "out_of_range", "policy_error")
GUARD_KINDS = ("floor", "ceiling", "band", "rate_limit", "bounds")  # what moved a learned decision, in order
RULES = ("hpa", "predictive")


class ControlError(ValueError):
    pass


@dataclass(frozen=True)
class ControlConfig:
    """How learned decisions reach the platform (see the module docstring)."""

    mode: str = "shadow"
    sync_s: float = 15.0
    band_below: float = 0.5
    band_above: float = 1.0
    step_up_pods: int = 4
    step_up_pct: float = 100.0
    step_down_pct: float = 50.0
    min_replicas: int = 1
    max_replicas: int = 200
    hpa_target_utilisation: float = 0.5
    rule: str = "hpa"
    rule_margin: float = 1.2  # the predictive rule's margin (its frontier's default), with rule "predictive"

    def __post_init__(self) -> None:
        def need(ok, msg):
            if not ok:
                raise ControlError(msg)
        need(self.mode in ("shadow", "control"), f"mode must be 'shadow' or 'control', got {self.mode!r}")
        for name in ("sync_s", "step_up_pct", "hpa_target_utilisation"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f"{name} must be > 0, got {v!r}")
        need(0 <= self.band_below < 1, f"band_below must be in [0, 1), got {self.band_below!r}")
        need(self.band_above >= 0, f"band_above must be >= 0, got {self.band_above!r}")
        need(0 <= self.step_down_pct <= 100, f"step_down_pct must be in [0, 100], got {self.step_down_pct!r}")
        need(isinstance(self.step_up_pods, int) and self.step_up_pods >= 0, "step_up_pods must be an int >= 0")
        need(isinstance(self.min_replicas, int) and 0 <= self.min_replicas <= self.max_replicas,
             f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas!r} / {self.max_replicas!r}")
        need(self.hpa_target_utilisation <= 1, "hpa_target_utilisation must be <= 1")
        need(self.rule in RULES, f"rule must be one of {RULES}, got {self.rule!r}")
        need(not isinstance(self.rule_margin, bool) and isinstance(self.rule_margin, (int, float))
             and math.isfinite(self.rule_margin) and self.rule_margin > 0,
             f"rule_margin must be a number > 0, got {self.rule_margin!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "ControlConfig":
        allowed = {f.name for f in dataclasses.fields(cls)}
        bad = set(d) - allowed
        if bad:
            raise ControlError(f"unknown control keys {sorted(bad)}; allowed: {sorted(allowed)}")
        return cls(**d)


def hpa_desired(current: np.ndarray, metric_value: np.ndarray, target: float = 1.0,
                tolerance: float = 0.1) -> np.ndarray:
    """The replicas Kubernetes' HPA sets for an external metric with an AverageValue target
    (what KEDA's ScaledObject creates): ratio = value / (target x current); unchanged within
    the tolerance, else ceil(value / target). From the Kubernetes HPA algorithm details."""
    cur = np.asarray(current, dtype=np.float64)
    val = np.asarray(metric_value, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = val / (target * np.maximum(cur, 1e-12))
    want = np.ceil(val / target - 1e-9)
    keep = (cur > 0) & (np.abs(ratio - 1.0) <= tolerance)
    return np.where(keep, cur, want).astype(np.int64)


class ControllerMetrics:
    """The decision service's Prometheus metrics, in their own registry."""

    def __init__(self, classes) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.decision_s = Histogram("apex_scaler_decision_seconds", "Reading + features + policy + guard, seconds",
                                    buckets=(.002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5), registry=reg)
        self.decisions = Counter("apex_scaler_decisions", "Decisions made", ["mode"], registry=reg)
        self.fallbacks = Counter("apex_scaler_fallbacks", "Decisions that fell back to the rule", ["reason"], registry=reg)
        self.guarded = Counter("apex_scaler_guarded", "Learned replicas the guard moved", ["kind", "class"], registry=reg)
        self.shadow = Counter("apex_scaler_shadow_decisions", "Decisions logged without acting", registry=reg)
        self.replicas = Gauge("apex_scaler_replicas", "Replicas per class", ["class", "source"], registry=reg)
        for r in FALLBACK_REASONS:
            self.fallbacks.labels(r)
        for c in classes:
            for kind in GUARD_KINDS:
                self.guarded.labels(kind, c)


@dataclass
class Decision:
    t: float
    mode: str
    applied: Optional[np.ndarray]  # [K] replicas set (None: nothing to decide on, see the module docstring)
    rule: Optional[np.ndarray]
    learned: Optional[np.ndarray]  # the policy's replicas before the guard
    guarded: Optional[np.ndarray]  # after the guard
    fallback: Optional[str]  # reason, None when the learned decision stood (control) or was computed (shadow)
    problems: list
    levels: dict
    query_s: float
    decide_s: float
    needed: Optional[np.ndarray] = None  # [K] fewest replicas meeting the SLO at the monitored rate (the queueing model)
    in_flight: Optional[np.ndarray] = None  # [K] monitored requests in flight (None: not read)
    floor: Optional[np.ndarray] = None  # [K] the policy guard's replica floor (None: no floor)
    ceiling: Optional[np.ndarray] = None  # [K] its replica ceiling (None: none; int64 max: none for a class)

    def idle(self, k: int) -> bool:
        """Class k has no requests in flight (what scale to zero waits for); unknown: not idle."""
        return self.in_flight is not None and bool(self.in_flight[k] < IDLE_IN_FLIGHT)

    def to_json(self, classes) -> dict:
        def lst(a):
            return None if a is None else [int(x) for x in a]
        return {"t": self.t, "mode": self.mode, "classes": list(classes), "applied": lst(self.applied),
                "rule": lst(self.rule), "learned": lst(self.learned), "guarded": lst(self.guarded),
                "needed": lst(self.needed), "floor": lst(self.floor), "ceiling": lst(self.ceiling),
                "fallback": self.fallback,
                "problems": self.problems[:20],
                "levels": {k: (v if isinstance(v, int) else [int(x) for x in v]) for k, v in self.levels.items()},
                "query_s": round(self.query_s, 6), "decide_s": round(self.decide_s, 6)}


def reading_from_sim(sim, obs, predictive=None):
    """The Reading the simulator's own state gives (shard 0): what the controller decides on
    inside the simulator, to compare with the same decisions on live telemetry. predictive: a
    `baselines.Predictive` reset on `sim`, whose forecast the reading then carries (the input
    of the controller's predictive rule and of the guard's replica floor); None: no forecast."""
    from apex_bdq.telemetry import Reading
    from apex_bdq.sim.platform import Observation
    mon = sim.monitored()
    return Reading(t=float(sim.t), obs=Observation(macro=obs.macro[:1].copy(), micro=obs.micro[:1].copy()),
                   utilisation=mon["utilisation"][0].astype(np.float64), ready=sim.active[0].astype(np.float64),
                   spec=sim.target[0].astype(np.float64), problems=[], query_s=0.0,
                   in_flight=mon["load"][0].astype(np.float64),
                   forecast=None if predictive is None else predictive.forecast(sim)[0].astype(np.float64),
                   peak=sim.lam_table[slice(*sim.rates.train)].max(0).astype(np.float64))


class Controller:
    """Decides the replicas of one service's K classes; thread-safe (`current` serves the
    newest decision, deciding again once it is `sync_s` old)."""

    def __init__(self, sim: SimConfig, policy, ctl: ControlConfig = ControlConfig(),
                 read: Optional[Callable] = None, classes=None, log_path: Optional[str] = None,
                 clock: Callable[[], float] = time.time, metrics: Optional[ControllerMetrics] = None) -> None:
        from apex_bdq.sim.baselines import HPA
        from apex_bdq.sim.platform_v2 import default_action_v2
        if sim.platform != "v2":
            raise ControlError("the controller decides for platform v2 policies")
        self.sim, self.policy, self.ctl, self.read = sim, policy, ctl, read
        self.K = K = sim.num_classes
        self.classes = tuple(classes) if classes is not None else tuple(f"class{k}" for k in range(K))
        self.clock = clock
        self.metrics = metrics or ControllerMetrics(self.classes)
        sc = Scales(sim)
        self.mu = sc.mu.astype(np.float64)
        svc = 1.0 / self.mu
        slo = np.asarray(sim.slo_factor, dtype=np.float64) * svc
        self.sizing = SizingTable.build(svc, slo, [ctl.max_replicas] * K, max(1, ctl.min_replicas))
        self.plan = np.asarray(sim.plan_factors, dtype=np.float64)
        block = ctl.sync_s  # a hold counts sync periods, as the simulator counts 15-s blocks
        self.hold_blocks = np.array([math.ceil(h / block - 1e-9) for h in sim.hold_s], dtype=np.int64)
        d = np.asarray(default_action_v2(sim))
        self.default = {"plan": d[:K].copy(), "hold": d[K:2 * K].copy(), "admission": int(d[-1])}
        self.levels = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in self.default.items()}
        self.hpa = HPA(target_utilisation=ctl.hpa_target_utilisation, period_s=ctl.sync_s)
        self.pred_recs: dict = {}  # margin -> [(t, replicas)] of the predictive rule's last 300 s at that margin
        self.hold: Optional[HoldWindow] = None
        self._hold_t: Optional[float] = None  # time of the hold window's last step
        self.applied: Optional[np.ndarray] = None
        self.last: Optional[Decision] = None
        self._lock = threading.Lock()
        self.log_path = log_path
        self._log = open(log_path, "a", buffering=1) if log_path else None
        self.counts = {r: 0 for r in FALLBACK_REASONS}
        self.counts.update(decisions=0, **{k: 0 for k in GUARD_KINDS})

    def actions(self) -> np.ndarray:
        """[D] the sub-actions in force as the simulator spells them (plan, hold, admission):
        what a replay platform driven by this controller's replicas runs, so that its own
        observation carries the levels the reader tells the policy."""
        return np.concatenate([self.levels["plan"], self.levels["hold"], [self.levels["admission"]]]).astype(np.int64)

    # -- the decision -----------------------------------------------------------------------------
    def current(self, t: Optional[float] = None) -> Decision:
        t = self.clock() if t is None else t
        with self._lock:
            if self.last is None or t - self.last.t >= self.ctl.sync_s - 1e-6:
                self._decide_locked(t, self.read(t, self.levels))
            return self.last

    def decide(self, t: float, reading=None) -> Decision:
        """Decide at time t on `reading` (default: read the platform now)."""
        with self._lock:
            return self._decide_locked(t, reading if reading is not None else self.read(t, self.levels))

    def _guard_margins(self) -> dict:
        """{"floor" / "ceiling": margin} of the policy's replica bounds (its GuardConfig)."""
        guard = getattr(self.policy, "guard", None)
        cfg = getattr(guard, "cfg", None)
        if cfg is None:
            return {}
        return {k: m for k, m in (("floor", cfg.floor_margin), ("ceiling", cfg.ceiling_margin)) if m}

    def _static_u(self) -> float:
        """The policy guard's static ceiling (a target utilisation; 0: none)."""
        cfg = getattr(getattr(self.policy, "guard", None), "cfg", None)
        return float(getattr(cfg, "static_ceiling", 0.0) or 0.0)

    def _predictive(self, reading, margins, t: float) -> dict:
        """{margin: [K] replicas} of the predictive rule at each margin on this reading (one
        sync: `predictive_replicas`, then the highest of those of the last 300 s, HPA's
        scale-down window); {} when the reading lacks its inputs (the monitored requests in
        flight and the forecast)."""
        if reading.in_flight is None or reading.forecast is None:
            return {}
        now = np.maximum(np.asarray(reading.in_flight, dtype=np.float64), 0.0) * self.mu
        fc = np.asarray(reading.forecast, dtype=np.float64)
        if not (np.isfinite(now).all() and np.isfinite(fc).all()):
            return {}
        out = {}
        for m in margins:
            recs = [(tr, r) for tr, r in self.pred_recs.get(m, []) if t - tr < self.hpa.window_s - 1e-6]
            recs.append((t, predictive_replicas(now[None], fc[None], m, self.sizing)[0].astype(np.int64)))
            self.pred_recs[m] = recs
            out[m] = np.max(np.stack([r for _, r in recs]), axis=0)
        return out

    def _learned(self, reading, t: float) -> tuple[Optional[np.ndarray], Optional[str], dict]:
        """(replicas [K], fallback reason or None, levels) of the policy on a good reading."""
        K = self.K
        try:
            actions, _ = self.policy.decide(reading.obs.macro, reading.obs.micro)
        except Exception as e:  # noqa: BLE001 - a policy error falls back, it never stops the scaler
            return None, f"policy_error: {type(e).__name__}: {str(e)[:120]}", self.default
        a = np.asarray(actions)[0]
        levels = {"plan": a[:K].astype(np.int64), "hold": a[K:2 * K].astype(np.int64), "admission": int(a[-1])}
        rate = np.asarray(reading.in_flight, dtype=np.float64) * self.mu
        plan = replicas_for((rate * self.plan[levels["plan"]])[None], self.sizing).astype(np.int32)
        if self.hold is None:
            self.hold = HoldWindow(plan, self.hold_blocks, 1)
        elif self._hold_t is not None:  # periods that passed without a learned decision (fallbacks, gaps)
            for _ in range(min(self.hold.nb, max(0, int(round((t - self._hold_t) / self.ctl.sync_s)) - 1))):
                self.hold.step()
        held = self.hold.target(plan, levels["hold"][None])[0]
        self.hold.step()
        self._hold_t = t
        return held.astype(np.int64), None, levels

    def _decide_locked(self, t: float, reading) -> Decision:
        t_start = time.perf_counter()
        ctl, K, m = self.ctl, self.K, self.metrics
        lo, hi = ctl.min_replicas, ctl.max_replicas
        current = self.applied
        if current is None and reading.spec is not None:
            current = np.asarray(reading.spec, dtype=np.int64)
        # 2. the rule on the same telemetry
        rule = None
        bounds = self._guard_margins()
        margins = set(bounds.values()) | ({ctl.rule_margin} if ctl.rule == "predictive" else set())
        pred = self._predictive(reading, sorted(margins), t)
        if ctl.rule == "predictive":
            if ctl.rule_margin in pred:
                rule = np.clip(pred[ctl.rule_margin], lo, hi)
        elif reading.utilisation is not None and reading.ready is not None:
            if not hasattr(self.hpa, "recs"):
                self.hpa.start(current if current is not None else np.full(K, lo))
            rule = self.hpa.sync(np.asarray(reading.utilisation), np.asarray(reading.ready), lo, hi).copy()
        # 3. the policy
        learned = guarded = None
        fallback = None
        if reading.problems or reading.obs is None:
            kinds = [p.split(":", 1)[0] for p in reading.problems] or ["missing"]
            fallback = next((k for k in FALLBACK_REASONS if k in kinds), kinds[0])
            levels = self.default
        elif (guard := getattr(self.policy, "guard", None)) is not None and not bool(guard.inside(reading.obs.macro)[0]):
            fallback, levels = "out_of_range", self.default
        elif bounds and not all(m in pred for m in bounds.values()):
            fallback, levels = "missing", self.default  # the policy's replica bounds need the forecast
            reading.problems.append("missing:forecast: the guard's replica bounds need the predictive rule's forecast"
                                    + "".join(f"; {p}" for p in reading.forecast_problems[:2]))
        elif self._static_u() and reading.peak is None:
            fallback, levels = "missing", self.default  # the static ceiling needs the past's peak
            reading.problems.append("missing:peak: the guard's static ceiling needs each class's peak rate"
                                    + "".join(f"; {p}" for p in reading.forecast_problems[:2]))
        else:
            learned, fallback, levels = self._learned(reading, t)
            if fallback is not None and fallback.startswith("policy_error"):
                reading.problems.append(fallback)
                fallback = "policy_error"
        # 4. the guard: the policy's replica bounds (as in evaluation), then the band around the rule
        floor = ceiling = None
        if learned is not None:
            g = learned.copy()
            if "floor" in bounds:
                floor = pred[bounds["floor"]]
                raised = np.maximum(g, floor)
                self._count("floor", raised != g)
                g = raised
            if "ceiling" in bounds:
                ceiling = pred[bounds["ceiling"]]
                capped = np.minimum(g, ceiling)
                self._count("ceiling", capped != g)
                g = capped
            if self._static_u():  # static provisioning for the past's peak, as StaticPeak sizes it,
                # while the monitored load lies within that peak (as in evaluation)
                peak = np.asarray(reading.peak, dtype=np.float64) / self.mu  # [K] Erlangs
                within = np.isfinite(peak) & (np.asarray(reading.in_flight, dtype=np.float64) <= peak)
                cap = np.full(K, np.iinfo(np.int64).max, dtype=np.int64)
                cap[within] = np.ceil(peak[within] / self._static_u())
                if floor is not None:  # never below the floor (as in evaluation)
                    cap = np.maximum(cap, floor)
                ceiling = cap if ceiling is None else np.minimum(ceiling, cap)
                capped = np.minimum(g, cap)
                self._count("ceiling", capped != g)
                g = capped
            ref = rule if rule is not None else current
            if ref is not None:
                band_lo = np.floor(ref * (1 - ctl.band_below)).astype(np.int64)
                band_hi = np.ceil(ref * (1 + ctl.band_above)).astype(np.int64)
                banded = np.clip(g, band_lo, band_hi)
                self._count("band", banded != g)
                g = banded
            if current is not None:
                up = np.maximum(np.floor(current * (1 + ctl.step_up_pct / 100.0)), current + ctl.step_up_pods)
                down = np.ceil(current * (1 - ctl.step_down_pct / 100.0))
                limited = np.clip(g, down, up).astype(np.int64)
                self._count("rate_limit", limited != g)
                g = limited
            bounded = np.clip(g, lo, hi)
            self._count("bounds", bounded != g)
            guarded = bounded
        # 5. what is applied
        if fallback is not None:
            applied = rule if rule is not None else current  # None: nothing to hold either
            self.counts[fallback] = self.counts.get(fallback, 0) + 1
            m.fallbacks.labels(fallback).inc()
        elif ctl.mode == "control":
            applied = guarded
        else:
            applied = rule if rule is not None else current
            m.shadow.inc()
        if applied is not None:
            applied = np.asarray(applied, dtype=np.int64)
            self.applied = applied
        # The policy's state in its next observation: its plan and hold (the rule's setting after
        # a fallback); the admission level in force stays the platform's (KEDA sets replicas only).
        self.levels = {"plan": levels["plan"], "hold": levels["hold"], "admission": self.default["admission"]}
        needed = None
        # requests in flight count only on a reading with an observation (what scale to zero trusts)
        in_flight = reading.in_flight if reading.obs is not None else None
        if in_flight is not None and np.isfinite(in_flight).all():
            needed = replicas_for((np.maximum(in_flight, 0.0) * self.mu)[None], self.sizing)[0]
        decide_s = time.perf_counter() - t_start + reading.query_s
        d = Decision(needed=needed, in_flight=None if in_flight is None else np.asarray(in_flight),
                     t=float(t), mode=ctl.mode, applied=applied, rule=rule, learned=learned, guarded=guarded,
                     fallback=fallback, problems=list(reading.problems), levels=levels, query_s=reading.query_s,
                     decide_s=decide_s, floor=floor, ceiling=ceiling)
        self.last = d
        self.counts["decisions"] += 1
        m.decisions.labels(ctl.mode).inc()
        m.decision_s.observe(decide_s)
        for k, c in enumerate(self.classes):
            if applied is not None:
                m.replicas.labels(c, "applied").set(float(applied[k]))
            if rule is not None:
                m.replicas.labels(c, "rule").set(float(rule[k]))
            if guarded is not None:
                m.replicas.labels(c, "learned").set(float(guarded[k]))
        if self._log is not None:
            self._log.write(json.dumps(d.to_json(self.classes)) + "\n")
        return d

    def _count(self, kind: str, moved: np.ndarray) -> None:
        for k in np.nonzero(moved)[0]:
            self.counts[kind] += 1
            self.metrics.guarded.labels(kind, self.classes[k]).inc()

    def close(self) -> None:
        if self._log is not None:
            self._log.flush()
            os.fsync(self._log.fileno())
            self._log.close()
            self._log = None


def read_log(path: str | Path) -> list[dict]:
    """The decisions of a controller's JSON-lines log (a torn last line is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
