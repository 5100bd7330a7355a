"""The yardstick: a policy judged as a platform engineer judges an autoscaler.

Every policy gets a cost and an SLO-violation rate (the share of settled class-windows whose
late + refused requests exceed the SLO's 1 %) on held-out days. Each rule is swept over its
setting into a cost-violation frontier (its Pareto points, lowest cost first at each
violation rate); the oracle, which sees the future, is swept the same way. A policy is then
placed against them:

- `cost_saving_vs_best_rule` = 1 - cost / C*(v), C*(v) the lowest cost any rule's frontier
  reaches at the policy's violation rate v (interpolated);
- `violation_ratio_vs_best_rule` = v / V*(c), V*(c) the lowest violation rate any rule's
  frontier reaches at the policy's cost c;
- `oracle_gap_closed` = (C*(v) - cost) / (C*(v) - C_oracle(v)): the share of the room
  between the best rule and the oracle that the policy takes (1 = as good as the oracle);
- `refused_share`: requests refused by admission (they count against the SLO as late ones).

Frontiers are interpolated linearly in log(violation rate) between neighbouring Pareto
points (cost falls about linearly in log v along a sweep; a chord in v would overstate a
rule's cost between its points); outside a frontier's swept range a figure is None, never
extrapolated. Every setting of every sweep meets the same arrivals shard for shard (common
random numbers), and so does every policy evaluated with the same shards, copies and seed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from apex_bdq.config import SimConfig
from apex_bdq.durable import atomic_write_bytes
from apex_bdq.evaluation import evaluate_groups

# Each rule's setting and the values swept into its frontier.
SWEEPS_V2 = {
    "hpa": ("target_utilisation", (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)),
    "target": ("target_utilisation", (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)),
    "predictive": ("margin", (1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0)),
    "static": ("target_utilisation", (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)),
}
SWEEPS_V1 = {k: SWEEPS_V2[k] for k in ("hpa", "target", "static")}
ORACLE_SWEEP = ("margin", (0.95, 1.0, 1.05, 1.1, 1.2, 1.35, 1.5))
MIN_WINDOWS = 2000
"""A comparison rests on at least this many settled class-windows per policy: at a 2 %
violation rate the binomial standard error is then 0.3 points, enough to tell neighbouring
settings of a sweep apart."""
YARDSTICK_VERSION = 1


class YardstickError(ValueError):
    """The range cannot tell policies apart (too few windows, or every setting alike)."""


def sweeps_for(cfg: SimConfig) -> dict:
    return SWEEPS_V2 if cfg.platform == "v2" else SWEEPS_V1


def sweep(rule: str, cfg: SimConfig, values, shards: int, replicas: int, seed: int = 12345,
          split: str = "eval", progress: Optional[Callable[[int, int], None]] = None,
          ticks: Optional[int] = None, options: Optional[dict] = None) -> list[dict]:
    """One frontier's raw points: rule `rule` at every value of its setting (its other
    arguments from `options`), side by side in one simulator (on v2 meeting the same
    arrivals). Each point is
    {setting, cost, slo_violation_rate, cost_se, slo_violation_rate_se, refused_share, slo_windows}."""
    from apex_bdq.sim.baselines import Constant, default_action, make_baseline
    if rule == "tiers":  # constant capacity tiers, the other branches at their defaults
        values = tuple(int(v) for v in values)
        rows = []
        for tier in values:
            a = list(default_action(cfg))
            for d, b in enumerate(cfg.branch_names):
                if b.startswith("capacity"):
                    a[d] = tier
            rows.append(a)
        policy = Constant(rows)
    else:
        name, _ = (ORACLE_SWEEP if rule == "oracle" else sweeps_for(cfg)[rule])
        values = tuple(float(v) for v in values)
        policy = make_baseline(rule, **{name: list(values)}, **(options or {}))
    metrics, _ = evaluate_groups(policy, cfg, len(values), shards=shards, ticks=ticks, replicas=replicas,
                                 seed=seed, split=split, progress=progress)
    return [point(v, m) for v, m in zip(values, metrics)]


def point(setting, m: dict) -> dict:
    """The frontier point of one evaluated setting (its metrics `m`)."""
    return {"setting": setting, "cost": m["cost"], "slo_violation_rate": m["slo_violation_rate"],
            "cost_se": m.get("cost_se"), "slo_violation_rate_se": m.get("slo_violation_rate_se"),
            "refused_share": m.get("refused_share"), "slo_windows": m.get("slo_windows")}


def pareto(points: list[dict]) -> list[dict]:
    """The Pareto points, by rising violation rate: each is cheaper than every point with a
    violation rate as low or lower."""
    pts = sorted((p for p in points if math.isfinite(p["cost"]) and math.isfinite(p["slo_violation_rate"])),
                 key=lambda p: (p["slo_violation_rate"], p["cost"]))
    out: list[dict] = []
    for p in pts:
        if not out or p["cost"] < out[-1]["cost"]:
            if out and p["slo_violation_rate"] == out[-1]["slo_violation_rate"]:
                continue  # same rate, and sorted by cost: the first one is cheaper
            out.append(p)
    return out


def _log_v(v: float, floor: float) -> float:
    return math.log(max(v, floor))


def cost_at(front: list[dict], v: float, floor: float = 1e-6) -> Optional[float]:
    """Cost of the Pareto frontier `front` at violation rate v, linear in log v between its
    points; None outside [lowest, highest] violation rate of the frontier. `floor` stands in
    for a zero violation rate in the logarithm (half a window of the range)."""
    if not front or not math.isfinite(v):
        return None
    vs = [p["slo_violation_rate"] for p in front]
    if v < vs[0] or v > vs[-1]:
        return None
    if len(front) == 1:
        return front[0]["cost"]
    for a, b in zip(front, front[1:]):
        va, vb = a["slo_violation_rate"], b["slo_violation_rate"]
        if va <= v <= vb:
            la, lb = _log_v(va, floor), _log_v(vb, floor)
            w = 0.0 if lb == la else (_log_v(v, floor) - la) / (lb - la)
            return a["cost"] + w * (b["cost"] - a["cost"])
    return None


def violation_at(front: list[dict], c: float, floor: float = 1e-6) -> Optional[float]:
    """Violation rate of the frontier at cost c (log v linear in cost between its points);
    None outside its cost range."""
    if not front or not math.isfinite(c):
        return None
    cs = [p["cost"] for p in front]  # falling along the frontier
    if c > cs[0] or c < cs[-1]:
        return None
    if len(front) == 1:
        return front[0]["slo_violation_rate"]
    for a, b in zip(front, front[1:]):
        if b["cost"] <= c <= a["cost"]:
            w = 0.0 if a["cost"] == b["cost"] else (a["cost"] - c) / (a["cost"] - b["cost"])
            la = _log_v(a["slo_violation_rate"], floor)
            lb = _log_v(b["slo_violation_rate"], floor)
            return math.exp(la + w * (lb - la))
    return None


def best_rule_cost(frontiers: dict, v: float, floor: float = 1e-6) -> tuple[Optional[str], Optional[float]]:
    """(rule, cost) of the cheapest rule frontier at violation rate v (None, None: no
    frontier covers v)."""
    best = (None, None)
    for rule, pts in frontiers.items():
        c = cost_at(pareto(pts), v, floor)
        if c is not None and (best[1] is None or c < best[1]):
            best = (rule, c)
    return best


def best_rule_violation(frontiers: dict, c: float, floor: float = 1e-6) -> tuple[Optional[str], Optional[float]]:
    best = (None, None)
    for rule, pts in frontiers.items():
        v = violation_at(pareto(pts), c, floor)
        if v is not None and (best[1] is None or v < best[1]):
            best = (rule, v)
    return best


def judge(m: dict, frontiers: dict, oracle: list[dict]) -> dict:
    """The yardstick's figures for a policy with metrics `m` (cost, slo_violation_rate,
    refused_share, slo_windows) against rule frontiers {rule: points} and the oracle's points."""
    floor = 0.5 / max(int(m.get("slo_windows") or 0), 1)
    v, c = m["slo_violation_rate"], m["cost"]
    rule_c, c_star = best_rule_cost(frontiers, v, floor)
    rule_v, v_star = best_rule_violation(frontiers, c, floor)
    c_oracle = cost_at(pareto(oracle), v, floor) if oracle else None
    saving = None if c_star is None else 1.0 - c / c_star
    ratio = None if not v_star else v / v_star
    gap = None
    if c_star is not None and c_oracle is not None and c_star - c_oracle > 1e-12:
        gap = (c_star - c) / (c_star - c_oracle)
    # The same two figures against each rule's own frontier (None where its sweep does not
    # reach the policy's violation rate or cost).
    per_rule = {}
    for rule, pts in frontiers.items():
        cr, vr = cost_at(pareto(pts), v, floor), violation_at(pareto(pts), c, floor)
        per_rule[rule] = {"cost_saving": None if cr is None else 1.0 - c / cr,
                          "violation_ratio": None if not vr else v / vr}
    return {"cost_saving_vs_best_rule": saving, "violation_ratio_vs_best_rule": ratio,
            "oracle_gap_closed": gap, "refused_share": m.get("refused_share"),
            "best_rule_at_violation_rate": rule_c, "best_rule_cost": c_star,
            "best_rule_at_cost": rule_v, "best_rule_violation_rate": v_star, "oracle_cost": c_oracle,
            "vs_rules": per_rule}


