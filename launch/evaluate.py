"""Evaluate policies on the held-out days of a trace and judge them with the yardstick.

    python -m launch.evaluate [--policy all|NAME,...|all,checkpoint:PATH] [--trace CSV|shared]
        [--platform v2|v1] [--columns COL ...] [--interval-s S] [--shards N] [--replicas R]
        [--ticks N] [--split eval|val] [--json PATH] [--plot PNG] [--series PNG] [--no-frontier]
        [--no-cache] [--ladder]

For every policy: cost and SLO-violation rate (late + refused work) with standard errors
over the segments of the range; against the frontier of every rule swept over its setting
(HPA and AWS target tracking over their target utilisation, the predictive rule over its
margin, static peak provisioning), interpolated: the cost saving at equal violation rate and
the violation ratio at equal cost against the best rule, and the share of the gap from the
best rule to the oracle (which sees the future) that the policy closes. `--policy all` runs
every baseline at its default setting and the oracle. The frontiers of a platform and trace
are computed once (about a minute on 2 cores) and cached (APEX_BDQ_CACHE, default
~/.cache/apex-bdq). JSON: `frontiers` (per rule: [{setting, cost, slo_violation_rate}]),
`oracle_frontier`, `headroom`, and per policy under `policies` its metrics with
`cost_saving_vs_best_rule`, `violation_ratio_vs_best_rule`, `oracle_gap_closed`,
`refused_share`.

`--ladder` (v2) splits the oracle's room: the oracle swept again without foresight, then also
reading the rate as late as monitoring does, then also holding capacity as HPA does; at each
headroom rate every rung's cost and the share of the gap it still closes (JSON
`oracle_ladder`). The last rung is a reactive rule that knows the true rate: what separates
it from the best rule is measuring that rate from arrivals, which no policy escapes.

`--split val` judges on the validation days instead (the last 15 % of the days before the
held-out ones, which training never sees): the range to choose between checkpoints on (a
seed, a sweep's trial) without looking at the held-out days; the frontiers are swept there.

A comparison rests on the settled class-windows of the range; with too few to tell the
rules' settings apart (a short or very bursty trace) it is refused with the reason, not
printed as equal rates.

`--trace` takes any CSV with a time column (or an interval suffix like `_5min` in its name)
and one or more rate columns; `--trace shared` evaluates on every CSV of ../shared/traces.
Without `--trace` the platform's bundled trace is used (v2: four weeks of NASA-HTTP 1995,
held-out days 22-28). A checkpoint is evaluated on the platform it was trained for (its
simulator settings, not its trace or its training-time augmentation); checkpoints trained on
different platforms are refused together.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Optional

from apex_bdq import yardstick as ys
from apex_bdq.checkpoint import CheckpointError, load_checkpoint
from apex_bdq.config import ConfigError, SimConfig, TraceConfig, sim_config_from_dict
from apex_bdq.evaluation import EvalResult, evaluate_policy
from apex_bdq.sim.baselines import BASELINES, V2_ONLY, make_baseline
from apex_bdq.sim.trace import TraceError
from launch._io import save_figure, write_json

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
# Per-class rate columns for the shared traces that have them; the rest use their first
# rate column split over the classes.
SHARED_COLUMNS = {
    "azure_functions2019_invitro1000_1min.csv": ("invocations",),
    "nasa_http_1995_1min.csv": ("requests",),
}
# Evaluation layout per platform: segments of the range per copy, copies.
LAYOUT = {"v2": (64, 2), "v1": (8, 1)}
HEADROOM_RATES = (0.01, 0.02, 0.05)


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


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def _num(x: Optional[float], fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def print_policies(title: str, results: dict[str, dict]) -> None:
    """The policy table: cost and violation with standard errors, refused share, and the
    yardstick's figures where frontiers exist."""
    print(title)
    print(f"{'policy':<22} {'cost':>14} {'slo_violation_rate':>20} {'refused':>8} {'reward':>8} "
          f"{'saving vs best rule':>20} {'viol. ratio':>11} {'oracle gap closed':>18}")
    for name, m in results.items():
        j = m.get("yardstick") or {}
        cost = f"{m['cost']:.3f} +- {_num(m.get('cost_se'))}"
        viol = f"{m['slo_violation_rate']:.4f} +- {_num(m.get('slo_violation_rate_se'), '.4f')}"
        rule = j.get("best_rule_at_violation_rate")
        saving = _pct(j.get("cost_saving_vs_best_rule")) + (f" ({rule})" if rule else "")
        print(f"{name:<22} {cost:>14} {viol:>20} {100 * m['refused_share']:>7.2f}% {m['reward']:>8.4f} "
              f"{saving:>20} {_num(j.get('violation_ratio_vs_best_rule'), '.2f'):>11} "
              f"{_pct(j.get('oracle_gap_closed')):>18}")
    for name, m in results.items():
        if "guard_decisions" in m:
            from apex_bdq.guard import describe_shares
            print(f"  {name} ran under its guard: {describe_shares(m)}")


