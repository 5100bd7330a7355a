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


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _replay_fields():
    """Transition fields with the simulator's real shapes (default SimConfig)."""
    import torch

    from apex_bdq.config import SimConfig
    from apex_bdq.sim.platform import MACRO_FEATURES, MICRO_FEATURES
    from replay_server.replay import FieldSpec
    c = SimConfig()
    fm, micro = len(MACRO_FEATURES), (c.num_classes, c.history, len(MICRO_FEATURES))
    return {"macro": FieldSpec((fm,), torch.float32), "micro": FieldSpec(micro, torch.float32),
            "action": FieldSpec((c.num_branches,), torch.uint8), "reward": FieldSpec((), torch.float32),
            "discount": FieldSpec((), torch.float32), "next_macro": FieldSpec((fm,), torch.float32),
            "next_micro": FieldSpec(micro, torch.float32)}


def _chunk(fields, m: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, f in fields.items():
        if f.dtype == torch.uint8:
            out[k] = torch.randint(0, 5, (m, *f.shape), generator=g, dtype=torch.uint8)
        else:
            out[k] = torch.rand((m, *f.shape), generator=g)
    return out


def _time_loop(fn, seconds: float) -> float:
    """Calls/s of fn over about `seconds`, after a warm-up."""
    for _ in range(5):
        fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def bench_replay(repeats: int, seconds: float, capacity: int, batch: int, chunk: int, peers: bool) -> dict:
    """Prioritized replay at full capacity: insert rate, then sample B + update B as one step."""
    import gc

    import torch

    from replay_server.replay import PrioritizedReplay
    pinned = _pin_one_core()
    torch.set_num_threads(1)
    fields = _replay_fields()
    chunks = [_chunk(fields, chunk, s) for s in range(4)]
    prio = torch.rand(chunk) + 0.01
    res: dict = {"pinned": pinned, "capacity": capacity, "batch": batch, "chunk": chunk, "repeats": repeats,
                 "torch": torch.__version__}
    rss0 = _rss_mb()

    # -- ours --
    rb = PrioritizedReplay(capacity, fields, device="cpu", seed=0)
    rb.sample  # noqa: B018  (build the C++ kernels before timing)
    from replay_server._cpu_kernels import kernels
    res["ours_cpu_kernels"] = kernels() is not None
    t0 = time.perf_counter()
    for i in range(-(-capacity // chunk)):
        rb.add(chunks[i % 4], prio)
    res["ours_insert_per_s"] = capacity / (time.perf_counter() - t0)
    res["peak_rss_mb"] = _rss_mb("VmHWM")
    res["ours_rss_mb"] = _rss_mb() - rss0
    per = sum(t.element_size() * t[0].numel() for t in rb.storage.values())
    per += rb.generation.element_size() + sum(lv.element_size() * lv.numel() for lv in rb.tree.levels) / capacity
    res["bytes_per_transition"] = per
    new_p = torch.rand(batch) + 0.01

    def ours_step(rb=rb):
        s = rb.sample(batch)
        rb.update_priorities(s.indices, s.generations, new_p)

    ours = [_time_loop(ours_step, seconds) for _ in range(repeats)]
    res["ours_steps_per_s"] = statistics.median(ours)
    del rb
    gc.collect()

    res["cpprb_steps_per_s"] = res["torchrl_steps_per_s"] = None
    if peers:
        try:
            import cpprb
            np_chunks = [{k: v.numpy() for k, v in c.items()} for c in chunks]
            env = {k: {"shape": f.shape or 1, "dtype": np.uint8 if f.dtype == torch.uint8 else np.float32}
                   for k, f in fields.items()}
            crb = cpprb.PrioritizedReplayBuffer(capacity, env, alpha=0.6, eps=1e-6)
            t0 = time.perf_counter()
            for i in range(-(-capacity // chunk)):
                crb.add(**np_chunks[i % 4], priorities=prio.numpy())
            res["cpprb_insert_per_s"] = capacity / (time.perf_counter() - t0)
            new_np = new_p.numpy()

            def cpprb_step():
                s = crb.sample(batch, beta=0.4)
                crb.update_priorities(s["indexes"], new_np)

            res["cpprb_steps_per_s"] = statistics.median(_time_loop(cpprb_step, seconds) for _ in range(repeats))
            res["cpprb_version"] = cpprb.__version__ if hasattr(cpprb, "__version__") else "?"
            del crb
            gc.collect()
        except ImportError as e:
            res["cpprb_error"] = str(e)
        try:
            res["torchrl_extension"] = __import__("launch._peers", fromlist=["x"]).ensure_torchrl_extension()
            import torchrl
            from tensordict import TensorDict
            from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer
            trb = ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=PrioritizedSampler(capacity, 0.6, 0.4),
                               batch_size=batch)
            tds = [TensorDict(c, batch_size=[chunk]) for c in chunks]
            t0 = time.perf_counter()
            for i in range(-(-capacity // chunk)):
                idx = trb.extend(tds[i % 4])
                trb.update_priority(idx, prio)
            res["torchrl_insert_per_s"] = capacity / (time.perf_counter() - t0)

            def torchrl_step():
                _, info = trb.sample(return_info=True)
                trb.update_priority(info["index"], new_p)

            res["torchrl_steps_per_s"] = statistics.median(_time_loop(torchrl_step, seconds) for _ in range(repeats))
            res["torchrl_version"] = torchrl.__version__
            del trb
            gc.collect()
        except ImportError as e:
            res["torchrl_error"] = str(e)
    peer = [v for v in (res["cpprb_steps_per_s"], res["torchrl_steps_per_s"]) if v]
    res["ratio_vs_faster_peer"] = res["ours_steps_per_s"] / max(peer) if peer else None
    print(f"Prioritized replay, capacity {capacity:,}, sample {batch} + update {batch} per step, "
          f"one pinned core ({pinned}), median of {repeats}")
    print(f"{'':10} {'steps/s':>12} {'insert/s':>14}")
    for name in ("ours", "cpprb", "torchrl"):
        v = res.get(f"{name}_steps_per_s")
        ins = res.get(f"{name}_insert_per_s")
        print(f"{name:10} {v:>12,.0f} {ins:>14,.0f}" if v else f"{name:10} {'n/a':>12}")
    print(f"bytes/transition {res['bytes_per_transition']:.0f}, peak RSS {res['peak_rss_mb']:,.0f} MB; "
          f"ours / faster peer: {res['ratio_vs_faster_peer']:.2f}x" if peer else "")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["sim", "replay"], help="which benchmark")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per timed run")
    ap.add_argument("--capacity", type=int, default=1_000_000, help="replay: capacity")
    ap.add_argument("--batch", type=int, default=512, help="replay: sample / update batch")
    ap.add_argument("--chunk", type=int, default=4096, help="replay: insert chunk")
    ap.add_argument("--no-peers", action="store_true", help="replay: skip cpprb and TorchRL")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.seconds <= 0:
        ap.error("--repeats must be >= 1 and --seconds > 0")
    if a.what == "sim":
        res = bench_sim(a.repeats, a.seconds)
    else:
        res = bench_replay(a.repeats, a.seconds, a.capacity, a.batch, a.chunk, not a.no_peers)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2, default=str))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