def headroom(frontiers: dict, oracle: list[dict], rates: tuple[float, ...], windows: int) -> list[dict]:
    """At each violation rate: the best rule's cost and the oracle's, both interpolated on
    their frontiers, and the oracle's saving (the room a better decision has)."""
    floor = 0.5 / max(windows, 1)
    out = []
    for v in rates:
        rule, c = best_rule_cost(frontiers, v, floor)
        co = cost_at(pareto(oracle), v, floor)
        out.append({"slo_violation_rate": v, "best_rule": rule, "best_rule_cost": c, "oracle_cost": co,
                    "oracle_saving": None if (c is None or co is None) else 1.0 - co / c})
    return out


def ladder_rungs(cfg: SimConfig) -> tuple[tuple[str, dict], ...]:
    """The oracle with its privileges taken away one at a time (`Oracle`'s arguments): it
    first loses the next provisioning delay's rate, then reads the rate of the moment as late
    as monitoring does, then holds capacity as HPA does before it scales down. The last rung
    is a reactive rule with the rules' lag and hold that knows the true rate: what is left
    between it and the best rule is the cost of measuring the rate from arrivals (and of the
    monitoring's 15-s average on top of its lag, which the rung does not model)."""
    lag, hold = cfg.monitor_lag_s, max(cfg.hold_s)  # the platform default's hold: HPA's 300 s
    return (("oracle", {}),
            ("no foresight", {"lead_s": 0.0}),
            (f"+ {lag:g}-s monitoring lag", {"lead_s": 0.0, "lag_s": lag}),
            (f"+ {hold:g}-s scale-down hold", {"lead_s": 0.0, "lag_s": lag, "hold_s": hold}))


