"""Rank trajectory segments by hand: the human side of preference feedback.

    python -m launch.feedback list [--limit N] [--unranked]
    python -m launch.feedback show ID [--out PNG]        # load, capacity and p99 latency of a segment
    python -m launch.feedback rank A B [--tie]           # A is preferred to B (or equally good)

By default it talks to the preference actor of a running training run (`--address`, default
`auto`: the local Ray cluster; inside `ray job submit` the same). `--log PATH` works on a
feedback log without a cluster (the segments it holds are the ones already ranked; a new
ranking is appended to the log and the next run that uses the log trains on it).
Every accepted pair is fsynced to the feedback log before the command returns.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from apex_bdq.preference import PREFERENCE_METRICS, FeedbackError, Segment


def plot_segment(seg: Segment, path: str) -> None:
    """Offered load and active servers (Erlangs / servers), and p99 latency, tick by tick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from launch._io import save_figure
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    s = seg.series
    if "load" in s:
        ax1.plot(s["load"], label="offered load (Erlangs)")
    if "capacity" in s:
        ax1.step(range(len(s["capacity"])), s["capacity"], where="post", label="active servers")
    ax1.set_ylabel("servers")
    ax1.legend(loc="upper left", fontsize=8)
    if "p99_ms" in s:
        ax2.plot(s["p99_ms"], color="C3")
    ax2.set_ylabel("p99 latency, ms")
    ax2.set_yscale("log")
    ax2.set_xlabel("tick (s)")
    m = ", ".join(f"{k} {float(seg.metrics[k]):.3f}" for k in PREFERENCE_METRICS)
    fig.suptitle(f"segment {seg.id} ({seg.source}, weights v{seg.version})\n{m}", fontsize=9)
    save_figure(fig, path)
    plt.close(fig)


class _RayClient:
    """The running run's preference actor, by name."""

    def __init__(self, address: str) -> None:
        import ray
        from actors.preference_actor import NAMESPACE, PREFERENCE_ACTOR_NAME
        ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
        try:
            self.actor = ray.get_actor(PREFERENCE_ACTOR_NAME)
        except ValueError:
            raise FeedbackError(f"no preference actor {PREFERENCE_ACTOR_NAME!r} in Ray namespace {NAMESPACE!r} at "
                                f"{address!r}: is a run with pref.enabled=true going? (or use --log PATH)") from None

    def call(self, name: str, *args, **kw):
        import ray
        try:
            return ray.get(getattr(self.actor, name).remote(*args, **kw))
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else None
            if isinstance(cause, FeedbackError):
                raise cause from None
            raise


class _LogClient:
    """A feedback log, without a cluster."""

    def __init__(self, path: str, write: bool) -> None:
        """write=False (list, show) opens the log read-only: safe beside a run appending to it.
        write=True (rank) takes the log's writer lock, refused while a run holds it."""
        import os
        from actors.preference_actor import PreferenceActor
        from apex_bdq.config import NetConfig, PreferenceConfig
        from apex_bdq.preference import load_log
        if not os.path.exists(path):
            raise FeedbackError(f"feedback log {path!r} does not exist")
        meta, _, _ = load_log(path)
        if meta is None:
            raise FeedbackError(f"feedback log {path!r} has no meta record: not a feedback log")
        self.actor = PreferenceActor(NetConfig(**meta["net"]), PreferenceConfig(enabled=True), path,
                                     readonly=not write)

    def call(self, name: str, *args, **kw):
        return getattr(self.actor, name)(*args, **kw)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.feedback", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--address", default="auto", help="Ray cluster of the running run (default: auto)")
    src.add_argument("--log", help="work on this feedback log instead of a running run")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_list = sub.add_parser("list", help="segments, newest unranked first, with their preference metrics")
    p_list.add_argument("--limit", type=int, default=20)
    p_list.add_argument("--unranked", action="store_true", help="only segments not ranked yet")
    p_list.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_show = sub.add_parser("show", help="write a PNG of a segment's load, capacity and latency")
    p_show.add_argument("id")
    p_show.add_argument("--out", help="PNG path (default: segment-ID.png)")
    p_rank = sub.add_parser("rank", help="record that segment A is preferred to segment B")
    p_rank.add_argument("a")
    p_rank.add_argument("b")
    p_rank.add_argument("--tie", action="store_true", help="A and B are equally good")
    a = ap.parse_args(argv)
    try:
        client = _LogClient(a.log, write=a.cmd == "rank") if a.log else _RayClient(a.address)
        if a.cmd == "list":
            rows = client.call("list_segments", a.limit, a.unranked)
            if a.json:
                print(json.dumps(rows, indent=1))
            else:
                print(f"{'id':<14}{'ranked':>7}{'overload':>10}{'unfair':>9}{'slo':>8}  source")
                for r in rows:
                    print(f"{r['id']:<14}{'yes' if r['ranked'] else 'no':>7}{r['overload']:>10.3f}"
                          f"{r['unfairness']:>9.3f}{r['slo_violation']:>8.3f}  {r['source']}")
        elif a.cmd == "show":
            seg = client.call("segment", a.id)
            out = a.out or f"segment-{a.id}.png"
            plot_segment(seg, out)
            print(f"wrote {out}")
        else:
            res = client.call("rank", a.a, a.b, 0.5 if a.tie else 1.0, "human")
            print(f"{res}: {a.a} {'=' if a.tie else '>'} {a.b}")
    except FeedbackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
