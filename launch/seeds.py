"""Seed robustness: the same training run for K seeds (Ray Tune trials), judged on the
held-out days with the yardstick.

    python -m launch.seeds [--preset default] [--seeds K | --seed-list 0,1,2] [--updates N]
        [--minutes M] [--set KEY=VALUE ...] [--trace CSV] [--json PATH] [--storage DIR]
        [--name NAME] [--max-concurrent C] [--num-actors A] [--no-select] [--quiet]

Every seed is one Ape-X run (`launch.train`'s, with `--seed`) at the preset's budget in
learner updates (`--updates` overrides it; `--minutes` caps the wall time, 3x the preset's by default), trials one after
another by default (on 2 cores two would slow each other down and change nothing else).
No evaluation runs while a trial trains; at its end the policy is evaluated on the held-out
days under its guard and without it, and judged against the rules' frontiers and the oracle
(computed once, before the first trial, and cached). The table: per seed the updates made,
cost and SLO violation rate, refused share, cost saving vs the best rule at equal violation
rate, the share of the best-rule -> oracle gap closed, the guard's shares; then how many
seeds meet the target (>= 50 % of the gap by default, `--target-gap`). Each seed's
checkpoint is kept for `launch.evaluate`: STORAGE/NAME/checkpoints/seed_N.pt, written when the
trial's training has ended (seed_N.pt.partial while it trains).

The seed to deploy is picked on the validation days (the last 15 % of the days before the
held-out ones; no seed trains on them): each seed's guarded policy is judged there with the
yardstick too (`val_*` keys), and the one with the largest saving there is named with its
held-out figures (`summary.selected_*`). The held-out days play no part in the choice.
`--no-select` skips it. JSON keys: `seeds` (one row per seed), `summary`, `command`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

from apex_bdq.config import ConfigError
from launch._io import NO_DASHBOARD_HELP, write_json

COLUMNS = (("seed", "seed", "{}"), ("updates", "updates", "{:,}"), ("stopped_by", "stopped by", "{}"),
           ("cost", "cost", "{:.3f}"), ("slo_violation_rate", "violation", "{:.4f}"),
           ("refused_share", "refused", "{:.2%}"), ("cost_saving_vs_best_rule", "saving vs best rule", "{:+.1%}"),
           ("oracle_gap_closed", "oracle gap closed", "{:.0%}"), ("guard_fallback_share", "fallback", "{:.1%}"),
           ("guard_clipped_share", "clipped", "{:.1%}"), ("guard_floor_raised_share", "floor raised", "{:.1%}"),
           ("guard_ceiling_lowered_share", "ceiling lowered", "{:.1%}"),
           ("unguarded_cost_saving_vs_best_rule", "no guard: saving", "{:+.1%}"),
           ("unguarded_oracle_gap_closed", "no guard: gap closed", "{:.0%}"),
           ("unguarded_slo_violation_rate", "no guard: violation", "{:.4f}"),
           ("val_cost_saving_vs_best_rule", "validation days: saving", "{:+.1%}"))


def cell(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def print_table(rows: list[dict]) -> None:
    table = [[cell(r.get(k), f) for k, _, f in COLUMNS] for r in rows]
    heads = [h for _, h, _ in COLUMNS]
    width = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(heads)]
    print("  ".join(h.rjust(w) for h, w in zip(heads, width)))
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, width)))


def seed_list(a) -> list[int]:
    if a.seed_list:
        try:
            seeds = [int(x) for x in a.seed_list.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--seed-list {a.seed_list!r}: comma-separated integers, e.g. 0,1,2") from None
    else:
        seeds = list(range(a.seeds))
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"the seeds must be distinct and at least one, got {seeds}")
    return seeds


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.seeds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default", help="launch.train preset every seed runs")
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..K-1 (default 5)")
    ap.add_argument("--seed-list", help="these seeds instead, comma-separated")
    ap.add_argument("--updates", type=int, help="budget in learner updates per seed (default: the preset's)")
    ap.add_argument("--minutes", type=float,
                    help="wall-clock cap per seed (default: 3x the preset's: the budget is in updates, and this "
                         "machine's speed drifts up to 3x between days; the cap only stops a stuck trial)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override of every seed")
    ap.add_argument("--trace", help="CSV trace (default: the bundled one)")
    ap.add_argument("--target-gap", type=float, default=0.5, help="share of the oracle gap a seed must close")
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--storage", default="runs/seeds", help="Tune storage folder")
    ap.add_argument("--name", default="apex_bdq_seeds", help="experiment name (a folder under --storage)")
    ap.add_argument("--max-concurrent", type=int, default=1, help="seeds run at once (default 1: on 2 cores)")
    ap.add_argument("--num-actors", type=int, default=2)
    ap.add_argument("--num-learners", type=int, default=1)
    ap.add_argument("--backend", default="ddp", choices=("ddp", "deepspeed", "accelerate"))
    ap.add_argument("--trial-cpus", type=float, default=0.5)
    ap.add_argument("--actor-cpus", type=float, default=0.5)
    ap.add_argument("--learner-cpus", type=float, default=0.5)
    ap.add_argument("--no-select", action="store_true",
                    help="do not judge the seeds on the validation days nor pick one there")
    ap.add_argument("--no-dashboard", action="store_true", help=NO_DASHBOARD_HELP)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)

    from apex_bdq.presets import PRESETS
    from apex_bdq.tuning import ray_cpus, run_seed_trial, seed_summary, trial_resources, trial_train_config
    if a.preset not in PRESETS:
        print(f"error: unknown preset {a.preset!r} (choose from {', '.join(sorted(PRESETS))})", file=sys.stderr)
        return 2
    base = PRESETS[a.preset]
    try:
        seeds = seed_list(a)
        if a.updates is not None and a.updates < 1:
            raise ConfigError(f"--updates must be >= 1, got {a.updates}")
        if (a.minutes is not None and a.minutes <= 0) or a.max_concurrent < 1:
            raise ConfigError("--minutes and --max-concurrent must be > 0")
        fixed = {"preset": a.preset, "overrides": list(a.set), "trace": os.path.abspath(a.trace) if a.trace else None,
                 "seed": None, "minutes": a.minutes if a.minutes is not None else 3 * base.minutes,
                 "updates": a.updates if a.updates is not None else base.updates, "eval_every_s": 1e9,
                 "max_reports": 1, "num_actors": a.num_actors, "num_learners": a.num_learners,
                 "backend": a.backend, "num_replay_shards": 1, "trial_cpus": a.trial_cpus,
                 "actor_cpus": a.actor_cpus, "learner_cpus": a.learner_cpus,
                 "checkpoint_dir": str(Path(a.storage).resolve() / a.name / "checkpoints"), "select_on_val": False}
        cfg = trial_train_config({"fixed": fixed, "space": {"seed": seeds[0]}})  # fails on a bad override here
        if cfg.sim.platform != "v2":
            raise ConfigError("a seed table judges with platform v2's yardstick: the preset must be a v2 one")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # The frontiers and the guard's coverage, once, before any trial (the trials read the caches).
    from apex_bdq import yardstick
    from apex_bdq.guard import guard_for
    log = None if a.quiet else (lambda s: print(f"yardstick: {s}", file=sys.stderr, flush=True))
    if cfg.final_eval_ticks is None:  # else (a smoke preset) no yardstick: cost and violation rate only
        yardstick.frontiers(cfg.sim, cfg.eval_shards, cfg.final_eval_replicas, log=log)
        if not a.no_select and cfg.sim.trace.validation_fraction > 0:
            yardstick.frontiers(cfg.sim, cfg.eval_shards, cfg.final_eval_replicas, split="val",
                                log=None if log is None else (lambda s: log(f"validation days: {s}")))
            fixed["select_on_val"] = True
    guard_for(cfg)

    import ray
    from ray import tune
    from ray.tune.search import BasicVariantGenerator
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=ray_cpus(fixed, a.num_actors, a.num_learners, a.max_concurrent),
                 resources={"rollout": 4.0 * a.num_actors * a.max_concurrent,
                            "learner": 4.0 * a.num_learners * a.max_concurrent},
                 include_dashboard=not a.no_dashboard, log_to_driver=not a.quiet)
    from replay_server._cpu_kernels import kernels
    kernels()  # the sum-tree kernel's build (cached) before a trial's budget starts
    storage = Path(a.storage).resolve()
    t0 = time.perf_counter()
    tuner = tune.Tuner(tune.with_resources(run_seed_trial, trial_resources),
                       param_space={"fixed": fixed, "space": {"seed": tune.grid_search(seeds)}},
                       tune_config=tune.TuneConfig(search_alg=BasicVariantGenerator(max_concurrent=a.max_concurrent)),
                       run_config=tune.RunConfig(name=a.name, storage_path=str(storage), verbose=0 if a.quiet else 1))
    grid = tuner.fit()
    wall = time.perf_counter() - t0
    rows, errors = [], []
    for res in grid:
        if res.error or not (res.metrics or {}).get("final"):
            errors.append({"seed": (res.config or {}).get("space", {}).get("seed"), "error": str(res.error)})
            continue
        rows.append({k: v for k, v in res.metrics.items() if k in {c for c, _, _ in COLUMNS} or k.startswith(
            ("unguarded_", "guard_", "val_")) or k in ("updates_budget", "train_seconds", "env_steps", "checkpoint",
                                               "violation_ratio_vs_best_rule", "best_rule_at_violation_rate")})
    rows.sort(key=lambda r: r["seed"])
    summary = seed_summary(rows, a.target_gap)
    print(f"\n{len(rows)} seeds of preset {a.preset!r} at {fixed['updates'] or '-'} updates each "
          f"(wall time {wall / 60:.1f} min); held-out days, judged against the best rule's frontier and the oracle")
    print_table(rows)
    for e in errors:
        print(f"seed {e['seed']}: failed: {e['error']}", file=sys.stderr)
    g = summary["seeds_meeting_gap_target"]
    print(f"under the guard: {g} of {len(seeds)} seeds close >= {100 * a.target_gap:.0f} % of the oracle gap, "
          f"{summary['seeds_beating_best_rule']} beat the best rule; mean saving "
          f"{cell(summary['mean_cost_saving_vs_best_rule'], '{:+.1%}')} "
          f"(sd {cell(summary['sd_cost_saving_vs_best_rule'], '{:.1%}')}), mean gap closed "
          f"{cell(summary['mean_oracle_gap_closed'], '{:.0%}')}")
    print(f"without it: {summary['unguarded_seeds_meeting_gap_target']} of {len(seeds)} close the target, "
          f"{summary['unguarded_seeds_beating_best_rule']} beat the best rule; mean saving "
          f"{cell(summary['unguarded_mean_cost_saving_vs_best_rule'], '{:+.1%}')}")
    if fixed["select_on_val"]:
        sel = summary["selected_seed"]
        if sel is None:
            print("picked on the validation days: none (no seed has a saving there: outside every frontier)")
        else:
            print(f"picked on the validation days (held-out days unseen): seed {sel}, saving there "
                  f"{cell(summary['selected_val_cost_saving_vs_best_rule'], '{:+.1%}')}; on the held-out days: saving "
                  f"{cell(summary['selected_cost_saving_vs_best_rule'], '{:+.1%}')}, gap closed "
                  f"{cell(summary['selected_oracle_gap_closed'], '{:.0%}')}")
    if a.json:
        write_json(a.json, {"seeds": rows, "errors": errors, "summary": summary, "wall_seconds": wall,
                            "command": "python -m launch.seeds " + " ".join(argv if argv is not None else sys.argv[1:])})
        print(f"wrote {a.json}")
    return 0 if rows and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