LADDER_MARGINS = ORACLE_SWEEP[1] + (1.75, 2.0)


def ladder(cfg: SimConfig, frontiers: dict, shards: int, replicas: int, rates: tuple[float, ...], windows: int,
           seed: int = 12345, split: str = "eval", ticks: Optional[int] = None,
           log: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Where the oracle's room comes from (v2): every rung of `ladder_rungs` swept over its
    margin on the same arrivals as the frontiers, and at each violation rate of `rates` its
    cost on its own frontier and the share of the best-rule -> oracle gap it still closes.
    Returns [{"rung", "options", "points", "at": [{slo_violation_rate, cost, gap_closed}]}]."""
    if cfg.platform != "v2":
        raise YardstickError("the oracle ladder exists on platform v2 only")
    floor = 0.5 / max(windows, 1)
    rungs = []
    for name, opts in ladder_rungs(cfg):
        if log:
            log(f"ladder: sweeping '{name}' over {len(LADDER_MARGINS)} margins")
        rungs.append({"rung": name, "options": opts,
                      "points": sweep("oracle", cfg, LADDER_MARGINS, shards, replicas, seed, split, None, ticks, opts)})
    full = pareto(rungs[0]["points"])
    for r in rungs:
        front, r["at"] = pareto(r["points"]), []
        for v in rates:
            _, c_star = best_rule_cost(frontiers, v, floor)
            c, c_o = cost_at(front, v, floor), cost_at(full, v, floor)
            gap = None
            if None not in (c, c_star, c_o) and c_star - c_o > 1e-12:
                gap = (c_star - c) / (c_star - c_o)
            r["at"].append({"slo_violation_rate": v, "cost": c, "best_rule_cost": c_star, "gap_closed": gap})
    return rungs


def check_resolution(frontiers: dict, windows: int) -> None:
    """Raise YardstickError when the range cannot tell policies apart: fewer than
    MIN_WINDOWS settled class-windows, or no rule whose sweep moves the violation rate by
    more than twice its standard error (every setting alike: a trace too short, too easy or
    too bursty for this SLO)."""
    if windows < MIN_WINDOWS:
        raise YardstickError(
            f"the range gives {windows:,} settled class-windows per policy; at least {MIN_WINDOWS:,} are needed "
            f"to tell violation rates a point apart (binomial SE ~0.3 points at 2 %): use a longer trace, a larger "
            f"trace.eval_fraction or more --replicas")
    usable = []
    for rule, pts in frontiers.items():
        front = pareto(pts)
        if len(front) < 2:
            continue
        lo, hi = front[0], front[-1]
        se = max(lo.get("slo_violation_rate_se") or 0.0, hi.get("slo_violation_rate_se") or 0.0)
        if hi["slo_violation_rate"] - lo["slo_violation_rate"] > 2 * se:
            usable.append(rule)
    if not usable:
        rates = {r: sorted({round(p["slo_violation_rate"], 4) for p in pts}) for r, pts in frontiers.items()}
        raise YardstickError(
            f"no rule's sweep changes the SLO violation rate by more than its noise on this range ({rates}): "
            f"every setting looks alike, so no policy can be told apart from another here")


# -- the frontiers of a platform and trace, computed once and cached ------------------------
_SOURCES = ("sim/platform.py", "sim/platform_v2.py", "sim/baselines.py", "sim/queueing.py", "sim/trace.py",
            "sizing.py", "evaluation.py", "yardstick.py")


def _code_stamp() -> str:
    """Hash of the code the frontiers depend on: a changed rule or simulator recomputes them."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for rel in _SOURCES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("APEX_BDQ_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "apex-bdq")
    return Path(base) / "yardstick"


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a trace file's bytes (memoised per path, size and mtime within a process)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def trace_digest(path: str) -> str:
    """What identifies a trace in the cache key: its content. Not its path or mtime: the same
    bytes copied elsewhere, checked out again or re-downloaded (a new mtime) are the same
    trace, and their frontiers are not swept again."""
    src = Path(path).resolve()
    st = src.stat()
    return _file_digest(str(src), st.st_size, st.st_mtime_ns)


