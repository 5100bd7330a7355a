"""Fault-injection soak: a distributed run under random, bounded kills.

    python -m launch.soak --minutes 10 --json runs/soak.json

Trains the Ape-X run (rollout actors, replay shards with snapshots, the preference actor
with the synthetic oracle, one Ray Train learner) with restarts on, and meanwhile
- kills, one at a time and at random intervals, a rollout actor, a replay shard, the
  preference actor or the learner worker (SIGKILL of its process), then waits until that
  component serves again from a new process (a recovery) before the next kill;
- submits ranked feedback pairs (with their segments inline, as Serve's /v1/feedback
  does) every second, and at the end checks that every pair the actor accepted is still
  there, in the restarted actor and in its log;
- samples the resident memory of every process of the run every 2 s.

The JSON (and the table) report kills, recovered, feedback_lost (must be 0),
max_rss_growth_mb (the largest growth of one process over the run's steady part, i.e.
once replay is at capacity), training updates lost to learner restarts, and the rest.
Exit status 0 when every kill was recovered from and no feedback was lost, else 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from apex_bdq.soak import TARGETS, SoakOptions, soak


def print_table(res: dict) -> None:
    rows = [("kills injected", res["kills"]), ("recovered", res["recovered"]),
            ("  by target", ", ".join(f"{k} {v}" for k, v in res["kills_by_target"].items())),
            ("recovery s (mean / max)", f"{res['recovery_s_mean'] or float('nan'):.1f} / "
                                        f"{res['recovery_s_max'] or float('nan'):.1f}"),
            ("feedback pairs accepted", res["feedback_accepted"]), ("feedback pairs lost", res["feedback_lost"]),
            ("learner updates (lost to restarts)", f"{res['updates']} ({res['updates_lost']})"),
            ("transitions lost with dead shards", res["transitions_lost"]),
            ("max RSS growth, one process (MB)", res["max_rss_growth_mb"]),
            ("peak RSS by role (MB)", ", ".join(f"{k} {v:.0f}" for k, v in res["peak_rss_mb"].items()))]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def main(argv: Optional[list[str]] = None) -> int:
    from apex_bdq.config import ConfigError
    ap = argparse.ArgumentParser(prog="python -m launch.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--kill-every", type=float, default=30.0, metavar="S", help="mean seconds between kills")
    ap.add_argument("--max-kills", type=int, help="end the run once this many kills were made and recovered from")
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, from " + ", ".join(TARGETS))
    ap.add_argument("--num-actors", type=int, default=2)
    ap.add_argument("--num-replay-shards", type=int, default=2)
    ap.add_argument("--replay-capacity", type=int, default=4_000)
    ap.add_argument("--replay-on-restart", choices=("snapshot", "empty"), default="snapshot")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="checkpoints, replay snapshots, feedback log (default: a temp dir)")
    ap.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    a = ap.parse_args(argv)
    try:
        o = SoakOptions(minutes=a.minutes, kill_every_s=a.kill_every, max_kills=a.max_kills,
                        targets=tuple(t.strip() for t in a.targets.split(",") if t.strip()),
                        num_actors=a.num_actors, num_replay_shards=a.num_replay_shards,
                        replay_capacity=a.replay_capacity, replay_on_restart=a.replay_on_restart, seed=a.seed,
                        workdir=a.workdir, address=a.address)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = soak(o)
    print_table(res)
    if a.json:
        from launch._io import write_json
        write_json(a.json, res)
        print(f"wrote {a.json}")
    ok = res["feedback_lost"] == 0 and res["recovered"] == res["kills"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
