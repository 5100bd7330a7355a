"""Shadow report: the policy's replicas beside the rule's over a logged period.

    python -m launch.shadow_report runs/platform_replay/decisions.jsonl [--out runs/shadow_report]

Reads a scaler's decision log (one JSON line per decision: `launch.scaler --log`,
`launch.platform_replay`) and writes
  report.csv   one row per decision and class: rule, learned (raw), guarded, applied,
               needed (the fewest replicas the queueing model says meet the SLO at the
               monitored rate), fallback reason;
  report.json  per class and in all: replica-seconds of the rule and of the guarded policy
               (the implied cost ratio), the share of decisions each sits below `needed`
               (the implied SLO risk), fallback shares by reason, guard moves (the share
               of decisions the guard's replica floor raised, its ceiling lowered);
  report.png   per class the replica curves of both, and `needed`.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Optional

import numpy as np


def summarise(rows: list[dict]) -> dict:
    if not rows:
        raise ValueError("the log holds no decisions")
    classes = rows[0]["classes"]
    K = len(classes)
    ts = np.array([r["t"] for r in rows], dtype=np.float64)
    period = float(np.median(np.diff(ts))) if len(ts) > 1 else 15.0
    # each decision weighs until the next, at most two periods (a restart's gap or a log
    # appended out of order must not dominate the replica-seconds)
    dt = np.clip(np.diff(ts, append=ts[-1] + period), 0.0, 2 * period)

    def col(key):
        return np.array([r[key] if r.get(key) is not None else [np.nan] * K for r in rows], dtype=np.float64)

    rule, learned, guarded, applied, needed = (col(k) for k in ("rule", "learned", "guarded", "applied", "needed"))
    both = np.isfinite(rule).all(1) & np.isfinite(guarded).all(1)
    floor = col("floor")  # the guard's replica floor (the predictive rule at its floor margin); NaN: none
    floored = both & np.isfinite(floor).all(1)
    ceiling = col("ceiling")  # its replica ceiling (static provisioning's, the predictive rule's); NaN: none
    capped = both & np.isfinite(ceiling).all(1)
    reasons: dict = {}
    for r in rows:
        if r.get("fallback"):
            reasons[r["fallback"]] = reasons.get(r["fallback"], 0) + 1
    per_class = {}
    for k, c in enumerate(classes):
        m = both & np.isfinite(needed[:, k])
        rs = float((rule[both, k] * dt[both]).sum())
        ls = float((guarded[both, k] * dt[both]).sum())
        per_class[c] = {
            "rule_replica_s": rs, "policy_replica_s": ls,
            "cost_ratio_policy_over_rule": ls / rs if rs > 0 else None,
            "rule_below_needed_share": float((rule[m, k] < needed[m, k]).mean()) if m.any() else None,
            "policy_below_needed_share": float((guarded[m, k] < needed[m, k]).mean()) if m.any() else None,
            "guard_moved_share": float((guarded[both, k] != learned[both, k]).mean()) if both.any() else None,
            "floor_raised_share": float((learned[floored, k] < floor[floored, k]).mean()) if floored.any() else None,
            "ceiling_lowered_share": float((learned[capped, k] > ceiling[capped, k]).mean()) if capped.any() else None,
        }
    rs = sum(v["rule_replica_s"] for v in per_class.values())
    ls = sum(v["policy_replica_s"] for v in per_class.values())
    m = both[:, None] & np.isfinite(needed)
    return {
        "decisions": len(rows), "mode": rows[-1].get("mode"), "classes": classes,
        "compared_decisions": int(both.sum()),
        "period_s": float(ts[-1] - ts[0]) if len(ts) > 1 else 0.0,
        "cost_ratio_policy_over_rule": ls / rs if rs > 0 else None,
        "rule_below_needed_share": float((rule[m.any(1)] < needed[m.any(1)]).mean()) if m.any() else None,
        "policy_below_needed_share": float((guarded[m.any(1)] < needed[m.any(1)]).mean()) if m.any() else None,
        "fallback_share": {k: v / len(rows) for k, v in sorted(reasons.items())},
        "decision_s_p50": float(np.percentile([r["decide_s"] for r in rows], 50)),
        "decision_s_p99": float(np.percentile([r["decide_s"] for r in rows], 99)),
        "per_class": per_class,
    }, (ts, rule, learned, guarded, applied, needed)


def write_report(log: str | Path, out: str | Path) -> dict:
    from apex_bdq.control import read_log
    from launch._io import save_figure, write_json
    rows = read_log(log)
    summary, (ts, rule, learned, guarded, applied, needed) = summarise(rows)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    classes = summary["classes"]
    with open(out / "report.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "class", "rule", "learned", "guarded", "applied", "needed", "fallback"])
        for i, r in enumerate(rows):
            for k, c in enumerate(classes):
                w.writerow([r["t"], c] + ["" if not np.isfinite(x[i, k]) else int(x[i, k])
                                          for x in (rule, learned, guarded, applied, needed)] + [r.get("fallback") or ""])
    write_json(out / "report.json", summary)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(classes), 1, figsize=(9, 2.2 * len(classes)), sharex=True, squeeze=False)
    minutes = (ts - ts[0]) / 60.0
    for k, (ax, c) in enumerate(zip(axes[:, 0], classes)):
        ax.step(minutes, rule[:, k], where="post", label="rule (HPA on the same telemetry)", color="tab:gray")
        ax.step(minutes, guarded[:, k], where="post", label="policy (guarded)", color="tab:blue")
        ax.plot(minutes, needed[:, k], ":", label="needed for the SLO at the monitored rate", color="tab:red")
        pc = summary["per_class"][c]
        ratio = pc["cost_ratio_policy_over_rule"]
        ax.set_title(f"{c}: policy / rule replica-seconds {ratio:.3f}" if ratio else c, fontsize=9)
        ax.set_ylabel("replicas")
    axes[0, 0].legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("minutes")
    save_figure(fig, out / "report.png")
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.shadow_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a scaler's decisions.jsonl")
    ap.add_argument("--out", help="output folder (default: report/ beside the log)")
    a = ap.parse_args(argv)
    log = Path(a.log)
    if not log.is_file():
        print(f"error: no decision log at {log}", file=sys.stderr)
        return 2
    try:
        s = write_report(log, a.out or log.parent / "report")
    except (ValueError, KeyError) as e:
        print(f"error: {log}: {e}", file=sys.stderr)
        return 2

    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"
    print(f"{s['decisions']} decisions over {s['period_s'] / 60:.1f} min ({s['mode']} mode), "
          f"{s['compared_decisions']} with both replica counts")
    print(f"{'class':10s} {'policy/rule replica-s':>22s} {'rule < needed':>14s} {'policy < needed':>16s}")
    for c, v in s["per_class"].items():
        r = v["cost_ratio_policy_over_rule"]
        print(f"{c:10s} {('n/a' if r is None else f'{r:.3f}'):>22s} {pct(v['rule_below_needed_share']):>14s} "
              f"{pct(v['policy_below_needed_share']):>16s}")
    r = s["cost_ratio_policy_over_rule"]
    print(f"{'all':10s} {('n/a' if r is None else f'{r:.3f}'):>22s} {pct(s['rule_below_needed_share']):>14s} "
          f"{pct(s['policy_below_needed_share']):>16s}")
    raised = [v["floor_raised_share"] for v in s["per_class"].values()]
    if any(x is not None for x in raised):
        print("the guard's floor raised the learned replicas in " + " / ".join(pct(x) for x in raised)
              + " of the class-decisions")
    lowered = [v["ceiling_lowered_share"] for v in s["per_class"].values()]
    if any(x is not None for x in lowered):
        print("its ceiling lowered them in " + " / ".join(pct(x) for x in lowered) + " of the class-decisions")
    print(f"fallbacks: {s['fallback_share'] or 'none'}; decision p50 / p99 "
          f"{s['decision_s_p50'] * 1e3:.1f} / {s['decision_s_p99'] * 1e3:.1f} ms")
    print(f"written: {Path(a.out or log.parent / 'report')}/report.csv, report.json, report.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
