"""Rule-based controllers that practitioners run today, as baselines for the learned policy.

Each baseline acts on a PlatformSim through the same step() as a learned policy, reading
only what a real controller reads: the lagged monitored signals (`sim.monitored()`), the
replica counts it asked for and sees ready, and for the admission rule the local queue.
Capacity rules set replicas directly (`capacity_target`); the other branches stay at the
platform defaults (proportional class shares, admit everything, full speed).

All rules here work on the shared capacity pool (`per_class_capacity=False`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional, Protocol

import numpy as np

from apex_bdq.sim.platform import PlatformSim


class Policy(Protocol):
    name: str

    def reset(self, sim: PlatformSim) -> None: ...

    def act(self, sim: PlatformSim, obs) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """Return (actions [S, D], capacity_target [S, P] or None)."""


def default_action(D: int, n: int) -> tuple[int, ...]:
    """The platform's default setting, one sub-action per branch: the middle capacity tier,
    proportional class shares, admit everything, full speed."""
    return tuple([n // 2] * (D - 2) + [0, n - 1])


def default_actions(sim: PlatformSim) -> np.ndarray:
    """`default_action` for every shard [S, D]."""
    a = np.empty((sim.S, sim.D), dtype=np.int64)
    a[:] = default_action(sim.D, sim.n)
    return a


def _require_shared(sim: PlatformSim, name: str) -> None:
    if sim.P != 1:
        raise ValueError(f"the {name} baseline controls one shared capacity pool; "
                         f"this config has per_class_capacity=True ({sim.P} pools)")


class HPA:
    """Kubernetes Horizontal Pod Autoscaler (autoscaling/v2) on average CPU utilisation.

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

    def __init__(self, target_utilisation: float = 0.5, tolerance: float = 0.1, period_s: float = 15.0,
                 downscale_window_s: float = 300.0, scale_up_pods: int = 4, scale_up_percent: float = 100.0,
                 scale_down_percent: float = 100.0) -> None:
        if not 0 < target_utilisation <= 1:
            raise ValueError(f"target_utilisation must be in (0, 1], got {target_utilisation}")
        self.target = target_utilisation
        self.tol = tolerance
        self.period_s = period_s
        self.window_s = downscale_window_s
        self.up_pods = scale_up_pods
        self.up_pct = scale_up_percent
        self.down_pct = scale_down_percent

    def reset(self, sim: PlatformSim) -> None:
        _require_shared(sim, self.name)
        self.period = max(1, int(round(self.period_s / sim.dt)))
        self.recs: deque = deque(maxlen=max(1, int(round(self.window_s / self.period_s))))
        self.replicas = sim.target[:, 0].astype(np.int64).copy()
        self.recs.append(self.replicas.copy())
        self.actions = default_actions(sim)

    def act(self, sim: PlatformSim, obs):
        if sim.t % self.period == 0:
            util = sim.monitored()["utilisation"].astype(np.float64)
            ready = sim.active[:, 0].astype(np.float64)
            ratio = util / self.target
            rec = np.where(np.abs(ratio - 1.0) <= self.tol, self.replicas,
                           np.ceil(ready * ratio)).astype(np.int64)
            self.recs.append(rec)
            cur = self.replicas
            # Scale-down stabilisation: go down only to the highest recent recommendation.
            highest = np.max(np.stack(self.recs), axis=0)
            stable = np.where(rec >= cur, rec, np.minimum(cur, highest))
            up_limit = np.maximum(cur * (1 + self.up_pct / 100.0), cur + self.up_pods)
            down_limit = cur * (1 - self.down_pct / 100.0)
            self.replicas = np.clip(stable, np.ceil(down_limit), np.floor(up_limit)).astype(np.int64)
            # minReplicas / maxReplicas of the HorizontalPodAutoscaler object.
            self.replicas = np.clip(self.replicas, sim.cfg.min_servers, sim.pool_max)
        return self.actions, self.replicas[:, None]


