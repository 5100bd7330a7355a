"""Evaluate policies on the held-out range of a trace and print the comparison table.

    python -m launch.evaluate --policy hpa|target|static|queue|random|all [--trace CSV]
        [--columns COL ...] [--interval-s S] [--shards 8] [--ticks N] [--replicas R] [--json PATH]
        [--plot PATH]

`--trace` takes any CSV with a time column (or an interval suffix like `_5min` in its name)
and one or more rate columns; `--trace shared` evaluates on every CSV of ../shared/traces.
Without `--trace` the bundled Azure Functions 2019 trace is used.

A checkpoint is evaluated on the platform it was trained for: its simulator settings (the
capacity tiers, the scale-down window, SLOs, prices, ...; not its trace) become the
platform every policy of the table runs on, so a policy trained with e.g. `--set
sim.headroom_min=1.8` is scored with the tiers it learned. Checkpoints trained on different
platforms are refused together.

`--replicas R` covers the held-out range R times with independent Poisson arrivals (R x
shards simulator shards in one vectorised run): R times the settled SLO windows, so small
differences in violation rate are not lost in the noise of one arrival sample; the table
then adds each policy's violation rate per copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from apex_bdq.checkpoint import CheckpointError, load_checkpoint
from apex_bdq.config import ConfigError, SimConfig, TraceConfig, sim_config_from_dict
from apex_bdq.evaluation import METRIC_KEYS, EvalResult, evaluate_policy
from apex_bdq.sim.baselines import BASELINES, make_baseline
from apex_bdq.sim.trace import TraceError
from launch._io import save_figure, write_json

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
# Per-class rate columns for the shared traces that have them; the rest use their first
# rate column split over the classes.
SHARED_COLUMNS = {
    "azure_functions2019_invitro1000_1min.csv": ("invocations",),
    "nasa_http_1995_1min.csv": ("requests",),
}


class _Progress:
    """One-line progress on stderr for long runs (a tick counter with rate and ETA)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled, self.t0, self.last = label, enabled, time.perf_counter(), 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.5 and done < total):
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (total - done) / max(rate, 1e-9)
        end = "\n" if done >= total else ""
        print(f"\r  {self.label}: {done}/{total} ticks, {rate:,.0f} ticks/s, eta {eta:4.0f}s ", end=end,
              file=sys.stderr, flush=True)


def _fmt(v) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    return f"{v:.4f}" if abs(v) < 100 else f"{v:,.0f}"


def print_table(title: str, results: dict[str, dict]) -> None:
    cols = ("policy",) + METRIC_KEYS
    print(title)
    print("  ".join(f"{c:>18}" if i else f"{c:<10}" for i, c in enumerate(cols)))
    for name, m in results.items():
        print("  ".join([f"{name:<10}"] + [f"{_fmt(m[k]):>18}" for k in METRIC_KEYS]))
    if any(m.get("replicas", 1) > 1 for m in results.values()):
        ref = results.get("hpa")
        print("SLO violation rate over the copies of the range (mean +- standard error; against HPA paired "
              "copy by copy, both met the same arrivals; per-copy rates in the JSON):")
        for name, m in results.items():
            per = m["slo_violation_rate_per_replica"]
            line = f"{name:<10}  {statistics.fmean(per):.5f} +- {statistics.stdev(per) / math.sqrt(len(per)):.5f}"
            if ref is not None and name != "hpa":
                d = [x - y for x, y in zip(per, ref["slo_violation_rate_per_replica"])]
                line += f"   vs hpa {statistics.fmean(d):+.5f} +- {statistics.stdev(d) / math.sqrt(len(d)):.5f}"
            print(line + f"   ({len(per)} copies x {m['slo_windows'] // len(per):,} class-windows)")


def make_policy(name: str, cfg: SimConfig):
    if name.startswith("checkpoint:"):
        from apex_bdq.checkpoint import load_policy
        return load_policy(name.split(":", 1)[1], cfg)
    return make_baseline(name)


def checkpoint_platform(names: list[str]) -> tuple[SimConfig, list[str]]:
    """The simulator config the checkpoints among `names` were trained with (trace and
    seed reset to the defaults), and the fields where it differs from the default; the
    default when there is no checkpoint. Checkpoints of different platforms are refused."""
    base = SimConfig()
    found: dict[str, SimConfig] = {}
    for n in names:
        if n.startswith("checkpoint:"):
            path = n.split(":", 1)[1]
            ck = load_checkpoint(path)
            try:
                sim = sim_config_from_dict(ck["config"]["sim"])
            except (KeyError, TypeError, ConfigError) as e:
                raise CheckpointError(f"checkpoint {path!r} has no usable simulator config: {e}") from e
            found[path] = sim.replace(trace=base.trace, seed=base.seed, num_shards=base.num_shards)
    if not found:
        return base, []
    (first, cfg), *rest = found.items()
    for path, other in rest:
        if other != cfg:
            diff = [f.name for f in dataclasses.fields(SimConfig) if getattr(other, f.name) != getattr(cfg, f.name)]
            raise CheckpointError(f"checkpoints {first!r} and {path!r} were trained on different platforms "
                                  f"(sim fields {', '.join(diff)}): evaluate them separately")
    changed = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(SimConfig)
               if getattr(cfg, f.name) != getattr(base, f.name)]
    return cfg, changed