def _key(cfg: SimConfig, shards: int, replicas: int, seed: int, split: str, ticks: Optional[int]) -> str:
    import dataclasses
    from apex_bdq.sim.platform import make_rates
    rates = make_rates(cfg)
    d = dataclasses.asdict(cfg.replace(num_shards=1, seed=0))
    d.pop("augment", None)  # training-time only: no evaluation reshapes the trace
    d["trace"].pop("path", None)  # the trace is identified by its content (below)
    if split == "eval":  # the held-out range and the rates' scaling do not move with the validation days
        d["trace"].pop("validation_fraction", None)
    blob = json.dumps({"cfg": d, "trace_sha256": trace_digest(rates.source), "shards": shards,
                       "replicas": replicas, "seed": seed, "split": split, "ticks": ticks, "code": _code_stamp(),
                       "version": YARDSTICK_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def frontiers(cfg: SimConfig, shards: int, replicas: int, seed: int = 12345, split: str = "eval",
              ticks: Optional[int] = None, use_cache: bool = True, log: Optional[Callable[[str], None]] = None,
              progress_for: Optional[Callable[[str], Callable[[int, int], None]]] = None) -> dict:
    """{"frontiers": {rule: points}, "oracle": points (v2; [] on v1), "tiers": points of the
    constant capacity tiers (a diagnostic: where constant settings sit), "cached": bool} for the
    platform and trace of `cfg` on `split`, computed once per (platform, trace, layout, code)
    and kept under `cache_dir()` (APEX_BDQ_CACHE overrides it)."""
    path = cache_dir() / f"{_key(cfg, shards, replicas, seed, split, ticks)}.json"
    if use_cache and path.is_file():
        try:
            data = json.loads(path.read_text())
            data["cached"] = True
            return data
        except (OSError, ValueError):
            pass  # a torn or foreign file: recompute
    out: dict = {"frontiers": {}, "oracle": [], "tiers": []}
    for rule, (_, values) in sweeps_for(cfg).items():
        if log:
            log(f"sweeping {rule} over {len(values)} settings")
        out["frontiers"][rule] = sweep(rule, cfg, values, shards, replicas, seed, split,
                                       progress_for(rule) if progress_for else None, ticks)
    if log:
        log(f"sweeping the {cfg.sub_actions} constant capacity tiers")
    out["tiers"] = sweep("tiers", cfg, range(cfg.sub_actions), shards, replicas, seed, split,
                         progress_for("tiers") if progress_for else None, ticks)
    if cfg.platform == "v2":
        if log:
            log(f"sweeping the oracle over {len(ORACLE_SWEEP[1])} margins")
        out["oracle"] = sweep("oracle", cfg, ORACLE_SWEEP[1], shards, replicas, seed, split,
                              progress_for("oracle") if progress_for else None, ticks)
    if use_cache:
        atomic_write_bytes(path, json.dumps(out).encode())
    out["cached"] = False
    return out


def report(cfg: SimConfig, m: dict, shards: int, replicas: int, ticks: Optional[int] = None,
           seed: int = 12345, log: Optional[Callable[[str], None]] = None, split: str = "eval") -> dict:
    """The yardstick of one policy evaluated with metrics `m` on `cfg`'s range `split` (the
    held-out days; "val": the validation days) with this layout (the frontiers come from the
    cache or are computed): judge()'s figures plus the headroom, or {"refused": reason}."""
    f = frontiers(cfg, shards, replicas, seed=seed, split=split, ticks=ticks, log=log)
    try:
        check_resolution(f["frontiers"], m["slo_windows"])
    except YardstickError as e:
        return {"refused": str(e)}
    out = judge(m, f["frontiers"], f["oracle"])
    out["headroom"] = headroom(f["frontiers"], f["oracle"], (m["slo_violation_rate"],), m["slo_windows"])[0] \
        if f["oracle"] else None
    out["frontiers_cached"] = f["cached"]
    return out


def summary(name: str, m: dict, y: dict) -> list[str]:
    """Printable lines for a policy's yardstick (`report`'s output)."""
    if "refused" in y:
        return [f"yardstick: comparison refused: {y['refused']}"]
    lines = [f"{name}: cost {m['cost']:.3f} at SLO violation rate {m['slo_violation_rate']:.4f}, "
             f"refused {100 * (m.get('refused_share') or 0.0):.2f} % of requests"]
    s, rule = y["cost_saving_vs_best_rule"], y["best_rule_at_violation_rate"]
    if s is None:
        lines.append("  no rule's frontier reaches that violation rate (outside every sweep): no cost comparison")
    else:
        lines.append(f"  cost vs the best rule at that violation rate ({rule}, {y['best_rule_cost']:.3f}): "
                     f"{-100 * s:+.1f} %" + ("" if y["oracle_gap_closed"] is None else
                                            f"; the oracle {y['oracle_cost']:.3f}: closes "
                                            f"{100 * y['oracle_gap_closed']:.0f} % of the gap"))
    r = y["violation_ratio_vs_best_rule"]
    if r is not None:
        lines.append(f"  violation rate vs the best rule at that cost ({y['best_rule_at_cost']}): x{r:.2f}")
    return lines


def first_target(y: dict, gap_target: float = 0.5, saving_target: float = 0.10,
                 headroom_min: float = 0.20) -> list[str]:
    """Issue 25's first target for one policy's yardstick `y` (`judge`'s output): at least
    `gap_target` of the best-rule -> oracle gap closed, and a cost saving of at least
    `saving_target` wherever the platform's headroom at the policy's violation rate (the
    oracle's saving over the best rule there) is at least `headroom_min`."""
    gap, s = y.get("oracle_gap_closed"), y.get("cost_saving_vs_best_rule")
    if gap is None or s is None:
        return ["target (issue 25): not judged (no rule's or the oracle's frontier reaches the policy's violation rate)"]
    room = 1.0 - y["oracle_cost"] / y["best_rule_cost"]
    lines = [f"target (issue 25): >= {100 * gap_target:.0f} % of the best-rule -> oracle gap closed: "
             f"{'met' if gap >= gap_target else 'not met'} ({100 * gap:.0f} %)"]
    if room >= headroom_min:
        lines.append(f"target (issue 25): >= {100 * saving_target:.0f} % cost saving vs the best rule (headroom "
                     f"{100 * room:.0f} % >= {100 * headroom_min:.0f} %): "
                     f"{'met' if s >= saving_target else 'not met'} ({100 * s:+.1f} %)")
    else:
        lines.append(f"target (issue 25): the >= {100 * saving_target:.0f} % saving does not apply (headroom "
                     f"{100 * room:.0f} % < {100 * headroom_min:.0f} %); saving {100 * s:+.1f} %")
    return lines


def as_table_rows(points: list[dict]) -> list[tuple]:
    """(setting, cost, violation, on the Pareto frontier?) rows for printing."""
    front = {id(p) for p in pareto(points)}
    return [(p["setting"], p["cost"], p["slo_violation_rate"], id(p) in front) for p in points]


def se_of_difference(a: list[float], b: list[float]) -> float:
    """Standard error of the mean paired difference of two per-segment series."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
