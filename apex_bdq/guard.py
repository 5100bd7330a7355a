"""The guard: part of the learned policy on platform v2, on in evaluation and serving.

A learned decision is per shard the D sub-actions (plan factor and hold per class, the
admission level). The guard

  1. bounds it relative to the platform's default setting: the plan factor of each class to
     `plan_below` levels under and `plan_above` levels over the default's (plan 1.3 x the
     monitored load with HPA's 300-s hold and no refusals: a reactive rule sized with the
     queueing model, computable from an observation alone, so this part runs in the
     simulator, on Ray actors and behind Serve); the admission level to `max_admission`;
  2. where replicas are computed (the simulator; the KEDA controller, `apex_bdq.control`,
     with the forecast from Prometheus' series a week back), bounds the replicas the learned
     sub-actions ask for by the best rule's: per class at least what the predictive rule asks
     for at margin `floor_margin` (and at most at `ceiling_margin`, when set), and at most
     what static provisioning asks for at target utilisation `static_ceiling` (the training
     days' per-class peak load over it: the best rule on smooth series, where every
     rate-following decision pays the noise of measuring the rate from arrivals), while the
     class's monitored load lies within that peak (above it static provisioning was not
     sized for the load, and a backlog lifts the ceiling), and never below the floor (a
     training-days peak can lie below a later day's load without the monitored load showing
     it; the floor follows the forecast); a `ceiling_margin` ceiling wins over the floor.
     Serve answers sub-actions and sizes no replicas, so behind it only part 1 runs;
  3. falls back to the rules for a shard whose observation lies outside what training
     covered: the default setting's sub-actions and, where replicas are computed, the
     predictive rule's replicas at its own margin. Outside means its load shape (per class the
     newest 2-minute arrival rate, its growth over the block before, its ratio to the last
     32 minutes' mean: what a burst the training days never showed looks like; and its
     roughness, the rms second difference of the 2-minute rates over their mean:
     minute-scale burstiness a smoother training trace never showed) lies outside the range
     the training days span, widened by `ood_margin` of that range on each side.

The coverage is measured once per trace and config (the training days under the rule, and
with `sim.augment` on the augmented episodes too) and cached under the yardstick's cache
directory. `GuardedPolicy` runs a greedy network under the guard in `evaluate_policy` and
counts the decisions it clipped and replaced and the replicas the best rule's bounds moved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

import numpy as np

from apex_bdq.config import GuardConfig, SimConfig, TrainConfig
from apex_bdq.durable import atomic_write_bytes

FEATURES = ("rate", "growth", "trend", "roughness")  # per class, from the coarse arrival history
NF = len(FEATURES)
COVERAGE_SEED = 0  # the arrivals the coverage is measured on (independent of a run's seed)
EPS = 0.05  # rates are in units of the class's mean rate: a floor for the ratios


class GuardError(ValueError):
    pass


def _layout(sim: SimConfig) -> tuple[np.ndarray, int]:
    """[K, Hc] macro indices of each class's coarse rate blocks (oldest first), and Hc."""
    from apex_bdq.sim.platform_v2 import macro_names
    names = {n: i for i, n in enumerate(macro_names(sim))}
    Hc = sim.coarse_history
    idx = np.array([[names[f"rate_block_{j}[{k}]"] for j in range(Hc)] for k in range(sim.num_classes)])
    return idx, Hc


