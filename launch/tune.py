"""Hyperparameter sweep of the distributed (Ape-X) trainer with Ray Tune and ASHA.

    python -m launch.tune [--preset default|smoke] [--trials N] [--minutes M] [--updates N] [--storage DIR]
        [--name NAME] [--space KEY=SPEC ...] [--set KEY=VALUE ...] [--resume]

Every trial is one `ApexRun` (rollout actors, replay shard, Ray Train learner group) started
from a Tune function trainable. While it trains, the trial evaluates the greedy policy and
Kubernetes HPA on the same slice of the validation days (the training range on a trace
without them; never the held-out days) every `--eval-every` seconds and
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
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

from apex_bdq.config import ConfigError
from apex_bdq.tuning import (DEFAULT_SPACE, METRIC, RESULT_COLUMNS, domain_max, parse_space, pick_best, ray_cpus,
                             results_table, run_trial, trial_resources, trial_train_config)
from launch._io import NO_DASHBOARD_HELP, write_json


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
    ap.add_argument("--updates", type=int, help="budget in learner updates per trial (default: the preset's; "
                                                "--minutes then caps the wall time)")
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
    ap.add_argument("--no-dashboard", action="store_true", help=NO_DASHBOARD_HELP)
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
             "seed": a.seed, "minutes": minutes, "updates": a.updates if a.updates is not None else base.updates,
             "eval_every_s": eval_every,
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
        if minutes <= 0 or eval_every <= 0 or a.trials < 1 or a.max_concurrent < 1 or \
                (a.updates is not None and a.updates < 1):
            raise ConfigError("--minutes, --updates, --eval-every, --trials and --max-concurrent must be > 0")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator
    storage = Path(a.storage).resolve()
    exp_dir = storage / a.name
    if not ray.is_initialized():
        if a.address:
            ray.init(address=a.address, log_to_driver=not a.quiet)
        else:
            actors = domain_max(space.get("num_actors", a.num_actors), a.num_actors)
            learners = domain_max(space.get("num_learners", a.num_learners), a.num_learners)
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
          f"(metric {METRIC}: greedy policy on the validation days; HPA on the same evaluation)")
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
