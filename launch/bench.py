"""Benchmarks: print a table, write JSON.

    python -m launch.bench sim [--json PATH] [--repeats 5] [--seconds 1.0]

`sim`: shard-steps per second of the vectorised PlatformSim at S = 1, 64, 1024 on one core,
side by side with a plain per-shard loop of the same dynamics (S single-shard simulators
stepped one after the other), both returning fresh observation arrays; then S = 1024 once
more with observations returned as views (the zero-copy path a trainer uses). Each figure is the median of `--repeats` timed runs of about
`--seconds` each, all in this one process, pinned to one CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _pin_one_core() -> str:
    try:
        cpu = sorted(os.sched_getaffinity(0))[-1]
        os.sched_setaffinity(0, {cpu})
        return f"cpu{cpu}"
    except (AttributeError, OSError):
        return "unpinned"


def _policy_actions(rng: np.random.Generator, S: int, D: int, n: int, steps: int) -> np.ndarray:
    """Pre-drawn random actions, so the timing holds the simulator alone."""
    return rng.integers(0, n, size=(steps, S, D))


def _time_steps(step_fn, actions: np.ndarray, seconds: float) -> float:
    """Steps/s of `step_fn` over pre-drawn actions, for about `seconds`."""
    # Warm-up, then choose a step count that fills the time budget.
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.1 * seconds or n < 3:
        step_fn(actions[n % len(actions)])
        n += 1
    per = (time.perf_counter() - t0) / n
    steps = max(3, int(seconds / per))
    t0 = time.perf_counter()
    for i in range(steps):
        step_fn(actions[i % len(actions)])
    return steps / (time.perf_counter() - t0)


def bench_sim(repeats: int, seconds: float) -> dict:
    from apex_bdq.config import SimConfig
    from apex_bdq.sim.platform import PlatformSim

    pinned = _pin_one_core()
    base = SimConfig()
    rng = np.random.default_rng(0)
    rows = []
    result: dict = {"pinned": pinned, "repeats": repeats, "python": platform.python_version(),
                    "numpy": np.__version__, "vectorised": {}, "loop": {}}
    for S in (1, 64, 1024):
        cfg = base.replace(num_shards=S)
        sim = PlatformSim(cfg)
        acts = _policy_actions(rng, S, cfg.num_branches, cfg.sub_actions, 64)

        def vec_step(a, sim=sim):
            _, _, trunc, _ = sim.step(a)
            if trunc:
                sim.reset()

        vec = [S * _time_steps(vec_step, acts, seconds) for _ in range(repeats)]
        result["vectorised"][S] = statistics.median(vec)
        loop = None
        if S > 1:
            # The same dynamics, one single-shard simulator per shard, stepped in a Python loop.
            singles = [PlatformSim(base.replace(num_shards=1, seed=i)) for i in range(S)]

            def loop_step(a, singles=singles):
                for i, s in enumerate(singles):
                    _, _, trunc, _ = s.step(a[i:i + 1])
                    if trunc:
                        s.reset()

            loop_runs = [S * _time_steps(loop_step, acts, seconds) for _ in range(repeats)]
            loop = statistics.median(loop_runs)
            result["loop"][S] = loop
        rows.append((S, result["vectorised"][S], min(vec), max(vec), loop))
    # The zero-copy path (micro history returned as a view, valid until the next step) that a
    # trainer uses when it copies observations into replay itself.
    sim = PlatformSim(base.replace(num_shards=1024), copy_obs=False)
    acts = _policy_actions(rng, 1024, base.num_branches, base.sub_actions, 64)

    def view_step(a, sim=sim):
        _, _, trunc, _ = sim.step(a)
        if trunc:
            sim.reset()

    zc = [1024 * _time_steps(view_step, acts, seconds) for _ in range(repeats)]
    result["vectorised_zero_copy_steps_per_s"] = statistics.median(zc)
    result["vectorised_steps_per_s"] = result["vectorised"][1024]
    result["loop_steps_per_s"] = result["loop"][1024]
    result["ratio"] = result["vectorised_steps_per_s"] / result["loop_steps_per_s"]
    print(f"PlatformSim shard-steps/s on one core ({pinned}), median of {repeats} runs, random actions")
    print(f"{'S':>6} {'vectorised':>14} {'(min..max)':>24} {'per-shard loop':>16} {'ratio':>8}")
    for S, v, lo, hi, loop in rows:
        ls = f"{loop:,.0f}" if loop else "-"
        rs = f"{v / loop:,.1f}x" if loop else "-"
        print(f"{S:>6} {v:>14,.0f} {f'({lo:,.0f}..{hi:,.0f})':>24} {ls:>16} {rs:>8}")
    print(f"{'1024*':>6} {result['vectorised_zero_copy_steps_per_s']:>14,.0f} {f'({min(zc):,.0f}..{max(zc):,.0f})':>24}"
          f"  (* observations as views, no copy)")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["sim"], help="which benchmark")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per timed run")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.seconds <= 0:
        ap.error("--repeats must be >= 1 and --seconds > 0")
    res = bench_sim(a.repeats, a.seconds)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2, default=str))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