def load_shape(macro: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """[B, K * NF] the guard's features of a batch of macro observations [B, F]."""
    blocks = macro[:, idx]  # [B, K, Hc]
    new, prev = blocks[..., -1], blocks[..., -2] if blocks.shape[-1] > 1 else blocks[..., -1]
    mean = np.maximum(blocks.mean(-1), EPS)
    growth = new / np.maximum(prev, EPS)
    trend = new / mean
    if blocks.shape[-1] > 2:
        d2 = blocks[..., 2:] - 2.0 * blocks[..., 1:-1] + blocks[..., :-2]
        rough = np.sqrt((d2 * d2).mean(-1)) / mean
    else:
        rough = np.zeros_like(new)
    return np.concatenate([new, growth, trend, rough], axis=1)


@dataclasses.dataclass
class Guard:
    cfg: GuardConfig
    rule: np.ndarray  # [D] the reference rule's sub-actions
    plan_lo: int
    plan_hi: int
    lo: np.ndarray  # [K * NF] coverage, widened by the margin
    hi: np.ndarray
    idx: np.ndarray  # [K, Hc] macro indices of the rate blocks
    K: int

    @classmethod
    def build(cls, cfg: GuardConfig, sim: SimConfig, covered_lo: np.ndarray, covered_hi: np.ndarray) -> "Guard":
        from apex_bdq.sim.platform_v2 import default_action_v2
        if sim.platform != "v2":
            raise GuardError("the guard is a platform v2 component")
        rule = np.asarray(default_action_v2(sim), dtype=np.int64)
        plan = int(rule[0])
        n, K = sim.sub_actions, sim.num_classes
        covered_lo, covered_hi = np.asarray(covered_lo, np.float64), np.asarray(covered_hi, np.float64)
        if covered_lo.shape != (NF * K,) or covered_hi.shape != (NF * K,):
            raise GuardError(f"coverage must have {NF * K} features per bound ({', '.join(FEATURES)} per class), "
                             f"got {covered_lo.shape} / {covered_hi.shape}")
        span = np.maximum(covered_hi - covered_lo, 0.0)
        idx, _ = _layout(sim)
        return cls(cfg=cfg, rule=rule, plan_lo=max(0, plan - cfg.plan_below), plan_hi=min(n - 1, plan + cfg.plan_above),
                   lo=covered_lo - cfg.ood_margin * span, hi=covered_hi + cfg.ood_margin * span, idx=idx, K=K)

    def inside(self, macro: np.ndarray) -> np.ndarray:
        """[B] bool: the observation's load shape lies within the (widened) coverage."""
        f = load_shape(np.asarray(macro, dtype=np.float64), self.idx)
        return ((f >= self.lo) & (f <= self.hi)).all(1)

    def apply(self, macro: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(guarded actions [B, D], clipped, capped, fell back: [B] bool each) for learned
        `actions` [B, D] taken on `macro` [B, F]. clipped: a plan factor moved into the band;
        capped: the admission level lowered to the cap; fell back: the rule's decision."""
        a = np.asarray(actions)
        K = self.K
        out = a.copy()
        np.clip(out[:, :K], self.plan_lo, self.plan_hi, out=out[:, :K])
        np.minimum(out[:, -1], self.cfg.max_admission, out=out[:, -1])
        back = ~self.inside(macro)
        clipped = (out[:, :K] != a[:, :K]).any(1) & ~back
        capped = (out[:, -1] != a[:, -1]) & ~back
        out[back] = self.rule
        return out, clipped, capped, back

    def to_dict(self) -> dict:
        span = 1.0 + 2.0 * self.cfg.ood_margin
        mid = (self.lo + self.hi) / 2.0
        half = (self.hi - self.lo) / (2.0 * span)
        return {"cfg": dataclasses.asdict(self.cfg), "covered_lo": (mid - half).tolist(),
                "covered_hi": (mid + half).tolist()}

    @classmethod
    def from_dict(cls, d: dict, sim: SimConfig) -> "Guard":
        return cls.build(GuardConfig(**d["cfg"]), sim, np.asarray(d["covered_lo"]), np.asarray(d["covered_hi"]))


# -- coverage of the training days ------------------------------------------------------------------
def _cache_path(sim: SimConfig):
    from apex_bdq.sim.platform import make_rates
    from apex_bdq.yardstick import cache_dir
    rates = make_rates(sim)
    src = rates.source
    try:
        import os
        st = os.stat(src)
        stamp = [str(src), st.st_size, st.st_mtime_ns]
    except (OSError, TypeError):
        stamp = [str(src)]
    d = dataclasses.asdict(sim.replace(num_shards=1, seed=0))
    blob = json.dumps({"sim": d, "trace": stamp, "features": FEATURES, "v": 2}, sort_keys=True, default=str)
    return cache_dir().parent / "guard" / f"{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"


def measure_coverage(sim: SimConfig, shards: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature (min, max) of the load shape over the training days: every tick of the
    training range once (the rule's decisions; the features are arrivals, which decisions do
    not change), and with `sim.augment` on (reshaping or mixed traces), one augmented episode
    per shard on top. The arrivals are drawn with fixed seeds, not the run's: the coverage
    belongs to the training days, and checkpoints of one config share it (and its cache entry)."""
    from apex_bdq.evaluation import eval_config
    from apex_bdq.sim import make_sim
    from apex_bdq.sim.baselines import default_actions
    idx, _ = _layout(sim)
    lo = np.full(NF * sim.num_classes, np.inf)
    hi = np.full(NF * sim.num_classes, -np.inf)
    runs = []
    ecfg, ticks = eval_config(sim.replace(augment=dataclasses.replace(sim.augment, enabled=False, traces=())),
                              shards, "train")
    runs.append((make_sim(ecfg.replace(num_shards=shards, seed=COVERAGE_SEED), split="train", phases="even"), ticks))
    if sim.augment.active:
        runs.append((make_sim(sim.replace(num_shards=shards, seed=COVERAGE_SEED + 7919), split="train",
                              phases="random"),
                     sim.episode_ticks))
    for env, n in runs:
        obs = env.reset(seed=env.cfg.seed)
        a = default_actions(env)
        cb = env.cb
        for t in range(n):
            if t % cb == 0:  # the blocks change once per coarse block
                f = load_shape(obs.macro.astype(np.float64), idx)
                np.minimum(lo, f.min(0), out=lo)
                np.maximum(hi, f.max(0), out=hi)
            obs, _, trunc, _ = env.step(a)
            if trunc:
                break
    return lo, hi


def coverage(sim: SimConfig, use_cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """`measure_coverage` through the cache (a few seconds the first time for a trace)."""
    path = _cache_path(sim)
    if use_cache and path.is_file():
        d = json.loads(path.read_text())
        return np.asarray(d["lo"]), np.asarray(d["hi"])
    lo, hi = measure_coverage(sim)
    if use_cache:
        atomic_write_bytes(path, json.dumps({"lo": lo.tolist(), "hi": hi.tolist(), "features": FEATURES}).encode())
    return lo, hi


def guard_for(cfg: TrainConfig) -> Optional[Guard]:
    """The guard of a run's policy (None: off, or not platform v2)."""
    if not cfg.guard.enabled or cfg.sim.platform != "v2":
        return None
    lo, hi = coverage(cfg.sim)
    return Guard.build(cfg.guard, cfg.sim, lo, hi)


class GuardedPolicy:
    """A greedy network under the guard, as `evaluate_policy` runs it. Per shard decision it
    counts how many the guard clipped (a plan factor moved into the band), how many had their
    admission level capped, and how many it replaced by the rules'; per class and tick on the
    shards that did not fall back, how often the best rule's replicas raised (the floor) or
    lowered (the ceiling) the learned target. The replica bounds come from the predictive
    rule run beside the policy on the simulator (`Predictive` at the guard's margins, one
    instance per distinct margin; at its own default margin on a shard that fell back) and,
    with `static_ceiling`, static provisioning's replicas (`StaticPeak`) as a ceiling; they
    reach the simulator as `CapacityBounds`."""

    def __init__(self, inner, guard: Guard) -> None:
        self.inner, self.guard = inner, guard
        self.name = getattr(inner, "name", "learned")
        self.needs_observation = True

    def reset(self, sim) -> None:
        from apex_bdq.sim.baselines import Predictive
        self.inner.reset(sim)
        self.decisions = self.clipped = self.capped = self.fallback = 0
        self.pool_ticks = self.raised = self.lowered = 0
        self.t = 0
        self.actions = self.back = None
        g = self.guard.cfg
        # role -> margin; one rule per distinct margin (a rule's act steps its own state)
        self.roles = {k: m for k, m in (("floor", g.floor_margin), ("ceiling", g.ceiling_margin),
                                        ("fallback", Predictive().margin_setting)) if m != 0}
        self.rules = {m: Predictive(margin=m) for m in set(self.roles.values())}
        for rule in self.rules.values():
            rule.reset(sim)
        self.static = self.peak = None  # [S, K] static provisioning's replicas; [K] the training days' peak load
        if g.static_ceiling:
            from apex_bdq.sim.baselines import StaticPeak
            rule = StaticPeak(target_utilisation=g.static_ceiling)
            rule.reset(sim)
            self.static = np.broadcast_to(rule.servers, (sim.S, sim.K))
            lo, hi = sim.rates.train
            self.peak = (sim.lam_table[lo:hi] * sim.inv_mu).max(0)

    def act(self, sim, obs):
        from apex_bdq.sim.provisioning import CapacityBounds
        learned, _ = self.inner.act(sim, obs)
        if self.t > 0:  # what the last tick's bounds did, on shards that did not fall back
            free = ~self.back[:, None]
            self.pool_ticks += int(free.sum()) * sim.K
            self.raised += 0 if sim.raised is None else int((sim.raised & free).sum())
            self.lowered += 0 if sim.lowered is None else int((sim.lowered & free).sum())
        if self.actions is None or self.t % self.inner.k == 0:
            self.actions, c, cap, b = self.guard.apply(obs.macro, learned)
            self.back = b
            self.decisions += len(c)
            self.clipped += int(c.sum())
            self.capped += int(cap.sum())
            self.fallback += int(b.sum())
        self.t += 1
        # every rule is stepped every tick (each syncs on its own period)
        by_margin = {m: rule.act(sim, obs)[1] for m, rule in self.rules.items()}
        reps = {role: by_margin[m] for role, m in self.roles.items()}
        lo, hi = reps.get("floor"), reps.get("ceiling")
        if self.static is not None:  # static provisioning sized the peak: above it, no ceiling;
            # never below the floor (the more generous of the two best rules bounds from above)
            static = self.static if lo is None else np.maximum(self.static, lo)
            cap = np.where(sim.monitored()["load"] <= self.peak, static, np.iinfo(np.int32).max)
            hi = cap if hi is None else np.minimum(hi, cap)
        if self.back.any():  # a shard outside training's coverage gets the best rule's replicas
            rule, back = reps["fallback"], self.back[:, None]
            lo = np.where(back, rule, 0 if lo is None else lo)
            hi = np.where(back, rule, np.iinfo(np.int32).max if hi is None else hi)
        return self.actions, CapacityBounds(lo, hi)

    def shares(self) -> dict:
        n, p = max(self.decisions, 1), max(self.pool_ticks, 1)
        return {"guard_decisions": self.decisions, "guard_clipped_share": self.clipped / n,
                "guard_admission_capped_share": self.capped / n, "guard_fallback_share": self.fallback / n,
                "guard_floor_raised_share": self.raised / p, "guard_ceiling_lowered_share": self.lowered / p}


def describe_shares(m: dict) -> str:
    """One line for a guarded policy's metrics `m` (its `GuardedPolicy.shares()`)."""
    line = (f"of {m['guard_decisions']:,} decisions {100 * m['guard_clipped_share']:.1f} % had a plan factor moved "
            f"into the default's band, {100 * m['guard_admission_capped_share']:.1f} % their admission capped, "
            f"{100 * m['guard_fallback_share']:.2f} % fell back to the rules")
    if m.get("guard_floor_raised_share") is not None:
        line += f"; the predictive rule's floor raised {100 * m['guard_floor_raised_share']:.1f} % of the pools' targets"
    if m.get("guard_ceiling_lowered_share"):
        line += f", its ceiling lowered {100 * m['guard_ceiling_lowered_share']:.1f} %"
    return line
