"""Ray Tune sweeps of the Ape-X trainer: the search space, one trial (a Tune function
trainable that runs the driver on the Ray runner), the cluster size a sweep needs and the
results table. `python -m launch.tune` is the entry point (its docstring says how a sweep
runs and how to read its output).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from apex_bdq.config import ConfigError, TraceConfig, TrainConfig, apply_overrides

METRIC = "eval_reward"
CLUSTER_KEYS = ("num_actors", "backend", "num_learners")  # ClusterConfig fields, not TrainConfig fields
# The seed table's columns (launch.seeds): per seed, the policy under its guard on the
# held-out days judged with the yardstick, then the bare network's figures (unguarded_*).
SEED_JUDGED = ("cost", "slo_violation_rate", "refused_share", "cost_saving_vs_best_rule", "oracle_gap_closed",
               "violation_ratio_vs_best_rule", "best_rule_at_violation_rate")

# What the sweep varies unless told otherwise: the Ape-X knobs that matter most (learning
# rate, n-step, priority exponent, the epsilon ladder's base), how many rollout actors feed
# the learner and which learner backend runs it.
DEFAULT_SPACE = {
    "agent.lr": "loguniform:1e-4,1e-3",
    "agent.n_step": "choice:1,3,5",
    "agent.alpha": "uniform:0.4,0.8",
    "agent.eps_base": "uniform:0.2,0.6",
    "num_actors": "choice:1,2",
    "backend": "choice:ddp,deepspeed,accelerate",
}

RESULT_COLUMNS = ("eval_reward", "hpa_eval_reward", "reward_minus_hpa", "reward_ratio_hpa", "slo_violation_rate",
                  "hpa_slo_violation_rate", "updates", "env_steps")


def _value(s: str):
    """A search-space literal: int, float, or string (apply_overrides parses it again)."""
    s = s.strip()
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


def parse_space(items: dict[str, str]):
    """KEY -> SPEC strings into Tune domains (see the module docstring)."""
    from ray import tune
    out = {}
    for key, spec in items.items():
        if key not in CLUSTER_KEYS and not re.fullmatch(r"((sim|agent|net|pref)\.)?\w+", key):
            raise ConfigError(f"search space key {key!r}: use a config field (agent.lr, sim.num_shards, ...) or "
                              f"one of {', '.join(CLUSTER_KEYS)}")
        kind, sep, rest = spec.partition(":")
        if not sep:
            out[key] = _value(spec)
            continue
        args = [_value(x) for x in rest.split(",") if x.strip()]
        try:
            if kind in ("loguniform", "uniform", "randint"):
                if len(args) != 2 or not all(isinstance(x, (int, float)) for x in args):
                    raise ValueError("needs LO,HI")
                lo, hi = args
                out[key] = {"loguniform": tune.loguniform, "uniform": tune.uniform,
                            "randint": tune.randint}[kind](lo, hi)
            elif kind == "choice":
                out[key] = tune.choice(args)
            elif kind == "grid":
                out[key] = tune.grid_search(args)
            else:
                raise ValueError(f"unknown kind {kind!r} (loguniform, uniform, randint, choice, grid)")
        except (ValueError, TypeError) as e:
            raise ConfigError(f"search space {key}={spec!r}: {e}") from None
    return out


def _fmt(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def trial_overrides(config: dict) -> list[str]:
    """The `--set` overrides of a trial: the sweep's fixed ones, then the sampled ones."""
    fixed = config["fixed"]
    sampled = [f"{k}={_fmt(v)}" for k, v in sorted(config["space"].items()) if k not in CLUSTER_KEYS + ("seed",)]
    return list(fixed["overrides"]) + sampled


def trial_cluster(config: dict) -> dict:
    fixed, sp = config["fixed"], config["space"]
    return {"num_actors": int(sp.get("num_actors", fixed["num_actors"])),
            "backend": str(sp.get("backend", fixed["backend"])),
            "num_learners": int(sp.get("num_learners", fixed["num_learners"]))}


def trial_train_config(config: dict) -> TrainConfig:
    """The TrainConfig a trial runs: preset, trace, seed, overrides, then the sweep's own budget
    and evaluation cadence (which `best_config.json` leaves out)."""
    from apex_bdq.presets import PRESETS
    fixed = config["fixed"]
    cfg = PRESETS[fixed["preset"]]
    if fixed.get("seed") is not None:
        cfg = dataclasses.replace(cfg, seed=fixed["seed"], sim=cfg.sim.replace(seed=fixed["seed"]))
    if fixed.get("trace"):
        cfg = dataclasses.replace(cfg, sim=cfg.sim.replace(trace=TraceConfig(path=fixed["trace"])))
    cfg = apply_overrides(cfg, trial_overrides(config))
    cfg = dataclasses.replace(cfg, minutes=fixed["minutes"], eval_every_s=fixed["eval_every_s"],
                              updates=fixed.get("updates", cfg.updates))
    seed = config["space"].get("seed")
    if seed is not None:  # a seed table's trial: the run's seed and its simulator's, as --seed sets them
        cfg = dataclasses.replace(cfg, seed=int(seed), sim=cfg.sim.replace(seed=int(seed)))
    return cfg


