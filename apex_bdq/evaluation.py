"""Evaluate a policy on the held-out range of a trace (no Ray).

S evaluation shards start at evenly spaced phases of the evaluation range and each runs
range/S ticks, so together they cover the held-out range exactly once. With R replicas the
range is covered R times (R x S shards in one vectorised simulator, each copy with its own
Poisson arrivals): the same yardstick, R times the settled SLO windows, and the spread of
the violation rate between copies. The metrics are the ones every table in this project
reports (JSON keys in `METRIC_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from apex_bdq.config import SimConfig
from apex_bdq.sim.platform import PlatformSim

METRIC_KEYS = ("reward", "slo_violation_rate", "p99_ms", "utilisation", "cost", "drop_rate", "fairness")


@dataclass
class EvalResult:
    metrics: dict
    series: dict = field(default_factory=dict)  # shard 0 over time, for plots


def eval_config(cfg: SimConfig, shards: int = 8, split: str = "eval") -> tuple[SimConfig, int]:
    """The evaluation config (S shards, no truncation) and ticks per shard."""
    probe = PlatformSim(cfg.replace(num_shards=1), split=split, phases="even")
    ticks = max(1, probe.range_len // shards)
    return cfg.replace(num_shards=shards, episode_s=(ticks + 1) * cfg.tick_s), ticks


def evaluate_policy(policy, cfg: SimConfig, shards: int = 8, ticks: Optional[int] = None, seed: int = 12345,
                    progress: Optional[Callable[[int, int], None]] = None, replicas: int = 1,
                    split: str = "eval") -> EvalResult:
    """Run `policy` (reset(sim), act(sim, obs) -> (actions, capacity_target|None)) on the
    evaluation range. `ticks` shortens the run (default: cover the whole range); `replicas`
    covers it that many times with independent arrivals. split="train" runs the same
    yardstick on the training range instead (what a trainer may look at while it learns:
    the held-out range stays unseen)."""
    if not (isinstance(replicas, int) and replicas >= 1):
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    ecfg, full = eval_config(cfg, shards, split)
    ticks = full if ticks is None else min(ticks, full)
    sim = PlatformSim(ecfg.replace(seed=seed, num_shards=shards * replicas), split=split, eval_replicas=replicas,
                      phases="even")
    obs = sim.reset(seed=seed)
    policy.reset(sim)
    K = sim.K
    tot_reward = 0.0
    cost = 0.0
    arrivals = np.zeros(K)
    drops = 0.0
    busy = 0.0
    capacity = 0.0
    p99_weighted = np.zeros(K)
    fairness = 0.0
    windows = 0
    violated = np.zeros(replicas)  # broken class-windows per copy of the range
    keep = {"offered": [], "servers": [], "p99_ms": [], "time_of_day": []}
    for t in range(ticks):
        actions, cap = policy.act(sim, obs)
        obs, reward, _, info = sim.step(actions, capacity_target=cap)
        tot_reward += float(reward.sum())
        cost += float(info["cost"].sum())
        arr = info["arrivals"]
        arrivals += arr.sum(0)
        drops += float(info["dropped"].sum())
        busy += float((info["utilisation"] * info["servers"]).sum())
        capacity += float(info["servers"].sum())
        p99_weighted += (info["p99_s"] * arr).sum(0)
        fairness += float(info["fairness"].sum())
        if info["window_violated"] is not None:
            windows += info["window_violated"].size
            violated += info["window_violated"].reshape(replicas, -1).sum(1)
        w = arr[0] / max(arr[0].sum(), 1e-9)
        keep["offered"].append(float(info["offered_erlangs"][0]))
        keep["servers"].append(int(info["servers"][0]))
        keep["p99_ms"].append(float((info["p99_s"][0] * w).sum() * 1e3))
        if progress is not None:
            progress(t + 1, ticks)
    n = ticks * sim.S
    p99_class = p99_weighted / np.maximum(arrivals, 1e-9)
    metrics = {
        "reward": tot_reward / n,
        "slo_violation_rate": float(violated.sum()) / windows if windows else float("nan"),
        "p99_ms": float((p99_weighted.sum() / max(arrivals.sum(), 1e-9)) * 1e3),
        "utilisation": busy / max(capacity, 1e-9),
        "cost": cost / n,
        "drop_rate": drops / max(arrivals.sum(), 1e-9),
        "fairness": fairness / n,
        "p99_ms_per_class": [float(x * 1e3) for x in p99_class],
        "ticks": ticks, "shards": sim.S, "replicas": replicas, "slo_windows": windows,
        "slo_violation_rate_per_replica": [float(v) * replicas / windows if windows else float("nan")
                                           for v in violated],
    }
    return EvalResult(metrics=metrics, series=keep)
