"""Rule-based controllers that practitioners run today, as baselines for the learned policy,
and the references a policy is judged against (the oracle).

Each baseline acts on a simulator through the same step() as a learned policy, reading only
what a real controller reads: the lagged monitored signals (`sim.monitored()`), the replica
counts it asked for and sees ready, and for the admission rule the local queue. Capacity
rules set replicas directly (`capacity_target`, one column per pool); the other branches
stay at the platform defaults.

On platform v2 every capacity rule runs one controller per class (one HPA per Deployment);
on v1 the rules control the one shared pool. The predictive rule and the oracle size with
the queueing model (`apex_bdq.sizing`) and exist on v2 only.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from typing import Optional, Protocol

import numpy as np

from apex_bdq.config import SimConfig
from apex_bdq.sizing import replicas_for


class Policy(Protocol):
    name: str

    def reset(self, sim) -> None: ...

    def act(self, sim, obs) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """Return (actions [S, D], capacity_target [S, P], `CapacityBounds` around the branches'
        target (v2), or None)."""


def default_action(cfg: SimConfig) -> tuple[int, ...]:
    """The platform's default setting, one sub-action per branch. v2: the middle plan factor
    and HPA's 300-s hold on every class, admit everything; v1: the middle capacity tier,
    proportional class shares, admit everything, full speed."""
    if cfg.platform == "v2":
        from apex_bdq.sim.platform_v2 import default_action_v2
        return default_action_v2(cfg)
    D, n = cfg.num_branches, cfg.sub_actions
    return tuple([n // 2] * (D - 2) + [0, n - 1])


def default_actions(sim) -> np.ndarray:
    """`default_action` for every shard [S, D]."""
    a = np.empty((sim.S, sim.D), dtype=np.int64)
    a[:] = default_action(sim.cfg)
    return a


def _require_shared(sim, name: str) -> None:
    if sim.cfg.platform == "v1" and sim.P != 1:
        raise ValueError(f"the {name} baseline controls one shared capacity pool on platform v1; "
                         f"this config has per_class_capacity=True ({sim.P} pools)")


def _require_v2(sim, name: str) -> None:
    if sim.cfg.platform != "v2":
        raise ValueError(f"the {name} rule sizes each class's pool with the queueing model: it needs "
                         f"sim.platform='v2', got {sim.cfg.platform!r}")


def per_shard(value, S: int, name: str):
    """A rule's setting for every shard: a number stays a number; a sequence of G settings
    (a sweep run side by side, `evaluation.evaluate_groups`) becomes [S, 1], group-major."""
    v = np.asarray(value, dtype=np.float64)
    if v.ndim == 0:
        return float(v)
    if v.ndim != 1 or len(v) == 0 or S % len(v):
        raise ValueError(f"{name} must be a number or one value per group of shards ({S} shards), got {value!r}")
    return np.repeat(v, S // len(v))[:, None]


def _check_range(value, lo_open: float, hi: float, name: str) -> None:
    v = np.asarray(value, dtype=np.float64)
    if v.size == 0 or not np.all((v > lo_open) & (v <= hi)):
        raise ValueError(f"{name} must be in ({lo_open:g}, {hi:g}], got {value!r}")


def _pool_utilisation(sim) -> np.ndarray:
    """[S, P] monitored utilisation of each pool (v1: the shared pool, P = 1)."""
    u = sim.monitored()["utilisation"]
    return (u[:, None] if u.ndim == 1 else u).astype(np.float64)


class HPA:
    """Kubernetes Horizontal Pod Autoscaler (autoscaling/v2) on average CPU utilisation, one
    per pool (per class on v2).

    Rule, from the Kubernetes documentation ("Horizontal Pod Autoscaling", algorithm details
    and configurable scaling behavior):
      desired = ceil(current x currentUtilisation / targetUtilisation), skipped when the ratio
      is within the tolerance (0.1); evaluated every sync period (15 s,
      --horizontal-pod-autoscaler-sync-period); scale-down uses the highest recommendation of
      the stabilisation window (300 s); default scale-up policies allow max(100 %, 4 pods)
      more per 15 s, default scale-down 100 % per 15 s. Utilisation comes from
      metrics-server, which the simulator's monitoring lag models, averaged over ready pods.
    """

    name = "hpa"
    needs_observation = False  # reads the monitored signals, not the observation

    def __init__(self, target_utilisation: float = 0.5, tolerance: float = 0.1, period_s: float = 15.0,
                 downscale_window_s: float = 300.0, scale_up_pods: int = 4, scale_up_percent: float = 100.0,
                 scale_down_percent: float = 100.0) -> None:
        _check_range(target_utilisation, 0.0, 1.0, "target_utilisation")
        self.target_utilisation = target_utilisation
        self.tol = tolerance
        self.period_s = period_s
        self.window_s = downscale_window_s
        self.up_pods = scale_up_pods
        self.up_pct = scale_up_percent
        self.down_pct = scale_down_percent

    def reset(self, sim) -> None:
        _require_shared(sim, self.name)
        self.period = max(1, int(round(self.period_s / sim.dt)))
        self.start(sim.target)
        self.actions = default_actions(sim)
        self.target = per_shard(self.target_utilisation, sim.S, "target_utilisation")

    def start(self, replicas: np.ndarray) -> None:
        """Begin from the replicas in place (any shape: one entry per pool)."""
        self.recs: deque = deque(maxlen=max(1, int(round(self.window_s / self.period_s))))
        self.replicas = np.asarray(replicas).astype(np.int64).copy()
        self.recs.append(self.replicas.copy())
        if not hasattr(self, "target"):
            self.target = self.target_utilisation

    def sync(self, util: np.ndarray, ready: np.ndarray, lo, hi) -> np.ndarray:
        """One sync period on telemetry: monitored utilisation and ready replicas per pool,
        replica bounds lo / hi (minReplicas / maxReplicas); returns the replicas set. The
        simulator's HPA and the KEDA scaler's reference rule (`apex_bdq.control`) are this."""
        ratio = util / self.target
        rec = np.where(np.abs(ratio - 1.0) <= self.tol, self.replicas, np.ceil(ready * ratio)).astype(np.int64)
        self.recs.append(rec)
        cur = self.replicas
        # Scale-down stabilisation: go down only to the highest recent recommendation.
        highest = np.max(np.stack(self.recs), axis=0)
        stable = np.where(rec >= cur, rec, np.minimum(cur, highest))
        up_limit = np.maximum(cur * (1 + self.up_pct / 100.0), cur + self.up_pods)
        down_limit = cur * (1 - self.down_pct / 100.0)
        self.replicas = np.clip(stable, np.ceil(down_limit), np.floor(up_limit)).astype(np.int64)
        # minReplicas / maxReplicas of the HorizontalPodAutoscaler object.
        self.replicas = np.clip(self.replicas, lo, hi)
        return self.replicas

    def act(self, sim, obs):
        if sim.t % self.period == 0:
            self.sync(_pool_utilisation(sim), sim.active.astype(np.float64), sim.cfg.min_servers, sim.pool_max)
        return self.actions, self.replicas


class TargetTracking:
    """AWS (Application / EC2) Auto Scaling target tracking on average utilisation, one
    policy per pool (per class on v2).

    From the AWS user guides ("Target tracking scaling policies"): the policy keeps a metric
    at a target; CloudWatch alarms on the 1-minute metric trigger it — scale-out when the
    metric is above target for 3 consecutive datapoints, scale-in only after 15 consecutive
    datapoints below (it "scales out aggressively and scales in gradually"); the adjustment
    is proportional, desired = ceil(current x metric / target); after a scale-in, further
    scale-in waits for the cooldown (300 s default for most scalable targets).
    """

    name = "target"
    needs_observation = False  # reads the monitored signals, not the observation

    def __init__(self, target_utilisation: float = 0.5, period_s: float = 60.0, out_points: int = 3,
                 in_points: int = 15, scale_in_cooldown_s: float = 300.0) -> None:
        _check_range(target_utilisation, 0.0, 1.0, "target_utilisation")
        self.target_utilisation = target_utilisation
        self.period_s = period_s
        self.out_points = out_points
        self.in_points = in_points
        self.cooldown_s = scale_in_cooldown_s

    def reset(self, sim) -> None:
        _require_shared(sim, self.name)
        self.period = max(1, int(round(self.period_s / sim.dt)))
        self.cooldown = int(round(self.cooldown_s / sim.dt))
        shape = sim.target.shape  # [S, P]
        self.acc = np.zeros(shape)
        self.above = np.zeros(shape, dtype=np.int64)
        self.below = np.zeros(shape, dtype=np.int64)
        self.last_in = np.full(shape, -10**9, dtype=np.int64)
        self.desired = sim.target.astype(np.int64).copy()
        self.actions = default_actions(sim)
        self.target = per_shard(self.target_utilisation, sim.S, "target_utilisation")

    def act(self, sim, obs):
        self.acc += _pool_utilisation(sim)
        if sim.t % self.period == self.period - 1:
            metric = self.acc / self.period  # the 1-minute average datapoint
            self.acc[:] = 0.0
            self.above = np.where(metric > self.target, self.above + 1, 0)
            self.below = np.where(metric < self.target, self.below + 1, 0)
            ready = sim.active.astype(np.float64)
            want = np.ceil(ready * metric / self.target).astype(np.int64)
            out = (self.above >= self.out_points) & (want > self.desired)
            cool = sim.t - self.last_in >= self.cooldown
            scale_in = (self.below >= self.in_points) & (want < self.desired) & cool
            self.desired = np.clip(np.where(out | scale_in, want, self.desired), sim.cfg.min_servers, sim.pool_max)
            self.last_in = np.where(scale_in, sim.t, self.last_in)
            self.above[out] = 0
            self.below[scale_in] = 0
        return self.actions, self.desired


class StaticPeak:
    """Static provisioning for the peak: capacity = peak offered load of the training range
    divided by a target utilisation, never changed (the over-provisioned incumbent); per
    class on v2."""

    name = "static"
    needs_observation = False  # reads the monitored signals, not the observation

    def __init__(self, target_utilisation: float = 0.8) -> None:
        _check_range(target_utilisation, 0.0, 1.0, "target_utilisation")
        self.target_utilisation = target_utilisation

    def reset(self, sim) -> None:
        _require_shared(sim, self.name)
        lo, hi = sim.rates.train
        load = sim.lam_table[lo:hi] * sim.inv_mu  # [T, K] Erlangs
        target = per_shard(self.target_utilisation, sim.S, "target_utilisation")
        if sim.cfg.platform == "v2":
            peak = load.max(0).astype(np.float64)[None, :]  # [1, K]
        else:
            peak = np.array([[float(load.sum(1).max())]])
        self.servers = np.minimum(sim.pool_max, np.ceil(peak / target) * np.ones((sim.S, 1))).astype(np.int64)
        self.actions = default_actions(sim)

    def act(self, sim, obs):
        return self.actions, self.servers


class QueueThreshold:
    """Queue-threshold admission control (load shedding) on top of HPA capacity.

    Admission is tightened while a class's queue exceeds `threshold_slo` SLOs of drain time
    and released when it falls back — the classic threshold / static load-shedding rule
    (e.g. Welsh & Culler, "Adaptive Overload Control for Busy Internet Servers", USITS 2003,
    the fixed-threshold baseline there).
    """

    name = "queue"

    def __init__(self, threshold_slo: float = 1.0, shed_level: Optional[int] = None, **hpa_kwargs) -> None:
        self.threshold = threshold_slo
        self.shed_level = shed_level
        self.hpa = HPA(**hpa_kwargs)

    def reset(self, sim) -> None:
        self.hpa.reset(sim)
        self.level = self.shed_level if self.shed_level is not None else sim.n - 2
        self.branch = sim.cfg.branch_names.index("admission")

    def act(self, sim, obs):
        actions, cap = self.hpa.act(sim, obs)
        queue_slo = obs.micro[:, :, -1, 1]  # [S, K] backlog drain time in SLOs, newest tick
        shed = (queue_slo > self.threshold).any(1)
        a = actions.copy()
        a[:, self.branch] = np.where(shed, self.level, 0)
        return a, cap


class RandomPolicy:
    """Uniform random sub-action on every branch (the floor)."""

    name = "random"
    needs_observation = False  # reads the monitored signals, not the observation

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def reset(self, sim) -> None:
        self.rng = np.random.default_rng(self.seed)

    def act(self, sim, obs):
        return self.rng.integers(0, sim.n, size=(sim.S, sim.D)), None


PREDICTIVE_PERIOD_S = 15.0  # the predictive rule's sync period (HPA's)
LEVEL_WINDOW_S = 1800.0  # its level correction compares the arrivals of this window with the same window then


def seasonal_forecast(past_peak: np.ndarray, seen: np.ndarray, then: np.ndarray, ok) -> np.ndarray:
    """The predictive rule's forecast from its inputs (one definition for the simulator and a
    live platform's telemetry): the peak rate over the horizon ahead at the same time a week
    (or a day) back, times the level correction, the ratio of the arrival rate `seen` over the
    last level window to the rate `then` over the same window of that past day, clipped to
    [1/3, 3]; 0 where there is no such past (`ok` false)."""
    level = np.clip(seen / np.maximum(then, 1e-9), 1.0 / 3.0, 3.0)
    return np.where(ok, past_peak * level, 0.0)


def predictive_replicas(now: np.ndarray, forecast: np.ndarray, margin, sizing) -> np.ndarray:
    """One sync of the predictive rule: the replicas the queueing model sizes for the larger of
    the rate of the moment and the forecast, times `margin` (before the scale-down hold)."""
    return replicas_for(np.maximum(now, forecast) * margin, sizing)


class Predictive:
    """A predictive autoscaler as platforms run it (AWS predictive scaling, Alibaba AHPA, the
    predictive-horizontal-pod-autoscaler project): a seasonal forecast of each class's
    request rate over the next provisioning delay plus one sync period, sized with the
    queueing model, beside the same sizing of the rate of the moment; the larger wins (AWS
    runs predictive and dynamic scaling together the same way), held 300 s before scaling
    down like HPA.

    Forecast: seasonal naive with a level correction. The trace's rate at the same time last
    week (yesterday where the trace holds no week before), its maximum over the horizon,
    times the ratio of the arrivals seen in the last `level_window_s` to the same window of
    that past day (clipped to [1/3, 3]). `margin` multiplies both rates before sizing: the
    setting swept into this rule's frontier.
    """

    name = "predictive"
    needs_observation = False  # reads the monitored signals, not the observation

    def __init__(self, margin: float = 1.2, period_s: float = PREDICTIVE_PERIOD_S,
                 level_window_s: float = LEVEL_WINDOW_S,
                 downscale_window_s: float = 300.0) -> None:
        _check_range(margin, 0.0, np.inf, "margin")
        self.margin_setting, self.period_s, self.level_s, self.window_s = margin, period_s, level_window_s, downscale_window_s

    def reset(self, sim) -> None:
        _require_v2(sim, self.name)
        self.period = max(1, int(round(self.period_s / sim.dt)))
        self.horizon = sim.L + self.period  # ticks ahead the forecast must cover
        self.blocks = max(1, int(round(self.level_s / (sim.cb * sim.dt))))  # coarse blocks in the level window
        self.recs: deque = deque(maxlen=max(1, int(round(self.window_s / self.period_s))))
        self.replicas = sim.target.astype(np.int64).copy()
        self.actions = default_actions(sim)
        self.margin = per_shard(self.margin_setting, sim.S, "margin")
        # The history a metrics store holds, indexed once: peaks over the horizon ahead of
        # any tick, and running sums for window means.
        self.ahead_peak = window_max(sim.lam_table, self.horizon)  # [T, K]
        self.cum = np.concatenate([np.zeros((1, sim.K)), np.cumsum(sim.lam_table, axis=0, dtype=np.float64)])

    def forecast(self, sim) -> np.ndarray:
        """[S, K] forecast peak request rate over the next `horizon` ticks."""
        idx = sim.trace_index()  # [S]
        season = np.where(idx >= sim.week, sim.week, sim.day)  # [S] ticks back to the same time
        ok = idx >= sim.day
        then_i = np.maximum(idx - season, 0)
        past_peak = self.ahead_peak[then_i]  # [S, K] the past day's peak over the horizon
        # Level: arrivals of the last `blocks` coarse blocks vs the same window of the past day.
        order = (sim.coarse_ptr - 1 - np.arange(self.blocks)) % sim.Hc  # newest first
        seen = sim.coarse[order].mean(0)  # [S, K] requests per second
        n = self.blocks * sim.cb
        lo = np.maximum(then_i - n, 0)
        then = (self.cum[then_i] - self.cum[lo]) / np.maximum(then_i - lo, 1)[:, None]  # [S, K]
        return seasonal_forecast(past_peak, seen, then, ok[:, None])

    def act(self, sim, obs):
        if sim.t % self.period == 0:
            now = sim.monitored()["rate"].astype(np.float64)
            rec = predictive_replicas(now, self.forecast(sim), self.margin, sim.sizing)
            self.recs.append(rec)
            self.replicas = np.max(np.stack(self.recs), axis=0)  # scale down after the hold
        return self.actions, self.replicas


class Oracle:
    """Not a policy: a reference that sees the trace's future rates. Every tick each class
    gets the replicas the queueing model needs for `margin` x the highest rate of the next
    `lead` (default: the provisioning delay, so what it launches now is ready when that rate
    comes). It knows the trace's rate, not the Poisson arrivals drawn around it; `margin`
    covers those and is the setting swept into its frontier.

    `lag_s` and `hold_s` take privileges away, for the ladder that splits the oracle's room
    (`apex_bdq.yardstick.ladder`): the rate is read `lag_s` late (as monitoring reports it),
    and capacity comes down only after the highest sizing of the last `hold_s` (as HPA's
    scale-down window holds it). With lead 0, the monitoring lag and the hold, it is a
    reactive rule that knows the true rate instead of measuring it from arrivals."""

    name = "oracle"
    needs_observation = False  # reads the monitored signals, not the observation

    def __init__(self, margin: float = 1.1, lead_s: Optional[float] = None, lag_s: float = 0.0,
                 hold_s: float = 0.0) -> None:
        _check_range(margin, 0.0, np.inf, "margin")
        for name, v in (("lead_s", lead_s), ("lag_s", lag_s), ("hold_s", hold_s)):
            if name == "lead_s" and v is None:
                continue  # the provisioning delay
            if isinstance(v, bool) or not (isinstance(v, numbers.Real) and math.isfinite(v) and v >= 0):
                raise ValueError(f"oracle {name} must be a number of seconds >= 0, got {v!r}")
        self.margin_setting, self.lead_s, self.lag_s, self.hold_s = margin, lead_s, lag_s, hold_s

    def reset(self, sim) -> None:
        _require_v2(sim, self.name)
        lead = sim.L if self.lead_s is None else max(0, int(round(self.lead_s / sim.dt)))
        rate = window_max(sim.lam_table, lead + 1)  # [T, K] max over [t, t + lead]
        hold = int(round(self.hold_s / sim.dt))
        if hold:  # max over [t - hold, t]: sizing is monotone in the rate, so this holds the replicas
            rate = window_max(rate[::-1], hold + 1)[::-1]
        self.rate = np.ascontiguousarray(rate)
        self.lag = int(round(self.lag_s / sim.dt))
        self.actions = default_actions(sim)
        self.margin = per_shard(self.margin_setting, sim.S, "margin")

    def act(self, sim, obs):
        rate = self.rate[np.maximum(sim.trace_index() - self.lag, 0)].astype(np.float64) * self.margin
        return self.actions, replicas_for(rate, sim.sizing)


def window_max(x: np.ndarray, w: int) -> np.ndarray:
    """out[t] = max(x[t : t + w]) along axis 0 (the window is cut at the end), by doubling:
    O(T log w)."""
    out = x.copy()
    span = 1
    while span < w:
        step = min(span, w - span)
        out[:-step] = np.maximum(out[:-step], out[step:])
        span += step
    return out


class Constant:
    """One fixed sub-action per branch on every shard (`action`, default: the platform's
    default setting). On v2 a constant capacity and hold tier is itself a reactive rule sized
    with the queueing model; the tier sweep shows where constant settings sit."""

    name = "constant"
    needs_observation = False  # reads the monitored signals, not the observation

    def __init__(self, action=None) -> None:
        self.action = action

    def reset(self, sim) -> None:
        self.actions = default_actions(sim)
        if self.action is not None:
            a = np.asarray(self.action, dtype=np.int64)
            rows = a.reshape(-1, a.shape[-1]) if a.ndim else a
            if a.ndim not in (1, 2) or rows.shape[1] != sim.D or sim.S % len(rows):
                raise ValueError(f"constant action needs {sim.D} sub-actions ({sim.cfg.branch_names}), or one "
                                 f"such row per group of shards, got {self.action!r}")
            if ((rows < 0) | (rows >= sim.n)).any():
                raise ValueError(f"constant action sub-actions must be in [0, {sim.n - 1}], got {self.action!r}")
            self.actions[:] = np.repeat(rows, sim.S // len(rows), axis=0)

    def act(self, sim, obs):
        return self.actions, None


BASELINES = {"hpa": HPA, "target": TargetTracking, "static": StaticPeak, "queue": QueueThreshold,
             "random": RandomPolicy, "predictive": Predictive, "oracle": Oracle, "constant": Constant}
V2_ONLY = ("predictive", "oracle")


def make_baseline(name: str, **kwargs) -> Policy:
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose from {sorted(BASELINES)}")
    return BASELINES[name](**kwargs)