def train_args(config: dict) -> list[str]:
    """`python -m launch.train` arguments that reproduce a trial's settings."""
    fixed = config["fixed"]
    args = ["--preset", fixed["preset"]]
    if fixed.get("trace"):
        args += ["--trace", fixed["trace"]]
    seed = config["space"].get("seed", fixed.get("seed"))
    if seed is not None:
        args += ["--seed", str(seed)]
    if fixed.get("updates") is not None:
        args += ["--updates", str(fixed["updates"])]
    for o in trial_overrides(config):
        args += ["--set", o]
    cl = trial_cluster(config)
    return args + ["--num-actors", str(cl["num_actors"]), "--num-learners", str(cl["num_learners"]),
                   "--backend", cl["backend"]]


def trial_resources(config: dict):
    """What one trial holds while it runs: a bundle for the trial itself (its driver loop and
    the evaluations), one per rollout actor and one per replay shard. Those actors are created
    inside the trial, so Tune's placement group captures them (and Tune refuses any that fit
    no bundle but the trial's own); the Ray Train learners get a placement group of their own,
    outside this one (the cluster must have room for them: see `ray_cpus`)."""
    import ray
    from ray import tune
    fixed = config["fixed"]
    cl = trial_cluster(config)
    have = ray.cluster_resources() if ray.is_initialized() else {}
    actor = {"CPU": fixed["actor_cpus"]}
    if "rollout" in have:  # ApexRun asks for these placement units when the cluster declares them
        actor["rollout"] = 0.001
    bundles = [{"CPU": fixed["trial_cpus"]}] + [dict(actor) for _ in range(cl["num_actors"])]
    if "learner" in have:
        bundles += [{"learner": 0.001} for _ in range(fixed["num_replay_shards"])]
    return tune.PlacementGroupFactory(bundles)


def _row(ev: dict, extra: dict) -> dict:
    r, h = float(ev["eval_reward"]), float(ev["hpa_eval_reward"])
    return {"eval_reward": r, "hpa_eval_reward": h, "reward_minus_hpa": r - h,
            # only meaningful against a positive HPA reward
            "reward_ratio_hpa": r / h if h > 0 else float("nan"),
            "slo_violation_rate": float(ev["slo_violation_rate"]),
            "hpa_slo_violation_rate": float(ev["hpa_slo_violation_rate"]), **extra}


def run_trial(config: dict) -> None:
    """The Tune function trainable: one Ape-X run, reporting every periodic evaluation and a
    final one (with the checkpoint)."""
    import ray
    import torch
    from ray import tune

    from apex_bdq.driver import Driver
    from apex_bdq.evaluation import evaluate_against_hpa, selection_split
    from apex_bdq.ray_runner import ApexRun, copy_checkpoint
    torch.set_num_threads(1)  # the trial shares its cores with the actors and the learner
    fixed = config["fixed"]
    cfg = trial_train_config(config)
    cl = trial_cluster(config)
    ctx = tune.get_context()
    trial_dir = Path(ctx.get_trial_dir() or tempfile.mkdtemp(prefix="apex_bdq_trial_"))
    work = Path(tempfile.mkdtemp(prefix=f"apex_bdq_tune_{ctx.get_trial_id()}_"))
    spec = cfg.cluster.replace(num_actors=cl["num_actors"], num_learners=cl["num_learners"], backend=cl["backend"],
                               num_replay_shards=fixed["num_replay_shards"], actor_cpus=fixed["actor_cpus"],
                               learner_cpus=fixed["learner_cpus"], storage_path=str(work / "ray_train"))
    run = ApexRun(cfg, spec)
    hpa_cache: dict = {}
    split = selection_split(cfg.sim)  # the validation days: the held-out ones stay unseen by the sweep
    reported = [0]
    periodic_max = fixed["max_reports"] - 1  # the final report is iteration <= max_reports (ASHA's max_t)

    def evaluate(net, ticks, shards, replicas=1):
        # Not before the learner's first update (the initial weights would tell ASHA nothing
        # about the trial's settings), nor past the reports ASHA's max_t leaves room for.
        if reported[0] >= periodic_max or ray.get(run.store.status.remote()).version <= 0:
            return None
        return evaluate_against_hpa(net, cfg, ticks, shards, hpa_cache, replicas, split=split)

    def progress(st: dict) -> None:
        ev = st.get("eval")
        if ev is None:
            return
        lr = st.get("learner") or {}
        reported[0] += 1
        tune.report(_row(ev, {"final": False, "t_s": float(st["t_s"]), "env_steps": int(st.get("env_steps", 0)),
                              "updates": int(lr.get("updates", 0)), "eval_ticks": cfg.eval_ticks}))

    try:  # the trial's score: its final policy on the validation days (the held-out days stay
        # unseen by the sweep; `launch.evaluate` reports the winner there)
        out = Driver(cfg, run, on_progress=progress, evaluate=evaluate, final_split=split).run()
    finally:
        run.shutdown()
    ck_dir = work / "checkpoint"
    from learner.train_loop import CHECKPOINT_NAME
    ck = copy_checkpoint(out["result"], ck_dir / CHECKPOINT_NAME)
    tune.report(_row(out, {"final": True, "t_s": float(out["train_seconds"]), "env_steps": int(out["env_steps"]),
                             "updates": int(out["updates"]), "eval_ticks": cfg.final_eval_ticks or -1,
                             "trial_dir": str(trial_dir)}),
                checkpoint=tune.Checkpoint.from_directory(str(ck_dir)) if ck is not None else None)
    shutil.rmtree(work, ignore_errors=True)  # Tune has copied the checkpoint into the experiment folder