class TargetTracking:
    """AWS (Application / EC2) Auto Scaling target tracking on average utilisation.

    From the AWS user guides ("Target tracking scaling policies"): the policy keeps a metric
    at a target; CloudWatch alarms on the 1-minute metric trigger it — scale-out when the
    metric is above target for 3 consecutive datapoints, scale-in only after 15 consecutive
    datapoints below (it "scales out aggressively and scales in gradually"); the adjustment
    is proportional, desired = ceil(current x metric / target); after a scale-in, further
    scale-in waits for the cooldown (300 s default for most scalable targets).
    """

    name = "target"

    def __init__(self, target_utilisation: float = 0.5, period_s: float = 60.0, out_points: int = 3,
                 in_points: int = 15, scale_in_cooldown_s: float = 300.0) -> None:
        if not 0 < target_utilisation <= 1:
            raise ValueError(f"target_utilisation must be in (0, 1], got {target_utilisation}")
        self.target = target_utilisation
        self.period_s = period_s
        self.out_points = out_points
        self.in_points = in_points
        self.cooldown_s = scale_in_cooldown_s

    def reset(self, sim: PlatformSim) -> None:
        _require_shared(sim, self.name)
        self.period = max(1, int(round(self.period_s / sim.dt)))
        self.cooldown = int(round(self.cooldown_s / sim.dt))
        S = sim.S
        self.acc = np.zeros(S)
        self.above = np.zeros(S, dtype=np.int64)
        self.below = np.zeros(S, dtype=np.int64)
        self.last_in = np.full(S, -10**9, dtype=np.int64)
        self.desired = sim.target[:, 0].astype(np.int64).copy()
        self.actions = default_actions(sim)

    def act(self, sim: PlatformSim, obs):
        self.acc += sim.monitored()["utilisation"]
        if sim.t % self.period == self.period - 1:
            metric = self.acc / self.period  # the 1-minute average datapoint
            self.acc[:] = 0.0
            self.above = np.where(metric > self.target, self.above + 1, 0)
            self.below = np.where(metric < self.target, self.below + 1, 0)
            ready = sim.active[:, 0].astype(np.float64)
            want = np.ceil(ready * metric / self.target).astype(np.int64)
            out = (self.above >= self.out_points) & (want > self.desired)
            cool = sim.t - self.last_in >= self.cooldown
            scale_in = (self.below >= self.in_points) & (want < self.desired) & cool
            self.desired = np.clip(np.where(out | scale_in, want, self.desired), sim.cfg.min_servers, sim.pool_max)
            self.last_in = np.where(scale_in, sim.t, self.last_in)
            self.above[out] = 0
            self.below[scale_in] = 0
        return self.actions, self.desired[:, None]


class StaticPeak:
    """Static provisioning for the peak: capacity = peak offered load of the training range
    divided by a target utilisation, never changed (the over-provisioned incumbent)."""

    name = "static"

    def __init__(self, target_utilisation: float = 0.8) -> None:
        self.target = target_utilisation

    def reset(self, sim: PlatformSim) -> None:
        _require_shared(sim, self.name)
        lo, hi = sim.rates.train
        peak = float((sim.lam_table[lo:hi] * sim.inv_mu).sum(1).max())
        self.servers = np.full((sim.S, 1), min(sim.pool_max, math.ceil(peak / self.target)), dtype=np.int64)
        self.actions = default_actions(sim)

    def act(self, sim: PlatformSim, obs):
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

    def reset(self, sim: PlatformSim) -> None:
        self.hpa.reset(sim)
        self.level = self.shed_level if self.shed_level is not None else sim.n - 2

    def act(self, sim: PlatformSim, obs):
        actions, cap = self.hpa.act(sim, obs)
        queue_slo = obs.micro[:, :, -1, 1]  # [S, K] backlog drain time in SLOs, newest tick
        shed = (queue_slo > self.threshold).any(1)
        a = actions.copy()
        a[:, -2] = np.where(shed, self.level, 0)
        return a, cap


class RandomPolicy:
    """Uniform random sub-action on every branch (the floor)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def reset(self, sim: PlatformSim) -> None:
        self.rng = np.random.default_rng(self.seed)

    def act(self, sim: PlatformSim, obs):
        return self.rng.integers(0, sim.n, size=(sim.S, sim.D)), None


BASELINES = {"hpa": HPA, "target": TargetTracking, "static": StaticPeak, "queue": QueueThreshold,
             "random": RandomPolicy}


def make_baseline(name: str, **kwargs) -> Policy:
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose from {sorted(BASELINES)}")
    return BASELINES[name](**kwargs)
