"""Train the BDQ agent: argument parsing, then the in-process or the Ray runner.

    python -m launch.train [--local] [--preset default|smoke|v1] [--updates N] [--minutes M] [--json PATH]
        [--checkpoint PATH] [--resume PATH|auto] [--curve PATH] [--trace CSV] [--seed N]
        [--set SECTION.FIELD=VALUE ...] [distributed flags: --num-actors, --backend, ...]

Without `--local`: Ape-X on Ray (apex_bdq/ray_runner.py): rollout actors, replay shards, a
weight store and a Ray Train learner group, on a local cluster or `--address`. With
`--local`: the same agent in one process (apex_bdq/local_runner.py). Both end with the
final evaluation on the held-out range and, on platform v2, the yardstick's lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Optional

from apex_bdq.checkpoint import CheckpointError, load_checkpoint, train_config_of
from apex_bdq.config import BACKENDS, ClusterConfig, ConfigError, TraceConfig, TrainConfig, apply_overrides
from apex_bdq.local_runner import LocalTrainer
from apex_bdq.presets import PRESETS
from apex_bdq.sim.trace import TraceError
from launch._io import NO_DASHBOARD_HELP, save_figure, write_json

def plot_curve(history: list[dict], path: str) -> None:
    """Reward and SLO violation rate over training: periodic points on slices of the
    validation days, and each final evaluation on the whole held-out range (rows with
    split "eval"; in a history written before rows named their split, the last row)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    final = [i for i, h in enumerate(history) if h.get("split") == "eval"] or [len(history) - 1]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for ax, key, hkey, label in ((ax1, "eval_reward", "hpa_eval_reward", "mean reward per tick"),
                                 (ax2, "slo_violation_rate", "hpa_slo_violation_rate", "SLO violation rate")):
        for rows, style, ms, what in (([i for i in range(len(history)) if i not in final], "o-", 6,
                                       "periodic: validation days, 8 phases x eval_ticks"),
                                      (final, "o", 10, "whole held-out range")):
            t = [history[i]["updates"] for i in rows]
            ax.plot(t, [history[i][key] for i in rows], style, color="C0", ms=ms,
                    mfc=None if ms == 6 else "none", label=f"BDQ (greedy), {what}")
            if all(hkey in history[i] for i in rows):
                ax.plot(t, [history[i][hkey] for i in rows], "s--" if ms == 6 else "s", color="C1", ms=ms,
                        mfc=None if ms == 6 else "none", label=f"HPA, {what}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_xlabel("learner updates")
    save_figure(fig, path)


def yardstick_of(cfg: TrainConfig, res: dict, quiet: bool = False) -> Optional[dict]:
    """The learned policy against the rules' frontiers and the oracle (v2; the frontiers of
    this layout come from the cache or are computed once, ~1 minute on 2 cores). None when
    the final evaluation did not cover the held-out days (final_eval_ticks set) or on v1."""
    if cfg.sim.platform != "v2" or cfg.final_eval_ticks is not None:
        return None
    from apex_bdq import yardstick
    log = None if quiet else (lambda s: print(f"yardstick: {s}", file=sys.stderr, flush=True))
    y = yardstick.report(cfg.sim, res["learned"], cfg.eval_shards, cfg.final_eval_replicas, log=log)
    if "learned_unguarded" in res:
        y["unguarded"] = yardstick.report(cfg.sim, res["learned_unguarded"], cfg.eval_shards, cfg.final_eval_replicas)
    return y


def _print_final(res: dict, checkpoint: Optional[str]) -> None:
    print(f"{'':8} {'reward':>10} {'slo_violation_rate':>20} {'cost':>8} {'p99_ms':>10}")
    for name in ("learned", "hpa"):
        m = res[name]
        print(f"{name:8} {m['reward']:>10.4f} {m['slo_violation_rate']:>20.4f} {m['cost']:>8.3f} {m['p99_ms']:>10,.0f}")
    if "slo_violation_rate_diff_se" in res:
        print(f"SLO violation rate, learned - HPA: {res['slo_violation_rate'] - res['hpa_slo_violation_rate']:+.5f} "
              f"+- {res['slo_violation_rate_diff_se']:.5f} (paired standard error over {res['learned']['replicas']} "
              f"copies of the range, {res['learned']['slo_windows']:,} class-windows)")
    if checkpoint:
        print(f"checkpoint: {checkpoint}")


def run_distributed(cfg: TrainConfig, a, spec) -> dict:
    """The Ape-X run on Ray (apex_bdq/ray_runner.py) under the driver (apex_bdq/driver.py)."""
    from apex_bdq.driver import Driver
    from apex_bdq.ray_runner import ApexRun, local_ray_init
    resume = load_checkpoint(a.resume) if a.resume else None
    if resume is not None:
        saved = train_config_of(resume, a.resume)
        if dataclasses.asdict(saved.net) != dataclasses.asdict(cfg.net):
            raise CheckpointError(f"checkpoint {a.resume!r} was trained with network {saved.net}, this run has {cfg.net}")
    local_ray_init(spec, a.address, **({} if a.address else {"include_dashboard": not a.no_dashboard}),
                   log_to_driver=not a.quiet)
    run = ApexRun(cfg, spec, resume=resume)
    try:
        res = Driver(cfg, run, checkpoint=spec.checkpoint_path, progress=not a.quiet).run()
    finally:
        run.shutdown()
    for k in ("result", "actor_stats", "status"):  # Ray objects and per-component detail: not for the JSON
        res.pop(k, None)
    return res


def config_file_args(argv: list[str]) -> list[str]:
    """Replace `--config PATH` by the file's `train_args` (placed first, so the command line wins)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    if not known.config:
        return argv
    try:
        args = json.loads(Path(known.config).read_text())["train_args"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--config {known.config!r}: no readable \"train_args\" list ({type(e).__name__}: {e})") from e
    if not isinstance(args, list) or not all(isinstance(x, str) for x in args) or "--config" in args:
        raise ConfigError(f"--config {known.config!r}: \"train_args\" must be a list of strings without --config")
    return args + rest


# launch.train's distributed flags and the ClusterConfig fields they set (unset: the config's).
CLUSTER_FLAGS = (("num_actors", "num_actors"), ("num_replay_shards", "num_replay_shards"),
                 ("num_learners", "num_learners"), ("backend", "backend"), ("shards_per_actor", "shards_per_actor"),
                 ("samples_per_insert", "samples_per_insert"), ("error_buffer", "error_buffer"),
                 ("max_restarts", "max_restarts"), ("checkpoint_every", "checkpoint_every_s"),
                 ("replay_snapshot_dir", "replay_snapshot_dir"), ("replay_snapshot_every", "replay_snapshot_every_s"),
                 ("replay_on_restart", "replay_on_restart"), ("publish_every", "publish_every"),
                 ("weight_pull_every", "weight_pull_every"))


def main(argv: Optional[list[str]] = None) -> int:
    CL = ClusterConfig()  # the defaults the help texts show
    ap = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", action="store_true", help="train in this process without Ray (debugging)")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="the config to start from (default: 'default', or the resumed checkpoint's own config)")
    ap.add_argument("--updates", type=int, metavar="N",
                    help="the run's budget in learner updates (the preset's: train.updates); --minutes then caps "
                         "the wall time")
    ap.add_argument("--minutes", type=float, help="the preset's wall-clock budget (a cap when an update budget is set)")
    ap.add_argument("--trace", help="CSV trace (default: the bundled one)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--json", help="write the final evaluation against HPA here")
    ap.add_argument("--checkpoint", default="runs/train/checkpoint.pt", help="where to save the checkpoint")
    ap.add_argument("--resume", metavar="PATH|auto",
                    help="continue from this checkpoint: weights, target network, optimiser, counters, learning "
                         "curve, preference head and feedback log. 'auto': from --checkpoint if it exists, else "
                         "start fresh (a resubmitted job picks up where the last one stopped)"),
    ap.add_argument("--curve", help="write the learning-curve PNG here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set agent.lr=3e-4 --set sim.num_shards=32 --set pref.oracle_weights=10,1,1 "
                         "(repeatable; parsed as the field's type; 'none' for optional fields)")
    ap.add_argument("--quiet", action="store_true")
    g = ap.add_argument_group("distributed (Ray) options")
    g.add_argument("--address", help="an existing Ray cluster ('auto' inside `ray job submit`); default: start a "
                                     "local one")
    g.add_argument("--num-actors", type=int, help=f"rollout actors (default: {CL.num_actors})")
    g.add_argument("--shards-per-actor", type=int, help="simulated shards per actor (default: the preset's "
                                                        "sim.num_shards split between the actors)")
    g.add_argument("--num-replay-shards", type=int, help=f"replay shard actors (default: {CL.num_replay_shards})")
    g.add_argument("--num-learners", type=int, help=f"Ray Train workers (default: {CL.num_learners})")
    g.add_argument("--backend", choices=BACKENDS, help=f"learner-group backend (default: {CL.backend})")
    g.add_argument("--use-gpu", action="store_true", help="learners (and replay storage) on GPUs")
    g.add_argument("--samples-per-insert", type=float,
                   help="rate limiter: transitions sampled per transition inserted (default: off, Ape-X style)")
    g.add_argument("--publish-every", type=int,
                   help=f"the learner publishes its weights every this many updates (default: {CL.publish_every})")
    g.add_argument("--weight-pull-every", type=int,
                   help=f"rollout actors ask for newer weights every this many decisions (default: {CL.weight_pull_every})")
    g.add_argument("--error-buffer", type=float,
                   help="rate limiter slack in sampled transitions (default: 4096 x samples-per-insert)")
    g.add_argument("--max-restarts", type=int,
                   help="restarts of each rollout actor, replay shard and the weight store, and learner-group "
                        f"failures Ray Train recovers from its last checkpoint (-1: no limit; default: {CL.max_restarts})")
    g.add_argument("--replay-snapshot-dir", help="replay shards snapshot their memory here; a --resume run loads "
                                                 "the snapshots found there")
    g.add_argument("--replay-snapshot-every", type=float, metavar="S",
                   help="seconds between replay snapshots (default: 0, none)")
    g.add_argument("--replay-on-restart", choices=("snapshot", "empty"),
                   help="what a restarted replay shard comes back with (default: its last snapshot, else empty)")
    g.add_argument("--checkpoint-every", type=float, metavar="S",
                   help=f"seconds between learner checkpoints (each copied to --checkpoint as it lands; default: "
                        f"{CL.checkpoint_every_s:g})")
    g.add_argument("--storage-path", help="Ray Train storage (checkpoints): a folder or s3:// / gs:// URI; "
                   "default: a temp dir (refused on a multi-node cluster, which needs shared storage)")
    g.add_argument("--no-dashboard", action="store_true", help=NO_DASHBOARD_HELP)
    ap.add_argument("--config", metavar="JSON",
                    help="read arguments from a JSON file's \"train_args\" list (e.g. launch.tune's best_config.json); "
                         "arguments given here come after them and win")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = config_file_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a = ap.parse_args(argv)
    resume_ck = None
    try:
        if a.resume == "auto":
            a.resume = a.checkpoint if a.checkpoint and os.path.exists(a.checkpoint) else None
            print(f"--resume auto: {'continuing from ' + a.resume if a.resume else 'no checkpoint yet, starting fresh'}")
        if a.resume:
            resume_ck = load_checkpoint(a.resume)
        if a.preset is None and resume_ck is not None:
            # The run it continues, unless told otherwise; its recorded cluster layout belongs
            # to the machines it ran on, so the layout comes from the defaults and the flags.
            cfg = dataclasses.replace(train_config_of(resume_ck, a.resume), cluster=ClusterConfig())
        else:
            cfg = PRESETS[a.preset or "default"]
    except (ConfigError, CheckpointError, KeyError, TypeError, ValueError) as e:
        print(f"error: --resume {a.resume!r}: {e}", file=sys.stderr)
        return 2
    try:
        if a.minutes is not None:
            cfg = dataclasses.replace(cfg, minutes=a.minutes)
        if a.updates is not None:
            cfg = dataclasses.replace(cfg, updates=a.updates)
        if a.seed is not None:
            cfg = dataclasses.replace(cfg, seed=a.seed, sim=cfg.sim.replace(seed=a.seed))
        if a.trace:
            cfg = dataclasses.replace(cfg, sim=cfg.sim.replace(trace=TraceConfig(path=a.trace)))
        cfg = apply_overrides(cfg, a.set)
        if a.local:
            log = (resume_ck or {}).get("counters", {}).get("feedback_log")
            trainer = LocalTrainer(cfg, feedback_log=log if log and not cfg.pref.log_path else None)
            if a.resume:
                trainer.resume(a.resume)
        else:
            # The flags given set the config tree's cluster section (the preset's, or the
            # resumed run's, or --set cluster.NAME=VALUE); the run's checkpoints record it.
            given = {field: getattr(a, attr) for attr, field in CLUSTER_FLAGS if getattr(a, attr) is not None}
            if a.use_gpu:  # replay storage on the GPU too, a quarter of one per shard unless set
                given.update(use_gpu=True, replay_gpus=cfg.cluster.replay_gpus or 0.25)
            for attr, field in (("storage_path", "storage_path"), ("checkpoint", "checkpoint_path")):
                v = getattr(a, attr)
                if v:  # a URI (s3://, gs://) is storage as it is, not a path under the working folder
                    given[field] = v if "://" in v else os.path.abspath(v)
            spec = cfg.cluster.replace(**given)
            cfg = dataclasses.replace(cfg, cluster=spec)
    except (ConfigError, TraceError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.local:
        res = trainer.run(progress=not a.quiet, checkpoint=a.checkpoint)
    else:
        try:
            res = run_distributed(cfg, a, spec)
        except (ConfigError, TraceError, CheckpointError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(f"\nafter {res['train_seconds']:.0f} s: {res['env_steps']:,} env steps ({res['env_steps_per_s']:,.0f}/s), "
          f"{res['updates']:,} updates ({res['updates_per_s']:.1f}/s)")
    if res.get("updates_budget") is not None and res.get("stopped_by") != "updates":
        why = ("the wall-clock cap ended it (a slow machine: raise --minutes)" if res.get("stopped_by") == "minutes"
               else "the env-tick budget (max_env_ticks) ended it")
        print(f"note: the run stopped before its budget of {res['updates_budget']:,} updates: {why}; its figures "
              f"are not the budget's")
    res["yardstick"] = yardstick_of(cfg, res, a.quiet)
    _print_final(res, a.checkpoint)
    if a.json:
        write_json(a.json, res)
        print(f"wrote {a.json}")
    if a.curve:
        plot_curve(res["history"], a.curve)
        print(f"wrote {a.curve}")
    y = res["yardstick"]
    if y is not None:
        from apex_bdq import yardstick
        m = res["learned"]
        if "unguarded" in y:
            for line in yardstick.summary("without the guard", res["learned_unguarded"], y["unguarded"]):
                print(line)
        for line in yardstick.summary("learned policy (held-out days)" + (" under its guard" if m.get("guarded") else ""),
                                      m, y):
            print(line)
        if m.get("guarded"):
            from apex_bdq.guard import describe_shares
            print(f"  guard: {describe_shares(m)}")
        for line in yardstick.first_target(y):
            print(line)
        s = y.get("cost_saving_vs_best_rule")
        if s is not None:
            print(f"learned policy {'beats' if s > 0 else 'does not beat'} the best rule's frontier "
                  f"({y['best_rule_at_violation_rate']}) at its SLO violation rate: {-100 * s:+.1f} % cost")
        return 0
    beat = res["eval_reward"] > res["hpa_eval_reward"] and not (
        res["slo_violation_rate"] > res["hpa_slo_violation_rate"])
    print("learned policy beats HPA on the evaluation range" if beat else
          "learned policy does not beat HPA on the evaluation range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