# -- the driver ---------------------------------------------------------------------------------
def ray_cpus(fixed: dict, space_max_actors: int, max_learners: int, concurrent: int) -> int:
    """Logical CPUs a local cluster needs for `concurrent` trials of the largest size."""
    per_trial = fixed["trial_cpus"] + space_max_actors * fixed["actor_cpus"] + max_learners * fixed["learner_cpus"]
    return max(os.cpu_count() or 1, math.ceil(concurrent * per_trial - 1e-9))


def domain_max(v, default: int) -> int:
    """The largest value a (sampled or fixed) integer search-space entry can take."""
    if isinstance(v, (int, float)):
        return int(v)
    if isinstance(v, dict) and "grid_search" in v:
        return max(int(x) for x in v["grid_search"])
    cats = getattr(v, "categories", None)
    if cats is not None:
        return max(int(x) for x in cats)
    upper = getattr(v, "upper", None)
    return int(upper) if upper is not None else default


def results_table(grid) -> list[dict]:
    """One row per trial: searched values, its last report and whether it ran to the end."""
    rows = []
    for res in grid:
        m = res.metrics or {}
        cfg = res.config or {}
        sp = cfg.get("space", {})
        row = {"trial_id": m.get("trial_id"), "status": "error" if res.error else
               ("completed" if m.get("final") else "stopped early"),
               "iterations": m.get("training_iteration"), **{k: sp[k] for k in sorted(sp)}}
        for k in RESULT_COLUMNS:
            row[k] = m.get(k)
        row["checkpoint"] = res.checkpoint.path if res.checkpoint is not None else None
        row["train_args"] = train_args(cfg) if cfg else None
        rows.append(row)
    return sorted(rows, key=lambda r: str(r["trial_id"]))


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def pick_best(rows: list[dict]) -> Optional[dict]:
    """The highest final evaluation reward among trials that ran to the end; the periodic
    reward of trials ASHA stopped (a shorter slice) only if none did."""
    for pool in ([r for r in rows if r["status"] == "completed"], [r for r in rows if r["status"] != "error"]):
        pool = [r for r in pool if _ok(r.get(METRIC))]
        if pool:
            return max(pool, key=lambda r: r[METRIC])
    return None


# -- seed tables (launch.seeds) -----------------------------------------------------------------
def _judged(m: dict, y: dict, prefix: str = "") -> dict:
    out = {prefix + k: m.get(k) for k in ("cost", "slo_violation_rate", "refused_share")}
    for k in SEED_JUDGED[3:]:
        out[prefix + k] = y.get(k)
    return out


