"""Hyperparameter sweep of the distributed (Ape-X) trainer with Ray Tune and ASHA.

    python -m launch.tune [--preset default|smoke] [--trials N] [--minutes M] [--storage DIR]
        [--name NAME] [--space KEY=SPEC ...] [--set KEY=VALUE ...] [--resume]

Every trial is one `ApexRun` (rollout actors, replay shard, Ray Train learner group) started
from a Tune function trainable. While it trains, the trial evaluates the greedy policy and
Kubernetes HPA on the same slice of the held-out range every `--eval-every` seconds and
reports both (`tune.report`); ASHA stops the trials whose reward trails at its rungs. A trial
that runs its whole budget ends with a longer evaluation (the preset's `final_eval_ticks`)
and reports its checkpoint. The sweep writes `results.csv`, `results.json` and
`best_config.json` into the experiment folder; `python -m launch.train --config
best_config.json` trains with the winner's settings.

Search space: `--space KEY=SPEC`, KEY a config field (`agent.lr`, `sim.*`, ...) or
`num_actors` / `backend` / `num_learners`; SPEC one of `loguniform:LO,HI`, `uniform:LO,HI`,
`randint:LO,HI` (HI excluded), `choice:A,B,...`, `grid:A,B,...` or a single fixed value.
Given keys replace the defaults in `DEFAULT_SPACE`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from apex_bdq.config import ConfigError, TraceConfig, TrainConfig, apply_overrides
from launch._io import write_json

METRIC = "eval_reward"
CLUSTER_KEYS = ("num_actors", "backend", "num_learners")  # ClusterConfig fields, not TrainConfig fields

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
    sampled = [f"{k}={_fmt(v)}" for k, v in sorted(config["space"].items()) if k not in CLUSTER_KEYS]
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
    return dataclasses.replace(cfg, minutes=fixed["minutes"], eval_every_s=fixed["eval_every_s"])


def train_args(config: dict) -> list[str]:
    """`python -m launch.train` arguments that reproduce a trial's settings."""
    fixed = config["fixed"]
    args = ["--preset", fixed["preset"]]
    if fixed.get("trace"):
        args += ["--trace", fixed["trace"]]
    if fixed.get("seed") is not None:
        args += ["--seed", str(fixed["seed"])]
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

    from apex_bdq.ray_runner import ApexRun, copy_checkpoint
    from apex_bdq.evaluation import evaluate_against_hpa
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
    reported = [0]
    periodic_max = fixed["max_reports"] - 1  # the final report is iteration <= max_reports (ASHA's max_t)

    def evaluate(net, ticks):
        # Not before the learner's first update (the initial weights would tell ASHA nothing
        # about the trial's settings), nor past the reports ASHA's max_t leaves room for.
        if reported[0] >= periodic_max or ray.get(run.store.status.remote()).version <= 0:
            return {"eval_reward": float("nan"), "hpa_eval_reward": float("nan"), "slo_violation_rate": float("nan"),
                    "hpa_slo_violation_rate": float("nan"), "skipped": True}
        return evaluate_against_hpa(net, cfg, ticks, cfg.eval_shards, hpa_cache)

    def progress(st: dict) -> None:
        ev = st.get("eval")
        if ev is None or ev.get("skipped"):
            return
        lr = st.get("learner") or {}
        reported[0] += 1
        tune.report(_row(ev, {"final": False, "t_s": float(st["t_s"]), "env_steps": int(st.get("env_steps", 0)),
                              "updates": int(lr.get("updates", 0)), "eval_ticks": cfg.eval_ticks}))

    try:
        out = run.run(on_progress=progress, evaluate=evaluate)
        net, _ = run.current_policy_net()
    finally:
        run.shutdown()
    final = evaluate_against_hpa(net, cfg, cfg.final_eval_ticks, cfg.eval_shards, hpa_cache, cfg.final_eval_replicas)
    st = out["status"]
    lr = st.get("learner") or {}
    ck_dir = work / "checkpoint"
    from learner.train_loop import CHECKPOINT_NAME
    ck = copy_checkpoint(out["result"], ck_dir / CHECKPOINT_NAME)
    tune.report(_row(final, {"final": True, "t_s": float(out["train_seconds"]), "env_steps": int(st["env_steps"]),
                             "updates": int(lr.get("updates", 0)), "eval_ticks": cfg.final_eval_ticks or -1,
                             "trial_dir": str(trial_dir)}),
                checkpoint=tune.Checkpoint.from_directory(str(ck_dir)) if ck is not None else None)
    shutil.rmtree(work, ignore_errors=True)  # Tune has copied the checkpoint into the experiment folder