def run_trace(cfg: SimConfig, policies: list[str], shards: int, ticks: Optional[int],
              show_progress: bool, replicas: int = 1) -> dict[str, EvalResult]:
    out = {}
    for name in policies:
        res = evaluate_policy(make_policy(name, cfg), cfg, shards=shards, ticks=ticks,
                              progress=_Progress(name, show_progress), replicas=replicas)
        out[name] = res
    return out


def plot(results: dict[str, EvalResult], path: str, title: str, tick_s: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    first = next(iter(results.values())).series
    t = [i * tick_s / 60.0 for i in range(len(first["offered"]))]
    ax1.plot(t, first["offered"], color="black", lw=1.0, label="offered load (busy servers needed)")
    for name, res in results.items():
        ax1.plot(t, res.series["servers"], lw=1.0, label=f"capacity: {name}")
        ax2.plot(t, res.series["p99_ms"], lw=0.8, label=name)
    ax1.set_ylabel("servers")
    ax1.legend(fontsize=8, ncol=3)
    ax1.set_title(title)
    ax2.set_yscale("log")
    ax2.set_ylabel("p99 latency, ms (arrival-weighted)")
    ax2.set_xlabel("minutes into the evaluation range (shard 0)")
    ax2.legend(fontsize=8, ncol=5)
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="all",
                    help=f"one of {sorted(BASELINES)}, 'all', checkpoint:PATH, or a comma-separated list")
    ap.add_argument("--trace", help="CSV trace, or 'shared' for every trace in ../shared/traces")
    ap.add_argument("--columns", nargs="+", help="rate columns of the trace (default: first one)")
    ap.add_argument("--interval-s", type=float, help="seconds per trace row (default: from the file)")
    ap.add_argument("--shards", type=int, default=8, help="evaluation shards (phases of the range)")
    ap.add_argument("--ticks", type=int, help="ticks per shard (default: cover the held-out range)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="cover the range this many times, each with its own arrivals (default 1)")
    ap.add_argument("--json", help="write the metrics here")
    ap.add_argument("--plot", help="write a PNG of load vs capacity vs p99 here")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)

    names = sorted(BASELINES) if a.policy == "all" else [p.strip() for p in a.policy.split(",") if p.strip()]
    for n in names:
        if n not in BASELINES and not n.startswith("checkpoint:"):
            ap.error(f"unknown policy {n!r}: choose from {sorted(BASELINES)}, 'all' or checkpoint:PATH")
    if a.shards < 1 or a.replicas < 1 or (a.ticks is not None and a.ticks < 1):
        ap.error("--shards, --replicas and --ticks must be >= 1")

    if a.trace == "shared":
        if not SHARED_TRACES.is_dir():
            ap.error(f"--trace shared: {SHARED_TRACES} does not exist")
        traces = [(p, SHARED_COLUMNS.get(p.name)) for p in sorted(SHARED_TRACES.glob("*.csv"))
                  if not p.name.endswith("_meta.csv")]
    elif a.trace:
        traces = [(Path(a.trace), tuple(a.columns) if a.columns else None)]
    else:
        traces = [(None, None)]

    try:
        platform, changed = checkpoint_platform(names)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if changed:
        print(f"platform of the checkpoint (differs from the default in {', '.join(changed)})")
    all_results: dict = {}
    for path, cols in traces:
        try:
            cfg = platform.replace(trace=TraceConfig(path=str(path) if path else None, columns=cols,
                                                     interval_s=a.interval_s))
            label = path.name if path else "bundled azure_functions2019_4class_1min.csv"
            results = run_trace(cfg, names, a.shards, a.ticks, not a.quiet and sys.stderr.isatty(), a.replicas)
        except (TraceError, ConfigError, CheckpointError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        metrics = {n: r.metrics for n, r in results.items()}
        copies = f", {a.replicas} copies with their own arrivals" if a.replicas > 1 else ""
        print_table(f"\n{label}: evaluation range, {a.shards} shards x "
                    f"{next(iter(metrics.values()))['ticks']} ticks{copies}", metrics)
        all_results[label] = metrics
        if a.plot:
            plot_path = a.plot if len(traces) == 1 else str(Path(a.plot).with_suffix("")) + f"_{Path(label).stem}.png"
            plot(results, plot_path, label, cfg.tick_s)
            print(f"wrote {plot_path}")
    if a.json:
        payload = next(iter(all_results.values())) if len(all_results) == 1 else all_results
        write_json(a.json, payload)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