def run_seed_trial(config: dict) -> None:
    """The Tune function trainable of a seed table: one Ape-X run of one seed at the table's
    budget, no periodic evaluation (nothing is chosen from it), then the final evaluation on
    the held-out days with and without the guard, each judged with the yardstick (the driver
    computed the frontiers into the cache before the trials started)."""
    import torch
    from ray import tune

    from apex_bdq import yardstick
    from apex_bdq.driver import Driver
    from apex_bdq.ray_runner import ApexRun
    torch.set_num_threads(1)  # the trial shares its cores with the actors and the learner
    fixed = config["fixed"]
    cfg = trial_train_config(config)
    cl = trial_cluster(config)
    work = Path(tempfile.mkdtemp(prefix="apex_bdq_seed_"))
    spec = cfg.cluster.replace(num_actors=cl["num_actors"], num_learners=cl["num_learners"], backend=cl["backend"],
                               num_replay_shards=fixed["num_replay_shards"], actor_cpus=fixed["actor_cpus"],
                               learner_cpus=fixed["learner_cpus"], storage_path=str(work / "ray_train"))
    ck = os.path.join(fixed["checkpoint_dir"], f"seed_{cfg.seed}.pt") if fixed.get("checkpoint_dir") else None
    # While the trial trains its periodic checkpoints go to seed_N.pt.partial; seed_N.pt
    # appears only once training has ended, so nothing evaluates a mid-training policy as
    # the seed's (a trial that fails leaves the .partial for `launch.train --resume`).
    partial = ck + ".partial" if ck else None
    if ck:
        for stale in (partial, ck):  # an earlier table's of the same name: never taken for this run's
            Path(stale).unlink(missing_ok=True)
        spec = spec.replace(checkpoint_path=partial)
    run = ApexRun(cfg, spec)
    try:
        out = Driver(cfg, run, checkpoint=partial, evaluate=False, final_split="eval").run()
    finally:
        run.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    if ck and out.get("checkpoint") == partial and os.path.exists(partial):
        os.replace(partial, ck)
    else:  # the run copied no learner checkpoint
        ck = None
    row = {"seed": cfg.seed, "checkpoint": ck, "updates": int(out["updates"]), "updates_budget": out.get("updates_budget"),
           "stopped_by": out.get("stopped_by"), "train_seconds": float(out["train_seconds"]),
           "env_steps": int(out["env_steps"]), "final": True}
    whole = cfg.final_eval_ticks is None  # the yardstick judges the whole held-out range only

    def judge(m: dict) -> dict:
        return yardstick.report(cfg.sim, m, cfg.eval_shards, cfg.final_eval_replicas) if whole else {}

    m = out["learned"]
    row.update(_judged(m, judge(m)))
    if whole and fixed.get("select_on_val") and ck:  # the same policy on the validation days, to pick a seed by
        from apex_bdq.checkpoint import load_policy
        from apex_bdq.evaluation import evaluate_learned
        v = evaluate_learned(load_policy(ck, cfg.sim).net, cfg, None, cfg.eval_shards, cfg.final_eval_replicas,
                             split="val")
        row.update(_judged(v, yardstick.report(cfg.sim, v, cfg.eval_shards, cfg.final_eval_replicas, split="val"),
                           "val_"))
    row.update({k: m.get(k) for k in ("guard_clipped_share", "guard_admission_capped_share",
                                      "guard_fallback_share", "guard_floor_raised_share",
                                      "guard_ceiling_lowered_share")})
    if "learned_unguarded" in out:
        u = out["learned_unguarded"]
        row.update(_judged(u, judge(u), "unguarded_"))
    tune.report(row)


def pick_seed(rows: list[dict]) -> Optional[dict]:
    """The seed to deploy, chosen on the validation days alone (never the held-out ones): the
    largest cost saving vs the best rule there, ties to the lower violation rate; None when no
    seed has a validation saving (outside every frontier, or not evaluated there)."""
    pool = [r for r in rows if _ok(r.get("val_cost_saving_vs_best_rule"))]
    if not pool:
        return None
    return max(pool, key=lambda r: (r["val_cost_saving_vs_best_rule"], -(r.get("val_slo_violation_rate") or 0.0)))


def seed_summary(rows: list[dict], target_gap: float = 0.5) -> dict:
    """Across the seeds: how many close `target_gap` of the oracle gap and beat the best rule,
    with the mean and spread of both figures (guarded, then unguarded)."""
    import statistics
    out: dict = {"seeds": len(rows), "target_oracle_gap_closed": target_gap}
    for prefix in ("", "unguarded_"):
        gaps = [r.get(prefix + "oracle_gap_closed") for r in rows]
        savings = [r.get(prefix + "cost_saving_vs_best_rule") for r in rows]
        ok_g = [g for g in gaps if _ok(g)]
        ok_s = [x for x in savings if _ok(x)]
        out[prefix + "seeds_meeting_gap_target"] = sum(g >= target_gap for g in ok_g)
        out[prefix + "seeds_beating_best_rule"] = sum(x > 0 for x in ok_s)
        out[prefix + "mean_oracle_gap_closed"] = statistics.fmean(ok_g) if ok_g else None
        out[prefix + "mean_cost_saving_vs_best_rule"] = statistics.fmean(ok_s) if ok_s else None
        out[prefix + "sd_cost_saving_vs_best_rule"] = statistics.stdev(ok_s) if len(ok_s) > 1 else None
    best = pick_seed(rows)
    out["selected_seed"] = None if best is None else best["seed"]
    for k in ("val_cost_saving_vs_best_rule", "cost_saving_vs_best_rule", "oracle_gap_closed", "slo_violation_rate"):
        out["selected_" + k] = None if best is None else best.get(k)
    return out