def print_frontiers(fronts: dict, oracle: list[dict]) -> None:
    print("frontiers (each rule swept over its setting; * = on its Pareto frontier):")
    for rule, pts in list(fronts.items()) + ([("oracle", oracle)] if oracle else []):
        cells = [f"{s:g}: {c:.3f} / {v:.4f}{'*' if on else ''}" for s, c, v, on in ys.as_table_rows(pts)]
        print(f"  {rule:<10} " + "   ".join(cells))
    print("  (setting: cost / SLO violation rate)")


def print_ladder(rungs: list[dict]) -> None:
    """The oracle ladder: per rung its cost on its own frontier at each violation rate and the
    share of the best-rule -> oracle gap it still closes."""
    rates = [x["slo_violation_rate"] for x in rungs[0]["at"]]
    print("\nthe oracle's room, privilege by privilege (cost on the rung's own frontier; share of the "
          "best rule -> oracle gap):")
    print(f"{'':<28}" + "".join(f"{'at ' + format(v, '.4f'):>22}" for v in rates))
    print(f"{'best rule':<28}" + "".join(f"{_num(x['best_rule_cost']):>22}" for x in rungs[0]["at"]))
    for r in rungs:
        cells = [f"{_num(x['cost'])} ({'-' if x['gap_closed'] is None else format(100 * x['gap_closed'], '.0f') + ' %'})"
                 for x in r["at"]]
        print(f"{r['rung']:<28}" + "".join(f"{c:>22}" for c in cells))


def make_policy(name: str, cfg: SimConfig):
    """A baseline by name, or `checkpoint:PATH` (under the checkpoint's guard, whose coverage
    is that of the checkpoint's own training trace), or `checkpoint-unguarded:PATH` (the
    bare network)."""
    kind, _, path = name.partition(":")
    if kind in ("checkpoint", "checkpoint-unguarded"):
        from apex_bdq.checkpoint import load_policy, train_config_of
        from apex_bdq.guard import GuardedPolicy, guard_for
        pol = load_policy(path, cfg)
        if kind == "checkpoint":
            g = guard_for(train_config_of(load_checkpoint(path), path))
            if g is not None:
                return GuardedPolicy(pol, g)
        return pol
    return make_baseline(name)


def is_checkpoint(name: str) -> bool:
    return name.startswith(("checkpoint:", "checkpoint-unguarded:"))