# -- the driver ---------------------------------------------------------------------------------
def ray_cpus(fixed: dict, space_max_actors: int, max_learners: int, concurrent: int) -> int:
    """Logical CPUs a local cluster needs for `concurrent` trials of the largest size."""
    per_trial = fixed["trial_cpus"] + space_max_actors * fixed["actor_cpus"] + max_learners * fixed["learner_cpus"]
    return max(os.cpu_count() or 1, math.ceil(concurrent * per_trial - 1e-9))


def _domain_max(v, default: int) -> int:
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


def print_table(rows: list[dict], keys: list[str]) -> None:
    cols = ["trial_id", "status", "iterations", *keys, "eval_reward", "hpa_eval_reward", "reward_minus_hpa",
            "reward_ratio_hpa", "slo_violation_rate", "hpa_slo_violation_rate"]

    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    table = [[cell(r.get(c)) for c in cols] for r in rows]
    width = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, width)))
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, width)))


def write_results(exp_dir: Path, rows: list[dict], keys: list[str]) -> tuple[Path, Path]:
    csv_path, json_path = exp_dir / "results.csv", exp_dir / "results.json"
    cols = ["trial_id", "status", "iterations", *keys, *RESULT_COLUMNS, "checkpoint"]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    write_json(json_path, {"metric": METRIC, "mode": "max", "trials": rows})
    return csv_path, json_path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default", help="launch.train preset every trial starts from")
    ap.add_argument("--trials", type=int, default=8, help="samples of the search space (x the size of any grid)")
    ap.add_argument("--minutes", type=float, help="training budget per trial (default: the preset's)")
    ap.add_argument("--eval-every", type=float,
                    help="seconds between a trial's evaluations against HPA, i.e. its reports to ASHA "
                         "(default: a quarter of --minutes, at least 5)")
    ap.add_argument("--storage", default="runs/tune", help="Tune storage folder")
    ap.add_argument("--name", default="apex_bdq_tune", help="experiment name (a folder under --storage)")
    ap.add_argument("--space", action="append", default=[], metavar="KEY=SPEC",
                    help="search-space entry, e.g. agent.lr=loguniform:1e-4,1e-3 or backend=ddp (repeatable; "
                         "replaces that key's default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every trial, as launch.train --set")
    ap.add_argument("--trace", help="CSV trace (default: the bundled one)")
    ap.add_argument("--seed", type=int, help="training seed of every trial")
    ap.add_argument("--search-seed", type=int, default=0, help="seed of the random search")
    ap.add_argument("--max-concurrent", type=int, default=1,
                    help="trials at once (default 1: on a small machine one trial already fills the cores)")
    ap.add_argument("--grace", type=int, default=1, help="ASHA grace period, in reports")
    ap.add_argument("--reduction-factor", type=float, default=2.0, help="ASHA reduction factor")
    ap.add_argument("--num-actors", type=int, default=2, help="rollout actors when the space does not vary them")
    ap.add_argument("--num-learners", type=int, default=1)
    ap.add_argument("--backend", default="ddp", choices=("ddp", "deepspeed", "accelerate"),
                    help="learner backend when the space does not vary it")
    ap.add_argument("--num-replay-shards", type=int, default=1)
    ap.add_argument("--trial-cpus", type=float, default=0.5, help="logical CPUs of a trial's own loop")
    ap.add_argument("--actor-cpus", type=float, default=0.5, help="logical CPUs per rollout actor")
    ap.add_argument("--learner-cpus", type=float, default=0.5, help="logical CPUs per learner worker")
    ap.add_argument("--address", help="an existing Ray cluster; default: start a local one")
    ap.add_argument("--no-dashboard", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="continue the experiment at --storage/--name if there is one (finished trials are kept, "
                         "unfinished ones start again; the stored search space and settings are used)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)

    from apex_bdq.presets import PRESETS
    if a.preset not in PRESETS:
        print(f"error: unknown preset {a.preset!r} (choose from {', '.join(sorted(PRESETS))})", file=sys.stderr)
        return 2
    base = PRESETS[a.preset]
    minutes = a.minutes if a.minutes is not None else base.minutes
    eval_every = a.eval_every if a.eval_every is not None else max(5.0, minutes * 60.0 / 4)
    fixed = {"preset": a.preset, "overrides": list(a.set), "trace": os.path.abspath(a.trace) if a.trace else None,
             "seed": a.seed, "minutes": minutes, "eval_every_s": eval_every,
             "max_reports": max(1, int(minutes * 60.0 // eval_every)) + 1,
             "num_actors": a.num_actors, "num_learners": a.num_learners, "backend": a.backend,
             "num_replay_shards": a.num_replay_shards, "trial_cpus": a.trial_cpus, "actor_cpus": a.actor_cpus,
             "learner_cpus": a.learner_cpus}
    items = dict(DEFAULT_SPACE)
    try:
        for s in a.space:
            if "=" not in s:
                raise ConfigError(f"--space {s!r} is not KEY=SPEC")
            k, v = s.split("=", 1)
            items[k.strip()] = v.strip()
        space = parse_space(items)
        # Fail before any cluster starts: every override must apply to the preset.
        probe = {k: (v if isinstance(v, (int, float, str)) else None) for k, v in space.items()}
        trial_train_config({"fixed": fixed, "space": {k: v for k, v in probe.items() if v is not None}})
        if minutes <= 0 or eval_every <= 0 or a.trials < 1 or a.max_concurrent < 1:
            raise ConfigError("--minutes, --eval-every, --trials and --max-concurrent must be > 0")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # KNOWN.md: token auth breaks the dashboard and jobs
    storage = Path(a.storage).resolve()
    exp_dir = storage / a.name
    if not ray.is_initialized():
        if a.address:
            ray.init(address=a.address, log_to_driver=not a.quiet)
        else:
            actors = _domain_max(space.get("num_actors", a.num_actors), a.num_actors)
            learners = _domain_max(space.get("num_learners", a.num_learners), a.num_learners)
            ray.init(address="local", num_cpus=ray_cpus(fixed, actors, learners, a.max_concurrent),
                     resources={"rollout": 4.0 * actors * a.max_concurrent,
                                "learner": 4.0 * learners * a.max_concurrent},
                     include_dashboard=not a.no_dashboard, log_to_driver=not a.quiet)

    # The replay's C++ sum-tree walk is built at first use (~30 s) and cached; build it here, so
    # that a stale cache does not eat a trial's learner budget (a few seconds when it is current).
    from replay_server._cpu_kernels import kernels
    kernels()
    trainable = tune.with_resources(run_trial, trial_resources)
    t0 = time.perf_counter()
    if a.resume and tune.Tuner.can_restore(str(exp_dir)):
        print(f"resuming {exp_dir}")
        tuner = tune.Tuner.restore(str(exp_dir), trainable=trainable, resume_unfinished=True, restart_errored=True)
    else:
        if a.resume:
            print(f"nothing to resume at {exp_dir}: starting a new sweep")
        scheduler = ASHAScheduler(time_attr="training_iteration", max_t=fixed["max_reports"], grace_period=a.grace,
                                  reduction_factor=a.reduction_factor)
        tuner = tune.Tuner(
            trainable, param_space={"fixed": fixed, "space": space},
            # The concurrency limit goes to the variant generator itself: TuneConfig's
            # max_concurrent_trials is ignored (with a warning) beside a given generator.
            tune_config=tune.TuneConfig(metric=METRIC, mode="max", scheduler=scheduler, num_samples=a.trials,
                                        search_alg=BasicVariantGenerator(max_concurrent=a.max_concurrent,
                                                                         random_state=a.search_seed)),
            run_config=tune.RunConfig(name=a.name, storage_path=str(storage), verbose=0 if a.quiet else 1,
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=1)))
    grid = tuner.fit()
    sweep_s = time.perf_counter() - t0

    rows = results_table(grid)
    keys = sorted({k for r in grid for k in ((r.config or {}).get("space") or {})})
    print(f"\nsweep {exp_dir}: {len(rows)} trials in {sweep_s:.0f} s "
          f"(metric {METRIC}: greedy policy on the held-out range; HPA on the same evaluation)")
    print_table(rows, keys)
    csv_path, json_path = write_results(exp_dir, rows, keys)
    print(f"wrote {csv_path}\nwrote {json_path}")
    best = pick_best(rows)
    if best is None:
        print("no trial reported a finite evaluation reward: no best config", file=sys.stderr)
        return 1
    best_path = exp_dir / "best_config.json"
    write_json(best_path, {"train_args": best["train_args"], "trial_id": best["trial_id"], "status": best["status"],
                           **{k: best.get(k) for k in keys},
                           **{k: best.get(k) for k in RESULT_COLUMNS}, "checkpoint": best["checkpoint"],
                           "experiment": str(exp_dir), "sweep_seconds": sweep_s})
    r, h = best[METRIC], best["hpa_eval_reward"]
    print(f"best trial {best['trial_id']} ({best['status']}): reward {r:.4f} vs HPA {h:.4f} "
          f"({r - h:+.4f})\nwrote {best_path}  (python -m launch.train --config {best_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
