"""Evaluate a policy on the held-out range of a trace (no Ray).

S evaluation shards start at evenly spaced phases of the evaluation range and each runs
range/S ticks, so together they cover the held-out range exactly once. With R replicas the
range is covered R times (R x S shards in one vectorised simulator, each copy with its own
Poisson arrivals): the same yardstick, R times the settled SLO windows, and the spread
between copies. On platform v2 each shard starts `warmup_s` before its phase (on the trace's
earlier ticks) and those ticks are not counted, so no figure includes a cold start. The
metrics are the ones every table in this project reports (JSON keys in `METRIC_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from apex_bdq.config import SimConfig, TrainConfig
from apex_bdq.sim import make_sim
from apex_bdq.sim.provisioning import CapacityBounds

METRIC_KEYS = ("reward", "slo_violation_rate", "p99_ms", "utilisation", "cost", "drop_rate", "fairness")
WARMUP_S = 900.0  # v2: platform time each evaluation shard runs before its phase, not counted (3x the
# longest state: HPA's 300-s window, the 300-s hold, the 321-s class's load estimate)


@dataclass
class EvalResult:
    metrics: dict
    series: dict = field(default_factory=dict)  # shard 0 over time, for plots


def eval_config(cfg: SimConfig, shards: int = 8, split: str = "eval") -> tuple[SimConfig, int]:
    """The evaluation config (S shards, no truncation) and counted ticks per shard."""
    probe = make_sim(cfg.replace(num_shards=1), split=split, phases="even")
    ticks = max(1, probe.range_len // shards)
    return cfg.replace(num_shards=shards, episode_s=(ticks + warmup_ticks(cfg) + 1) * cfg.tick_s), ticks


def warmup_ticks(cfg: SimConfig) -> int:
    return int(round(WARMUP_S / cfg.tick_s)) if cfg.platform == "v2" else 0


def evaluate_policy(policy, cfg: SimConfig, shards: int = 8, ticks: Optional[int] = None, seed: int = 12345,
                    progress: Optional[Callable[[int, int], None]] = None, replicas: int = 1,
                    split: str = "eval") -> EvalResult:
    """Run `policy` (reset(sim), act(sim, obs) -> (actions, capacity_target | CapacityBounds | None)) on the
    evaluation range. `ticks` shortens the run (default: cover the whole range); `replicas`
    covers it that many times with independent arrivals. split="train" (or "val") runs the
    same yardstick on that range instead (what a trainer may look at while it learns: the
    held-out range stays unseen)."""
    (metrics,), series = evaluate_groups(policy, cfg, 1, shards, ticks, seed, progress, replicas, split)
    return EvalResult(metrics=metrics, series=series)


def evaluate_groups(policy, cfg: SimConfig, groups: int, shards: int = 8, ticks: Optional[int] = None,
                    seed: int = 12345, progress: Optional[Callable[[int, int], None]] = None, replicas: int = 1,
                    split: str = "eval") -> tuple[list[dict], dict]:
    """`evaluate_policy` for G settings of one policy side by side in one simulator: G groups
    of replicas x shards shards (group-major; shard i is in group i // (replicas x shards)),
    which on v2 meet the same arrivals shard for shard. The policy reads its per-shard
    settings from the group layout (e.g. `HPA(target_utilisation=[0.4, 0.5, 0.6])`).
    Returns one metrics dict per group, and shard 0's series."""
    if not (isinstance(replicas, int) and replicas >= 1):
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if not (isinstance(groups, int) and groups >= 1):
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
    ecfg, full = eval_config(cfg, shards, split)
    ticks = full if ticks is None else min(ticks, full)
    warm = warmup_ticks(cfg)
    G, R = groups, replicas
    kw = {"warmup_ticks": warm, "arrival_groups": G} if cfg.platform == "v2" else {}
    sim = make_sim(ecfg.replace(seed=seed, num_shards=shards * R * G), split=split, eval_replicas=R * G,
                   phases="even", **kw)
    obs = sim.reset(seed=seed)
    policy.reset(sim)
    if cfg.platform == "v2":  # rules that read no observation skip building one (40 % of a tick)
        sim.observe = bool(getattr(policy, "needs_observation", True))
    K = sim.K

    S = sim.S
    reward_s = np.zeros(S)  # per shard: each shard is one segment of one copy of the range
    cost_s = np.zeros(S)
    replica_s = np.zeros(S)  # ready + booting replicas: the cost in cloud billing terms on either platform
    busy_cost_s = np.zeros(S)
    offered_s = np.zeros(S)
    arrivals = np.zeros((S, K))
    drops = np.zeros((S, K))
    late = np.zeros((S, K))
    busy_s = np.zeros(S)
    capacity_s = np.zeros(S)
    p99_weighted = np.zeros((S, K))
    fairness_s = np.zeros(S)
    windows = 0  # settled windows per shard and class
    violated = np.zeros((S, K))  # broken windows per shard and class
    keep = {"offered": [], "servers": [], "p99_ms": []}
    for t in range(warm + ticks):
        actions, cap = policy.act(sim, obs)
        if isinstance(cap, CapacityBounds):  # a guard's bounds around the learned target
            obs, reward, _, info = sim.step(actions, capacity_bounds=cap)
        else:
            obs, reward, _, info = sim.step(actions, capacity_target=cap)
        if t < warm:
            continue
        reward_s += reward
        cost_s += info["cost"]
        replica_s += info["servers"] + info["pending"]
        if "busy" in info:
            busy_cost_s += info["busy"]
        offered_s += info["offered_erlangs"]
        arr = info["arrivals"]
        arrivals += arr
        drops += info["dropped"]
        late += info["late_requests"]
        busy_s += info["utilisation"] * info["servers"]
        capacity_s += info["servers"]
        p99_weighted += info["p99_s"] * arr
        fairness_s += info["fairness"]
        wv = info["window_violated"]
        if wv is not None:
            windows += 1
            violated += wv
        w = arr[0] / max(arr[0].sum(), 1e-9)
        keep["offered"].append(float(info["offered_erlangs"][0]))
        keep["servers"].append(int(info["servers"][0]))
        keep["p99_ms"].append(float((info["p99_s"][0] * w).sum() * 1e3))
        if progress is not None:
            progress(t + 1 - warm, ticks)
    out = [_group_metrics(g, G, R, K, ticks, warm, windows, split, sim.rates.describe(split), cfg.platform == "v2",
                          sim.mean_load, reward_s, cost_s, replica_s, busy_cost_s, offered_s, arrivals, drops, late, busy_s,
                          capacity_s, p99_weighted, fairness_s, violated)
           for g in range(G)]
    for m in out:  # which columns of which file were read as rates, in every table and JSON
        m["trace"], m["rate_columns"] = sim.rates.source, list(sim.rates.columns)
    return out, keep


def _se(x: np.ndarray) -> float:
    return float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")


def _group_metrics(g, G, R, K, ticks, warm, windows, split, described, v2, mean_load, reward_s, cost_s, replica_s,
                   busy_cost_s, offered_s, arrivals, drops, late, busy_s, capacity_s, p99_weighted, fairness_s,
                   violated) -> dict:
    """The metrics of group g from the per-shard sums (shards of a group: R copies x segments)."""
    sl = slice(g * len(cost_s) // G, (g + 1) * len(cost_s) // G)
    seg = len(cost_s) // (G * R)  # segments per copy
    n = ticks * (len(cost_s) // G)  # shard-ticks of the group
    arr, viol = arrivals[sl], violated[sl]
    total = max(float(arr.sum()), 1e-9)
    win = windows * viol.size  # settled class-windows of the group
    per_seg_cost = cost_s[sl] / ticks
    per_seg_viol = viol.sum(1) / (windows * K) if windows else np.full(len(per_seg_cost), np.nan)
    by_copy_cost = per_seg_cost.reshape(R, seg).mean(1)
    by_copy_viol = per_seg_viol.reshape(R, seg).mean(1)
    m = {
        "reward": float(reward_s[sl].sum()) / n,
        "slo_violation_rate": float(viol.sum()) / win if win else float("nan"),
        "p99_ms": float((p99_weighted[sl].sum() / total) * 1e3),
        "utilisation": float(busy_s[sl].sum()) / max(float(capacity_s[sl].sum()), 1e-9),
        "cost": float(cost_s[sl].sum()) / n,
        "replica_cost": float(replica_s[sl].sum()) / (n * mean_load),
        "drop_rate": float(drops[sl].sum()) / total,
        "refused_share": float(drops[sl].sum()) / total,
        "late_share": float(late[sl].sum()) / total,
        "fairness": float(fairness_s[sl].sum()) / n,
        "p99_ms_per_class": [float(x * 1e3) for x in p99_weighted[sl].sum(0) / np.maximum(arr.sum(0), 1e-9)],
        "slo_violation_rate_per_class": [float(v) / (windows * len(viol)) if windows else float("nan")
                                         for v in viol.sum(0)],
        # Spread over the R x segments pieces of the range (each a shard's stretch of one copy).
        "cost_se": _se(per_seg_cost), "slo_violation_rate_se": _se(per_seg_viol),
        "cost_per_segment": per_seg_cost.tolist(), "slo_violation_rate_per_segment": per_seg_viol.tolist(),
        "ticks": ticks, "warmup_ticks": warm, "shards": len(cost_s) // G, "replicas": R, "slo_windows": int(win),
        "split": split, "range": described,
        "slo_violation_rate_per_replica": by_copy_viol.tolist(),
        "cost_per_replica": by_copy_cost.tolist(),
    }
    if v2:
        m["busy_cost"] = float(busy_cost_s[sl].sum()) / n  # the same run if only busy replicas were billed
        m["offered_cost"] = float(offered_s[sl].sum()) / (n * mean_load)  # the floor: offered work only
    return m


def selection_split(cfg: SimConfig) -> str:
    """The range a run may look at while it learns or is tuned: the validation days when the
    trace has them (trace.validation_fraction > 0), else the training range. The held-out
    range ("eval") is for the final report only."""
    return "val" if cfg.trace.validation_fraction > 0 else "train"


def learned_policy(net, cfg: TrainConfig, guarded: bool = True):
    """The learned policy as it is evaluated and served: greedy in `net`, re-decided every
    `decision_ticks`, under the run's guard when it has one (platform v2, guard.enabled)."""
    from apex_bdq.checkpoint import GreedyPolicy
    pol = GreedyPolicy(net, cfg.agent.decision_ticks)
    if guarded:
        from apex_bdq.guard import GuardedPolicy, guard_for
        g = guard_for(cfg)
        if g is not None:
            return GuardedPolicy(pol, g)
    return pol


def evaluate_learned(net, cfg: TrainConfig, ticks: Optional[int], shards: int, replicas: int = 1,
                     split: str = "eval", guarded: bool = True) -> dict:
    """Metrics of `learned_policy` (with the guard's shares when it ran under one)."""
    pol = learned_policy(net, cfg, guarded)
    m = evaluate_policy(pol, cfg.sim, shards=shards, ticks=ticks, replicas=replicas, split=split).metrics
    if hasattr(pol, "shares"):
        m.update(pol.shares())
    m["guarded"] = hasattr(pol, "shares")
    net.train()
    return m


def evaluate_against_hpa(net, cfg: TrainConfig, ticks: Optional[int], shards: int, hpa_cache: dict,
                         replicas: int = 1, split: str = "eval", unguarded: bool = False) -> dict:
    """The learned policy (under its guard) and Kubernetes HPA on the held-out range (or
    `split`), covered `replicas` times with independent arrivals (HPA, deterministic for a
    config, is evaluated once per setting and cached in `hpa_cache`). unguarded: also the
    bare network's metrics under "learned_unguarded" (when the policy has a guard)."""
    import math
    import statistics

    from apex_bdq.sim.baselines import HPA
    learned = evaluate_learned(net, cfg, ticks, shards, replicas, split)
    key = (ticks, shards, replicas, split)
    if key not in hpa_cache:
        hpa_cache[key] = evaluate_policy(HPA(), cfg.sim, shards=shards, ticks=ticks, replicas=replicas,
                                         split=split).metrics
    hpa = hpa_cache[key]
    out = {"eval_reward": learned["reward"], "hpa_eval_reward": hpa["reward"],
           "slo_violation_rate": learned["slo_violation_rate"],
           "hpa_slo_violation_rate": hpa["slo_violation_rate"], "learned": learned, "hpa": hpa}
    if unguarded and learned["guarded"]:
        out["learned_unguarded"] = evaluate_learned(net, cfg, ticks, shards, replicas, split, guarded=False)
    if replicas > 1:  # both met the same arrivals copy by copy: a paired standard error
        d = [x - y for x, y in zip(learned["slo_violation_rate_per_replica"], hpa["slo_violation_rate_per_replica"])]
        out["slo_violation_rate_diff_se"] = statistics.stdev(d) / math.sqrt(len(d))
    return out