def checkpoint_platform(names: list[str], base: SimConfig) -> tuple[SimConfig, list[str]]:
    """The simulator config the checkpoints among `names` were trained with (trace and
    seed reset to those of `base`), and the fields where it differs from the default; `base`
    when there is no checkpoint. Checkpoints of different platforms are refused."""
    found: dict[str, SimConfig] = {}
    for n in names:
        if is_checkpoint(n):
            path = n.split(":", 1)[1]
            ck = load_checkpoint(path)
            try:
                sim = sim_config_from_dict(ck["config"]["sim"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # ConfigError is a ValueError
                raise CheckpointError(f"checkpoint {path!r} has no usable simulator config: {e}") from e
            # trace augmentation is training-only: checkpoints trained with and without it
            # run on the same platform (each under its own guard, whose coverage includes it)
            found[path] = sim.replace(trace=base.trace, seed=base.seed, num_shards=base.num_shards,
                                      augment=base.augment)
    if not found:
        return base, []
    (first, cfg), *rest = found.items()
    for path, other in rest:
        if other != cfg:
            diff = [f.name for f in dataclasses.fields(SimConfig) if getattr(other, f.name) != getattr(cfg, f.name)]
            raise CheckpointError(f"checkpoints {first!r} and {path!r} were trained on different platforms "
                                  f"(sim fields {', '.join(diff)}): evaluate them separately")
    ref = SimConfig(platform=cfg.platform)
    changed = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(SimConfig)
               if f.name != "trace" and getattr(cfg, f.name) != getattr(ref, f.name)]
    return cfg, changed


def policy_names(spec: str, platform: str) -> list[str]:
    """The comma-separated names of `spec` in order, each once; `all` stands for every
    baseline of the platform (so `all,checkpoint:PATH` judges a checkpoint beside them)."""
    names: list[str] = []
    for p in (p.strip() for p in spec.split(",")):
        for n in ([b for b in BASELINES if platform == "v2" or b not in V2_ONLY] if p == "all" else [p] if p else []):
            if n not in names:
                names.append(n)
    return names


def run_trace(cfg: SimConfig, policies: list[str], shards: int, ticks: Optional[int],
              show_progress: bool, replicas: int = 1, split: str = "eval") -> dict[str, EvalResult]:
    out = {}
    for name in policies:
        pol = make_policy(name, cfg)
        out[name] = evaluate_policy(pol, cfg, shards=shards, ticks=ticks, progress=_Progress(name, show_progress),
                                    replicas=replicas, split=split)
        if hasattr(pol, "shares"):  # under a guard: how often it bounded or replaced the decision
            out[name].metrics.update(pol.shares())
    return out


def judge_all(cfg: SimConfig, metrics: dict[str, dict], shards: int, replicas: int, ticks: Optional[int],
              use_cache: bool, show_progress: bool, split: str = "eval") -> dict:
    """Frontiers for `cfg` on `split`, the yardstick of every policy in `metrics` (added in
    place under "yardstick"), the headroom; {"refused": reason} when the range cannot tell
    policies apart."""
    f = ys.frontiers(cfg, shards, replicas, split=split, ticks=ticks, use_cache=use_cache,
                     log=(lambda s: print(f"  {s}", file=sys.stderr, flush=True)) if show_progress else None,
                     progress_for=lambda rule: _Progress(rule, show_progress))
    windows = next(iter(metrics.values()))["slo_windows"]
    try:
        ys.check_resolution(f["frontiers"], windows)
    except ys.YardstickError as e:
        return {"refused": str(e), "frontiers": f["frontiers"], "oracle_frontier": f["oracle"]}
    for m in metrics.values():
        m["yardstick"] = ys.judge(m, f["frontiers"], f["oracle"])
        m.update({k: m["yardstick"][k] for k in ("cost_saving_vs_best_rule", "violation_ratio_vs_best_rule",
                                                 "oracle_gap_closed")})
    out = {"frontiers": f["frontiers"], "oracle_frontier": f["oracle"], "tier_points": f.get("tiers", []),
           "cached": f["cached"]}
    floor = 0.5 / max(windows, 1)
    for p in out["tier_points"]:  # where each constant capacity tier sits against the best rule
        rule, c = ys.best_rule_cost(f["frontiers"], p["slo_violation_rate"], floor)
        p["best_rule"], p["cost_saving_vs_best_rule"] = rule, (None if c is None else 1.0 - p["cost"] / c)
    if f["oracle"]:
        rates = HEADROOM_RATES
        if "hpa" in metrics:
            rates = (metrics["hpa"]["slo_violation_rate"],) + rates
        out["headroom"] = ys.headroom(f["frontiers"], f["oracle"], rates, windows)
    return out


def plot_series(results: dict[str, EvalResult], path: str, title: str, tick_s: float) -> None:
    """Load, capacity and p99 over time of shard 0 for each policy."""
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


def plot_frontiers(judged: dict, metrics: dict[str, dict], path: str, title: str) -> None:
    """Cost against SLO violation rate: each rule's sweep as a line, the oracle's sweep, and
    every evaluated policy as a point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    floor = 0.5 / max(next(iter(metrics.values()))["slo_windows"], 1)
    curves = dict(judged["frontiers"])
    if judged.get("oracle_frontier"):
        curves["oracle (sees the future)"] = judged["oracle_frontier"]
    for i, (rule, pts) in enumerate(curves.items()):
        pts = sorted(pts, key=lambda p: p["slo_violation_rate"])
        style = dict(marker="^", ls="--", color="black") if "oracle" in rule else dict(marker="o", ls="-", color=f"C{i}")
        ax.plot([max(p["slo_violation_rate"], floor) for p in pts], [p["cost"] for p in pts], ms=4, lw=1.2,
                label=rule, **style)
    for j, (name, m) in enumerate(metrics.items()):
        ax.plot([max(m["slo_violation_rate"], floor)], [m["cost"]], "*", ms=13, mec="black", mew=0.6,
                color=f"C{(j + 4) % 10}", label=f"{name} (default setting)" if name in BASELINES else name)
    ax.set_xscale("log")
    ax.set_xlabel("SLO violation rate (share of class-windows; late + refused work)")
    ax.set_ylabel("cost (replica-seconds per second, / mean load)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="all",
                    help=f"one of {sorted(BASELINES)}, 'all' (every baseline), checkpoint:PATH, "
                         f"checkpoint-unguarded:PATH, or a comma-separated list of them (e.g. all,checkpoint:PATH)")
    ap.add_argument("--trace", help="CSV trace, or 'shared' for every trace in ../shared/traces")
    ap.add_argument("--platform", choices=("v2", "v1"), help="the platform (default: v2, or the checkpoints' own)")
    ap.add_argument("--columns", nargs="+", help="rate columns of the trace (default: the first numeric one; "
                    "refused when it looks like a time, with the candidates listed)")
    ap.add_argument("--interval-s", type=float, help="seconds per trace row (default: from the file)")
    ap.add_argument("--smooth-s", type=float,
                    help="centred moving average over the trace's rows before scaling (default: 300 s for the "
                         "bundled NASA trace, 0 for other files; see TraceConfig.smooth_s)")
    ap.add_argument("--shards", type=int, help="segments of the range per copy (default: 64 on v2, 8 on v1)")
    ap.add_argument("--ticks", type=int, help="ticks per segment (default: cover the range)")
    ap.add_argument("--split", choices=("eval", "val"), default="eval",
                    help="the range: the held-out days (eval, default) or the validation days before them "
                         "(val: to choose a checkpoint without looking at the held-out days)")
    ap.add_argument("--replicas", type=int,
                    help="cover the range this many times, each with its own arrivals (default: 2 on v2, 1 on v1)")
    ap.add_argument("--json", help="write the metrics, frontiers and yardstick here")
    ap.add_argument("--plot", help="write a PNG of the frontiers with each policy as a point here")
    ap.add_argument("--series", help="write a PNG of load vs capacity vs p99 over time here")
    ap.add_argument("--no-frontier", action="store_true", help="no rule sweeps and no yardstick, metrics only")
    ap.add_argument("--no-cache", action="store_true", help="recompute the frontiers even if cached")
    ap.add_argument("--ladder", action="store_true",
                    help="v2: also split the oracle's room: the oracle without foresight, then with the "
                         "monitoring lag, then with HPA's scale-down hold, each swept over its margin")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    a = ap.parse_args(argv)

    try:
        platform, changed = checkpoint_platform([p for p in a.policy.split(",")],
                                                SimConfig(platform=a.platform or "v2"))
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.platform and platform.platform != a.platform:
        print(f"error: --platform {a.platform}: the checkpoints were trained on platform {platform.platform}",
              file=sys.stderr)
        return 2
    names = policy_names(a.policy, platform.platform)
    for n in names:
        if n not in BASELINES and not is_checkpoint(n):
            ap.error(f"unknown policy {n!r}: choose from {sorted(BASELINES)}, 'all', checkpoint:PATH or "
                     f"checkpoint-unguarded:PATH")
        if n in V2_ONLY and platform.platform != "v2":
            ap.error(f"policy {n!r} exists on platform v2 only")
    shards_d, replicas_d = LAYOUT[platform.platform]
    shards = a.shards if a.shards is not None else shards_d
    replicas = a.replicas if a.replicas is not None else replicas_d
    if shards < 1 or replicas < 1 or (a.ticks is not None and a.ticks < 1):
        ap.error("--shards, --replicas and --ticks must be >= 1")
    if a.ladder and (platform.platform != "v2" or a.no_frontier):
        ap.error("--ladder needs platform v2 and the frontiers (not --no-frontier)")

    if a.trace == "shared":
        if not SHARED_TRACES.is_dir():
            ap.error(f"--trace shared: {SHARED_TRACES} does not exist")
        traces = [(p, SHARED_COLUMNS.get(p.name)) for p in sorted(SHARED_TRACES.glob("*.csv"))
                  if not p.name.endswith("_meta.csv")]
    elif a.trace:
        traces = [(Path(a.trace), tuple(a.columns) if a.columns else None)]
    else:
        traces = [(None, None)]

    print(f"platform {platform.platform}" + (f" of the checkpoint (differs from the default in {', '.join(changed)})"
                                             if changed else ""))
    show = not a.quiet and sys.stderr.isatty()
    all_results: dict = {}
    compared = failed = 0
    for path, cols in traces:
        label = path.name if path else f"bundled trace ({platform.platform})"
        try:
            cfg = platform.replace(trace=TraceConfig(path=str(path) if path else None, columns=cols,
                                                     interval_s=a.interval_s, smooth_s=a.smooth_s))
            results = run_trace(cfg, names, shards, a.ticks, show, replicas, a.split)
            metrics = {n: r.metrics for n, r in results.items()}
            judged = None if a.no_frontier else judge_all(cfg, metrics, shards, replicas, a.ticks,
                                                          not a.no_cache, show, a.split)
        except (TraceError, ConfigError, CheckpointError, ValueError) as e:
            print(f"error: {label}: {e}", file=sys.stderr)
            if len(traces) == 1:
                return 2
            all_results[label] = {"error": str(e)}  # --trace shared: the other traces still run
            failed += 1
            continue
        first = next(iter(metrics.values()))
        copies = f", {replicas} copies with their own arrivals" if replicas > 1 else ""
        title = (f"\n{label}: {first['range']}; {shards} segments x {first['ticks']:,} ticks{copies}; "
                 f"{first['slo_windows']:,} settled class-windows per policy")
        entry: dict = {"policies": metrics, "split": a.split, "range": first["range"], "rate_columns": first.get("rate_columns"),
                       "slo_windows": first["slo_windows"],
                       "floor_cost": first.get("offered_cost")}
        if judged is not None and "refused" in judged:
            print(title)
            print(f"comparison refused: {judged['refused']}")
            entry.update(judged)
        else:
            print_policies(title, metrics)
            if judged is not None:
                compared += 1
                entry.update(judged)
                print_frontiers(judged["frontiers"], judged["oracle_frontier"])
                tiers = judged.get("tier_points") or []
                if tiers:
                    print("constant capacity tiers (other branches at the default): cost / violation rate (saving "
                          "vs the best rule at that rate): " + "   ".join(
                              f"{p['setting']}: {p['cost']:.3f} / {p['slo_violation_rate']:.4f} "
                              f"({_pct(p['cost_saving_vs_best_rule'])})" for p in tiers))
                if "offered_cost" in first:
                    print(f"floor (only the offered work billed, every replica busy): {first['offered_cost']:.3f}")
                for h in judged.get("headroom", []):
                    print(f"headroom at violation rate {h['slo_violation_rate']:.4f}: the best rule "
                          f"({h['best_rule'] or '-'}) costs {_num(h['best_rule_cost'])}, the oracle "
                          f"{_num(h['oracle_cost'])}: oracle saving {_pct(h['oracle_saving'])}")
                if a.ladder:
                    rates = tuple(h["slo_violation_rate"] for h in judged.get("headroom", [])) or HEADROOM_RATES
                    entry["oracle_ladder"] = ys.ladder(
                        cfg, judged["frontiers"], shards, replicas, rates, first["slo_windows"], split=a.split,
                        ticks=a.ticks,
                        log=(lambda s: print(f"  {s}", file=sys.stderr, flush=True)) if show else None)
                    print_ladder(entry["oracle_ladder"])
            else:
                compared += 1
        all_results[label] = entry
        if a.plot and judged is not None and "frontiers" in judged:
            p = a.plot if len(traces) == 1 else str(Path(a.plot).with_suffix("")) + f"_{Path(label).stem}.png"
            plot_frontiers(judged, metrics, p, f"{label}: {first['range']}")
            print(f"wrote {p}")
        if a.series:
            p = a.series if len(traces) == 1 else str(Path(a.series).with_suffix("")) + f"_{Path(label).stem}.png"
            plot_series(results, p, label, cfg.tick_s)
            print(f"wrote {p}")
    if a.json:
        payload = next(iter(all_results.values())) if len(all_results) == 1 else all_results
        write_json(a.json, payload)
        print(f"wrote {a.json}")
    return 0 if compared and not failed else 2


if __name__ == "__main__":
    sys.exit(main())
