"""Benchmarks: print a table, write JSON.

    python -m launch.bench sim [--json PATH] [--repeats 5] [--seconds 1.0]
    python -m launch.bench replay [--json PATH]
    python -m launch.bench apex [--json PATH] [--seconds 60] [--actors 1,2,4,8] [--plot PNG]
    python -m launch.bench route [--json PATH] [--batch 512]
    python -m launch.bench preference [--json PATH] [--updates 6000] [--variants without,with] [--keep DIR]
    python -m launch.bench preference-fit --log LOG [--checkpoint CK] [--steps 1800] [--dense N]
                                                                     (see launch/bench_preference_fit.py)
    python -m launch.bench serve [--json PATH] [--requests 1000]      (see launch/bench_serve.py)
    python -m launch.bench serve-abuse [--json PATH] [--seconds 20]   (valid requests beside hostile ones)
    python -m launch.bench feedback-log [--json PATH] [--requests 1200] [--repeats 3] [--folder DIR]
                                                                     (see launch/bench_feedback_log.py)

`sim`: shard-steps per second of the vectorised simulator (the default platform, v2) at S = 1, 64, 1024 on one core,
side by side with a plain per-shard loop of the same dynamics (S single-shard simulators
stepped one after the other), both returning fresh observation arrays; then S = 1024 once
more with observations returned as views (the zero-copy path a trainer uses). Each figure is the median of `--repeats` timed runs of about
`--seconds` each, all in this one process, pinned to one CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

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
    from apex_bdq.sim import make_sim

    pinned = _pin_one_core()
    base = SimConfig()
    rng = np.random.default_rng(0)
    rows = []
    result: dict = {"pinned": pinned, "repeats": repeats, "python": platform.python_version(),
                    "numpy": np.__version__, "vectorised": {}, "loop": {}}
    for S in (1, 64, 1024):
        cfg = base.replace(num_shards=S)
        sim = make_sim(cfg)
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
            singles = [make_sim(base.replace(num_shards=1, seed=i)) for i in range(S)]

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
    sim = make_sim(base.replace(num_shards=1024), copy_obs=False)
    acts = _policy_actions(rng, 1024, base.num_branches, base.sub_actions, 64)

    def view_step(a, sim=sim):
        _, _, trunc, _ = sim.step(a)
        if trunc:
            sim.reset()

    zc = [1024 * _time_steps(view_step, acts, seconds) for _ in range(repeats)]
    result["vectorised_zero_copy_steps_per_s"] = statistics.median(zc)
    # Platform v1 at S = 1024 beside it (its shared pool has no sizing, holds or history).
    v1 = make_sim(SimConfig(platform="v1", num_shards=1024))
    acts1 = _policy_actions(rng, 1024, v1.D, v1.n, 64)

    def v1_step(a, sim=v1):
        _, _, trunc, _ = sim.step(a)
        if trunc:
            sim.reset()

    result["v1_vectorised_steps_per_s"] = statistics.median([1024 * _time_steps(v1_step, acts1, seconds)
                                                             for _ in range(repeats)])
    result["platform"] = base.platform
    result["vectorised_steps_per_s"] = result["vectorised"][1024]
    result["loop_steps_per_s"] = result["loop"][1024]
    result["ratio"] = result["vectorised_steps_per_s"] / result["loop_steps_per_s"]
    print(f"platform {base.platform} simulator shard-steps/s on one core ({pinned}), median of {repeats} runs, "
          f"random actions")
    print(f"{'S':>6} {'vectorised':>14} {'(min..max)':>24} {'per-shard loop':>16} {'ratio':>8}")
    for S, v, lo, hi, loop in rows:
        ls = f"{loop:,.0f}" if loop else "-"
        rs = f"{v / loop:,.1f}x" if loop else "-"
        print(f"{S:>6} {v:>14,.0f} {f'({lo:,.0f}..{hi:,.0f})':>24} {ls:>16} {rs:>8}")
    print(f"{'1024*':>6} {result['vectorised_zero_copy_steps_per_s']:>14,.0f} {f'({min(zc):,.0f}..{max(zc):,.0f})':>24}"
          f"  (* observations as views, no copy)")
    print(f"{'1024':>6} {result['v1_vectorised_steps_per_s']:>14,.0f}  platform v1 (one shared pool), for reference")
    return result


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _replay_fields():
    """Transition fields with the simulator's real shapes (default SimConfig)."""
    from apex_bdq.config import NetConfig, SimConfig
    from replay_server.replay_actor import transition_fields
    return transition_fields(NetConfig.for_sim(SimConfig()))


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
    res["ours_insert_kernel"] = rb._insert_kernel() is not None
    res["ours_rss_mb"] = _rss_mb() - rss0
    per = sum(t.element_size() * t[0].numel() for t in rb.storage.values())
    per += rb.generation.element_size() + sum(lv.element_size() * lv.numel() for lv in rb.tree.levels) / capacity
    res["bytes_per_transition"] = per
    new_p = torch.rand(batch) + 0.01

    def ours_step(rb):
        s = rb.sample(batch)
        rb.update_priorities(s.indices, s.generations, new_p)

    ours = [_time_loop(lambda r=rb: ours_step(r), seconds) for _ in range(repeats)]
    res["ours_steps_per_s"] = statistics.median(ours)
    from replay_server import _memory
    res["ours_anon_hugepages_mb"] = _memory.anon_hugepages_mb()
    del rb
    gc.collect()
    # The floor of an insert: a plain copy of the same bytes (the chunk's packed rows, made
    # contiguous beforehand) into fresh storage of the same size and allocation path.
    from replay_server import _memory as _mem
    width = sum(int(torch.Size(f.shape).numel()) for f in fields.values())
    rows = [torch.cat([c[k].reshape(chunk, -1).float() for k in fields], 1).contiguous() for c in chunks]
    buf = _mem.zeros((capacity, width), torch.float32, torch.device("cpu"))
    t0 = time.perf_counter()
    for i in range(-(-capacity // chunk)):
        a = i * chunk
        n = min(chunk, capacity - a)
        buf[a:a + n].copy_(rows[i % 4][:n])
    res["memcpy_insert_per_s"] = capacity / (time.perf_counter() - t0)
    # The floor of a sample + update step: the same memory traffic without a tree, i.e. a
    # gather of `batch` uniformly drawn rows of that storage and a scatter of `batch` floats.
    flat_p = torch.zeros(capacity)
    out = torch.empty(batch, width)

    def gather_step(buf=buf, out=out, flat_p=flat_p):
        ix = torch.randint(0, capacity, (batch,))
        torch.index_select(buf, 0, ix, out=out)
        flat_p.index_copy_(0, ix, new_p)

    res["gather_floor_steps_per_s"] = statistics.median(_time_loop(gather_step, seconds) for _ in range(repeats))
    del buf, rows, flat_p, out, gather_step
    gc.collect()
    # The same replay without the huge-page request (replay_server/_memory.py), side by side.
    os.environ["APEX_BDQ_NO_HUGEPAGES"] = "1"
    try:
        rb = PrioritizedReplay(capacity, fields, device="cpu", seed=0)
        for i in range(-(-capacity // chunk)):
            rb.add(chunks[i % 4], prio)
        res["ours_no_hugepages_steps_per_s"] = statistics.median(_time_loop(lambda r=rb: ours_step(r), seconds)
                                                                  for _ in range(repeats))
    finally:
        os.environ.pop("APEX_BDQ_NO_HUGEPAGES", None)
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
    print(f"{'':18} {'steps/s':>12} {'insert/s':>14}")
    for name in ("ours", "ours_no_hugepages", "cpprb", "torchrl"):
        v = res.get(f"{name}_steps_per_s")
        ins = res.get(f"{name}_insert_per_s")
        print(f"{name:18} {v:>12,.0f} {ins:>14,.0f}" if v and ins else f"{name:18} {v:>12,.0f}" if v
              else f"{name:18} {'n/a':>12}")
    print(f"{'floor':18} {res['gather_floor_steps_per_s']:>12,.0f} {res['memcpy_insert_per_s']:>14,.0f}"
          "   (gather + scatter of the same rows; memcpy of the same bytes)")
    print(f"bytes/transition {res['bytes_per_transition']:.0f}, peak RSS {res['peak_rss_mb']:,.0f} MB; "
          f"ours / faster peer: {res['ratio_vs_faster_peer']:.2f}x" if peer else "")
    if res.get("cpprb_insert_per_s"):
        res["insert_ratio_vs_cpprb"] = res["ours_insert_per_s"] / res["cpprb_insert_per_s"]
        res["sample_update_ratio_vs_cpprb"] = res["ours_steps_per_s"] / res["cpprb_steps_per_s"]
        print(f"insert: ours / cpprb {res['insert_ratio_vs_cpprb']:.2f}x, ours / memcpy floor "
              f"{res['ours_insert_per_s'] / res['memcpy_insert_per_s']:.2f}x; sample + update: ours / cpprb "
              f"{res['sample_update_ratio_vs_cpprb']:.2f}x, ours / gather floor "
              f"{res['ours_steps_per_s'] / res['gather_floor_steps_per_s']:.2f}x")
    return res


def _rllib_env_steps_per_s(num_env_runners: int, envs_per_runner: int, seconds: float) -> float:
    """RLlib (same Ray) sampling the project's gymnasium env with its env runners."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.tune.registry import register_env

    def make_env(cfg):  # runs in each env runner process: import there
        from gymnasium.wrappers import FlattenObservation

        from apex_bdq.sim.gym_env import PlatformEnv
        return FlattenObservation(PlatformEnv())  # RLlib's default encoders take flat boxes
    register_env("apex_bdq_platform", make_env)
    cfg = (PPOConfig().environment("apex_bdq_platform")
           .env_runners(num_env_runners=num_env_runners, num_envs_per_env_runner=envs_per_runner,
                        num_cpus_per_env_runner=1, rollout_fragment_length="auto")
           .learners(num_learners=0))
    algo = cfg.build_algo()
    try:
        group = algo.env_runner_group

        def sample_all() -> int:
            eps = group.foreach_env_runner(lambda r: r.sample(num_timesteps=200 * envs_per_runner),
                                           local_env_runner=False)
            return sum(sum(len(e) for e in batch) for batch in eps)

        sample_all()  # warm-up
        t0, steps = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            steps += sample_all()
        return steps / (time.perf_counter() - t0)
    finally:
        algo.stop()


def _route_ms(batch: int, repeats: int = 50) -> dict:
    """One shard actor, a batch sampled (a) in place from the learner's side of the shared
    memory and (b) through the shard's RPC and the object store."""
    import ray

    from replay_server.replay import PrioritizedReplay
    from apex_bdq.messages import TransitionBatch
    from replay_server.replay_actor import ShardConfig, remote_shard_class
    fields = _replay_fields()
    sc = ShardConfig(capacity=100_000, fields=fields)
    shard = remote_shard_class(num_cpus=0).remote(0, sc)
    m = 4096
    for i in range(10):
        arr = {k: v.numpy() for k, v in _chunk(fields, m, seed=i).items()}
        pr = np.random.default_rng(i).random(m).astype(np.float32)
        ray.get(shard.add.remote(TransitionBatch(**arr, priorities=pr)))
    spec = ray.get(shard.shared_spec.remote())
    rb = PrioritizedReplay.attach(spec, sc.capacity, fields)
    def local_step():
        s = rb.sample(batch)
        rb.update_priorities(s.indices, s.generations, s.weights.double())

    def rpc_step():
        out = ray.get(shard.sample.remote(batch))
        ray.get(shard.update_priorities.remote(out.update(out.weights)))

    res = {}
    for name, fn in (("shared_memory_ms", local_step), ("object_store_ms", rpc_step)):
        for _ in range(10):  # warm-up (the C++ walk loads on first use)
            fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts) * 1e3
    ray.get(shard.close.remote())
    ray.kill(shard)
    res["object_store_over_shared"] = res["object_store_ms"] / res["shared_memory_ms"]
    return res


def bench_apex(actor_counts: list[int], seconds: float, shards_per_actor: int, rllib: bool, plot: str | None) -> dict:
    """Env steps/s, transitions ingested/s and learner updates/s of the Ape-X run for each
    actor count, the learner's share of time waiting for data, the two data routes, and
    RLlib's env runners sampling the same env at the same CPU count."""
    import ray

    from apex_bdq.config import ClusterConfig
    from apex_bdq.ray_runner import ApexRun, local_ray_init
    from apex_bdq.presets import PRESETS
    cfg = PRESETS["default"]
    cfg = dataclasses.replace(cfg, eval_every_s=1e9,
                              agent=dataclasses.replace(cfg.agent, learning_starts=2_000, replay_capacity=100_000))
    cpus = os.cpu_count() or 1
    res: dict = {"machine": f"{platform.machine()}, {cpus} CPUs", "seconds_per_point": seconds,
                 "shards_per_actor": shards_per_actor, "env_steps_per_s": {}, "transitions_per_s": {},
                 "learner_updates_per_s": {}, "learner_wait_share_by_actors": {}}
    spec0 = ClusterConfig(num_actors=max(actor_counts), num_learners=1)
    local_ray_init(spec0, None, include_dashboard=False, log_to_driver=False)
    try:
        res["route"] = _route_ms(512)
        for m in actor_counts:
            spec = ClusterConfig(num_actors=m, num_replay_shards=1, num_learners=1, shards_per_actor=shards_per_actor,
                               actor_cpus=min(1.0, cpus / (m + 1)), learner_cpus=1, checkpoint_every_s=1e9)
            run = ApexRun(cfg, spec)
            marks = []

            def watch(st, marks=marks):
                if "env_steps" in st:
                    marks.append((st["t_s"], st["env_steps"], st["inserted"], (st.get("learner") or {})))
            try:
                run.run(minutes=seconds / 60.0, on_progress=watch)
            finally:
                run.shutdown()
            # Rates over the second half of the run (start-up and replay filling excluded).
            half = [x for x in marks if x[0] >= marks[-1][0] / 2] if marks else []
            if len(half) >= 2:
                (t0, e0, i0, _), (t1, e1, i1, l1) = half[0], half[-1]
                res["env_steps_per_s"][m] = (e1 - e0) / (t1 - t0)
                res["transitions_per_s"][m] = (i1 - i0) / (t1 - t0)
                res["learner_updates_per_s"][m] = l1.get("updates_per_s", float("nan"))
                res["learner_wait_share_by_actors"][m] = l1.get("learner_wait_share", float("nan"))
            print(f"{m} actors: env {res['env_steps_per_s'].get(m, float('nan')):,.0f}/s, "
                  f"ingest {res['transitions_per_s'].get(m, float('nan')):,.0f}/s, "
                  f"updates {res['learner_updates_per_s'].get(m, float('nan')):.1f}/s, "
                  f"learner waiting {res['learner_wait_share_by_actors'].get(m, float('nan')):.1%}", flush=True)
        # The same run deciding every tick (no action repeat), the setting RLlib's runners use:
        # at the curve's shards per actor, and at launch.train's default split (the preset's
        # shards over the actors).
        m = min(2, max(actor_counts))
        pt = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, decision_ticks=1))
        default_split = max(1, cfg.sim.num_shards // m)
        per_tick = {}
        for spa in dict.fromkeys((shards_per_actor, default_split)):
            spec = ClusterConfig(num_actors=m, num_replay_shards=1, num_learners=1, shards_per_actor=spa,
                               actor_cpus=min(1.0, cpus / (m + 1)), learner_cpus=1, checkpoint_every_s=1e9)
            marks_pt: list = []
            run = ApexRun(pt, spec)
            try:
                run.run(minutes=seconds / 60.0, on_progress=lambda st, mk=marks_pt: mk.append((st["t_s"], st["env_steps"]))
                        if "env_steps" in st else None)
            finally:
                run.shutdown()
            half = [x for x in marks_pt if x[0] >= marks_pt[-1][0] / 2]
            per_tick[spa] = (half[-1][1] - half[0][1]) / (half[-1][0] - half[0][0])
            print(f"{m} actors x {spa} shards deciding every tick: env {per_tick[spa]:,.0f}/s", flush=True)
        res["env_steps_per_s_per_tick_decisions"] = {m: per_tick[shards_per_actor]}
        res["per_tick_default_split"] = {"actors": m, "shards_per_actor": default_split,
                                         "env_steps_per_s": per_tick[default_split]}
        best = max(res["env_steps_per_s"], key=res["env_steps_per_s"].get)
        res["learner_wait_share"] = res["learner_wait_share_by_actors"].get(best)
        ray.shutdown()
        if rllib:
            local_ray_init(spec0, None, include_dashboard=False, log_to_driver=False)
            # As many env runners as CPUs, 1 CPU each, each with shards_per_actor envs: RLlib
            # gets the whole machine for sampling (no learner running beside it).
            res["rllib_env_steps_per_s"] = _rllib_env_steps_per_s(cpus, shards_per_actor, seconds / 2)
            res["rllib_env_runners"] = cpus
            res["ratio_vs_rllib"] = res["env_steps_per_s"][best] / res["rllib_env_steps_per_s"]
            res["ratio_vs_rllib_per_tick_decisions"] = (res["env_steps_per_s_per_tick_decisions"][m] /
                                                        res["rllib_env_steps_per_s"])
            dsplit = res["per_tick_default_split"]
            if default_split == shards_per_actor:
                dsplit["rllib_env_steps_per_s"] = res["rllib_env_steps_per_s"]
            else:  # RLlib with as many envs per runner
                dsplit["rllib_env_steps_per_s"] = _rllib_env_steps_per_s(cpus, default_split, seconds / 2)
            dsplit["ratio_vs_rllib"] = dsplit["env_steps_per_s"] / dsplit["rllib_env_steps_per_s"]
            print(f"RLlib: {res['rllib_env_steps_per_s']:,.0f} env steps/s ({shards_per_actor} envs per runner), "
                  f"{dsplit['rllib_env_steps_per_s']:,.0f}/s ({default_split} envs per runner); per-tick ratios "
                  f"{res['ratio_vs_rllib_per_tick_decisions']:.1f}x, {dsplit['ratio_vs_rllib']:.1f}x", flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from launch._io import save_figure
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = sorted(res["env_steps_per_s"])
        ax.plot(xs, [res["env_steps_per_s"][x] for x in xs], "o-", label="apex-bdq env steps/s")
        ax.plot(xs, [res["transitions_per_s"][x] * cfg.agent.decision_ticks for x in xs], "s--",
                label="ingested transitions/s x decision_ticks")
        if "rllib_env_steps_per_s" in res:
            ax.axhline(res["rllib_env_steps_per_s"], color="C3", ls=":", label="RLlib env runners")
        ax.set_xlabel("rollout actors")
        ax.set_ylabel("per second")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(res["machine"])
        save_figure(fig, plot)
        res["plot"] = plot
    return res


PREFERENCE_VARIANTS = {
    # name: overrides on top of the default preset (the ablation is this table)
    "without": [],
    "with": ["pref.enabled=true", "pref.shaping=0.2"],
    "loss_only": ["pref.enabled=true", "pref.explore_softmax=false"],
    "explore_only": ["pref.enabled=true"],
    "shaping_only": ["pref.enabled=true", "pref.explore_softmax=false", "pref.shaping=0.2"],
}


def _overload_reference(net, cfg, decisions: int, seed: int) -> dict:
    """How much overload is left to take away by steering exploration: on the training-range
    simulator of the runs (its own arrival seed), the run's final greedy policy with no
    exploration at all, the same network with the run's epsilon ladder, unsteered (what
    exploration's own draws add at the end of the run), and the most cautious constant
    action (top capacity tier; v2: the longest hold, admit all; v1: fastest servers, middle
    priority and admission levels) with its reward. Both measures: shard-ticks above the
    utilisation threshold, and the share of settled class-windows whose SLO broke."""
    from actors.rollout import RolloutWorker
    from apex_bdq.sim import make_sim
    S, n = cfg.sim.num_shards, cfg.sim.sub_actions
    w = RolloutWorker(cfg.sim, cfg.agent, net, epsilons=np.zeros(S), seed=seed + 1000)
    x = RolloutWorker(cfg.sim, cfg.agent, net, seed=seed + 1000)  # the epsilon ladder, no steer
    for _ in range(decisions):
        w.step()
        x.step()
    sim = make_sim(cfg.sim.replace(seed=seed + 1000))
    sim.reset(seed=seed + 1000)
    a = np.full((S, cfg.sim.num_branches), n // 2)
    a[:, :cfg.sim.num_pools] = n - 1  # capacity branch(es): the top tier
    if cfg.sim.platform == "v2":
        a[:, cfg.sim.num_pools:-1] = int(np.argmax(cfg.sim.hold_s))  # the longest scale-down hold
        a[:, -1] = 0  # admit everything
    else:
        a[:, -1] = n - 1  # speed
    over, reward, broke, settled = 0, 0.0, 0, 0
    for _ in range(decisions * cfg.agent.decision_ticks):
        _, r, truncated, info = sim.step(a)
        over += int((info["utilisation"] > cfg.pref.overload_utilisation).sum())
        reward += float(r.sum())
        if info["window_violated"] is not None:
            broke += int(info["window_violated"].sum())
            settled += info["window_violated"].size
        if truncated:
            sim.reset()
    ticks = decisions * cfg.agent.decision_ticks * S
    return {"greedy_overload_rate": w.overload_ticks / max(w.env_steps, 1),
            "cautious_constant_overload_rate": over / ticks, "cautious_constant_reward": reward / ticks,
            "greedy_breach_rate": w.breached_windows / max(w.settled_windows, 1),
            "final_explorer_overload_rate": x.overload_ticks / max(x.env_steps, 1),
            "final_explorer_breach_rate": x.breached_windows / max(x.settled_windows, 1),
            "cautious_constant_breach_rate": broke / max(settled, 1)}


def cell_pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def bench_preference(updates: int, variants: list[str], extra: list[str], seed: int = 0,
                     keep: Optional[str] = None, minutes: float = 30.0) -> dict:
    """Local training runs of the default preset side by side, the same budget in learner
    updates and the same seed, with and without oracle feedback: overload ticks during
    exploration (rollout shard-ticks above the utilisation threshold), the yardstick's cost
    saving of the final policy on the held-out days, and how well the preference head ranks
    held-out oracle pairs (every 5th oracle pair is kept out of training). The overload
    floor is that of the most cautious constant action: what steering can remove is the
    avoidable overload, the unsteered explorer's rate above that floor."""
    import dataclasses as dc
    import tempfile

    from apex_bdq.config import apply_overrides
    from apex_bdq.local_runner import LocalTrainer
    from apex_bdq.presets import PRESETS
    from apex_bdq import yardstick
    base = dc.replace(PRESETS["default"], minutes=minutes, updates=updates, seed=seed)
    rows = {}
    for name in variants:
        if name not in PREFERENCE_VARIANTS:
            raise SystemExit(f"unknown variant {name!r}: choose from {', '.join(PREFERENCE_VARIANTS)}")
        sets = PREFERENCE_VARIANTS[name] + (extra if name != "without" else [])
        cfg = apply_overrides(base, sets)
        folder = keep or tempfile.mkdtemp(prefix="apex_bdq_pref_")
        os.makedirs(folder, exist_ok=True)
        log = os.path.join(folder, f"{name}.log")
        if os.path.exists(log):  # a log replays its pairs: a second run must not start from the first's
            raise SystemExit(f"{log} exists: --keep needs a folder without this variant's log")
        print(f"[{name}] {updates:,} updates of training {' '.join(sets) or '(no preferences)'}", flush=True)
        tr = LocalTrainer(cfg, feedback_log=log, heldout_every=5)
        res = tr.run(progress=False)
        if tr.pref is not None:
            tr.pref.close()
        if keep:  # for `launch.bench preference-fit --log ... --checkpoint ...`
            tr.checkpoint(os.path.join(folder, f"{name}.pt"))
        p = res["preference"] or {}
        ref = _overload_reference(tr.learner.net, cfg, 400, seed)
        judged = yardstick.report(cfg.sim, res["learned"], cfg.eval_shards, cfg.final_eval_replicas) \
            if cfg.sim.platform == "v2" and cfg.final_eval_ticks is None else {}
        rows[name] = {"exploration_overload_rate": res["exploration_overload_rate"],
                      "exploration_breach_rate": res["exploration_breach_rate"],
                      "exploration_breach_rate_after_warmup": res.get("exploration_breach_rate_after_warmup"),
                      "eval_reward": res["eval_reward"],
                      "cost_saving_vs_best_rule": judged.get("cost_saving_vs_best_rule"),
                      "oracle_gap_closed": judged.get("oracle_gap_closed"), "stopped_by": res.get("stopped_by"),
                      "slo_violation_rate": res["slo_violation_rate"], "hpa_eval_reward": res["hpa_eval_reward"],
                      "updates": res["updates"], "env_steps": res["env_steps"], "pairs": p.get("pairs"),
                      "heldout_pairs": p.get("heldout_pairs"), "heldout_pair_accuracy": p.get("heldout_pair_accuracy"),
                      "heldout_pair_accuracy_noise_free": p.get("heldout_pair_accuracy_noise_free"),
                      "heldout_label_ceiling": p.get("heldout_label_ceiling"),
                      **{k: p.get(k) for k in ("eval_pair_accuracy", "eval_pair_accuracy_noise_free",
                                               "eval_label_ceiling", "eval_pairs")}, **ref}
    v2 = base.sim.platform == "v2"
    # The exploration risk the steer is judged on. v1: shard-ticks above the utilisation
    # threshold. v2 sizes every class pool with the queueing model, so utilisation stays
    # under it (5e-5 of the explorer's shard-ticks, docs/learning_v2.md section 6) and the
    # overload that reaches users is the SLO breach: the share of settled class-windows
    # whose p99 broke its SLO, what the yardstick counts.
    risk, floor_key, greedy_key, final_key = (
        ("exploration_breach_rate", "cautious_constant_breach_rate", "greedy_breach_rate", "final_explorer_breach_rate")
        if v2 else ("exploration_overload_rate", "cautious_constant_overload_rate", "greedy_overload_rate",
                    "final_explorer_overload_rate"))
    measure = "broken SLO windows" if v2 else "overload ticks"
    print(f"\n{'variant':<14}{'overload':>10}{'breaches':>10}{'greedy only':>13}{'eval reward':>13}{'SLO viol':>10}"
          f"{'pairs':>7}{'held-out acc':>14}")
    for name, r in rows.items():
        acc = r["heldout_pair_accuracy"]
        print(f"{name:<14}{r['exploration_overload_rate']:>10.4f}{r['exploration_breach_rate']:>10.4f}"
              f"{r[greedy_key]:>13.4f}{r['eval_reward']:>13.4f}{r['slo_violation_rate']:>10.4f}"
              f"{r['pairs'] or 0:>7}{'' if acc is None else f'{acc:.3f}':>14}")
    first = next(iter(rows.values()))
    print(f"most cautious constant action (top capacity tier; v2: longest hold, admit all; v1: fastest servers): "
          f"overload {first['cautious_constant_overload_rate']:.4f}, broken windows "
          f"{first['cautious_constant_breach_rate']:.4f}, reward {first['cautious_constant_reward']:.4f}")
    for name, r in rows.items():
        print(f"{name}: the final network alone {r[greedy_key]:.4f} {measure}, with the epsilon ladder (unsteered) "
              f"{r[final_key]:.4f}; over the run's exploration {r[risk]:.4f}")
    out = {"updates_per_run": updates, "variants": rows,
           "overload_measure": ("share of settled class-windows whose SLO broke" if v2 else
                                f"share of shard-ticks above utilisation {base.pref.overload_utilisation}")}
    if "without" in rows and "with" in rows:
        w, wo = rows["with"], rows["without"]
        out.update(violations_without=wo["exploration_overload_rate"], violations_with=w["exploration_overload_rate"],
                   breaches_without=wo["exploration_breach_rate"], breaches_with=w["exploration_breach_rate"],
                   eval_reward_without=wo["eval_reward"], eval_reward_with=w["eval_reward"],
                   heldout_pair_accuracy=w["heldout_pair_accuracy"],
                   heldout_pair_accuracy_noise_free=w["heldout_pair_accuracy_noise_free"],
                   heldout_label_ceiling=w["heldout_label_ceiling"],
                   eval_pair_accuracy=w["eval_pair_accuracy"],
                   eval_pair_accuracy_noise_free=w["eval_pair_accuracy_noise_free"],
                   eval_label_ceiling=w["eval_label_ceiling"], eval_pairs=w["eval_pairs"],
                   greedy_overload_without=wo["greedy_overload_rate"],
                   greedy_breaches_without=wo["greedy_breach_rate"],
                   cautious_constant_overload=wo["cautious_constant_overload_rate"],
                   cautious_constant_breaches=wo["cautious_constant_breach_rate"],
                   overload_floor=wo[floor_key],
                   cost_saving_without=wo["cost_saving_vs_best_rule"], cost_saving_with=w["cost_saving_vs_best_rule"])
        floor = wo[floor_key]
        avoidable = wo[risk] - floor
        # What exploration's own draws add at the end of the run, as a share of the avoidable:
        # the part a steer on exploratory draws alone can take away (the rest is the
        # behaviour policy's greedy choices over the run).
        out["final_explorer_without"] = wo[final_key]
        out["exploration_draws_share"] = ((wo[final_key] - wo[greedy_key]) / avoidable if avoidable > 0
                                          else float("nan"))
        out["avoidable_overload_removed"] = (wo[risk] - w[risk]) / avoidable if avoidable > 0 else float("nan")
        # The same after pref.warmup_updates, the stretch where the steer acts (before it both
        # runs explore unsteered): v2's broken windows only.
        a_wo, a_w = wo["exploration_breach_rate_after_warmup"], w["exploration_breach_rate_after_warmup"]
        if v2 and a_wo is not None and a_w is not None:
            out.update(breaches_after_warmup_without=a_wo, breaches_after_warmup_with=a_w,
                       avoidable_overload_removed_after_warmup=(a_wo - a_w) / (a_wo - floor)
                       if a_wo > floor else float("nan"))
        cs_wo, cs_w = wo["cost_saving_vs_best_rule"], w["cost_saving_vs_best_rule"]
        out["cost_saving_lost"] = (cs_wo - cs_w) / abs(cs_wo) if cs_wo and cs_w is not None else float("nan")
        drop = 1 - w[risk] / max(wo[risk], 1e-12)
        loss = 1 - w["eval_reward"] / wo["eval_reward"] if wo["eval_reward"] > 0 else float("nan")
        acc = w["heldout_pair_accuracy"]
        acc = float("nan") if acc is None else acc
        print(f"\n{measure} during exploration {-drop:+.0%}; eval reward {-loss:+.1%}; "
              f"held-out pair accuracy {acc:.3f} against the labels given, "
              f"{w['heldout_pair_accuracy_noise_free'] or float('nan'):.3f} against the oracle's rule without its "
              f"random answers (target >= 0.90); a perfect ranker would score "
              f"{w['heldout_label_ceiling'] or float('nan'):.3f} against the labels given")
        nan = float("nan")
        ev = w["eval_pair_accuracy"]
        ev = nan if ev is None else ev
        ev_nf = w["eval_pair_accuracy_noise_free"]
        print(f"{w['eval_pairs'] or 0} random held-out pairs (fresh segments, labelled for the measurement only): "
              f"accuracy {ev:.3f} against the labels given, "
              f"{ev_nf if ev_nf is not None else nan:.3f} against the oracle's rule (target >= 0.90: "
              f"{'met' if ev_nf is not None and ev_nf >= 0.9 else 'NOT met'}); a perfect ranker would score "
              f"{w['eval_label_ceiling'] if w['eval_label_ceiling'] is not None else nan:.3f} against the labels given")
        rem, lost = out["avoidable_overload_removed"], out["cost_saving_lost"]
        print(f"avoidable {measure} (the unsteered explorer's {wo[risk]:.4f} above the floor {floor:.4f}) removed: "
              f"{rem:.0%} (target >= 50 %: {'met' if rem >= 0.5 else 'NOT met'}); the yardstick's cost saving "
              f"{cell_pct(cs_wo)} without, {cell_pct(cs_w)} with: {lost:+.1%} of it lost "
              f"(target <= 5 %: {'met' if lost <= 0.05 else 'NOT met'})")
        if "avoidable_overload_removed_after_warmup" in out:
            print(f"after the first {base.pref.warmup_updates:,} updates (the steer acts): broken windows "
                  f"{out['breaches_after_warmup_without']:.4f} without, {out['breaches_after_warmup_with']:.4f} with; "
                  f"avoidable removed {out['avoidable_overload_removed_after_warmup']:.0%}")
        print(f"{measure} of the 'without' run's greedy policy alone (no exploration): {wo[greedy_key]:.4f}; of the "
              f"most cautious constant action: {floor:.4f} (what steering can take away lies above these)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["sim", "replay", "apex", "route", "preference", "preference-fit", "serve",
                                     "feedback-log", "serve-abuse", "scaler"],
                    help="which benchmark")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds per timed run")
    ap.add_argument("--capacity", type=int, default=1_000_000, help="replay: capacity")
    ap.add_argument("--batch", type=int, default=512, help="replay: sample / update batch")
    ap.add_argument("--chunk", type=int, default=4096, help="replay: insert chunk")
    ap.add_argument("--no-peers", action="store_true", help="replay: skip cpprb and TorchRL (apex: skip RLlib)")
    ap.add_argument("--actors", default="1,2,4,8", help="apex: actor counts")
    ap.add_argument("--shards-per-actor", type=int, default=16, help="apex: simulated shards per actor")
    ap.add_argument("--plot", help="apex: PNG of the scaling curve")
    ap.add_argument("--updates", type=int, default=6000, help="preference: learner updates per run")
    ap.add_argument("--minutes", type=float, default=30.0, help="preference: wall-clock cap per run")
    ap.add_argument("--variants", default="without,with",
                    help=f"preference: runs to compare ({', '.join(PREFERENCE_VARIANTS)})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="preference: extra config overrides for the runs with preferences")
    ap.add_argument("--log", help="preference-fit: the feedback log (with held-out pairs) to fit")
    ap.add_argument("--checkpoint", help="preference-fit: start from this checkpoint's encoders; scaler: the policy "
                                         "(default runs/train/checkpoint.pt if present)")
    ap.add_argument("--steps", type=int, default=1800, help="preference-fit: preference-only learner steps")
    ap.add_argument("--dense", type=int, default=0,
                    help="preference-fit: train on this many rule-labelled random pairs of the training segments")
    ap.add_argument("--keep", help="preference: keep each run's feedback log and final checkpoint in this folder")
    ap.add_argument("--requests", type=int, default=1000,
                    help="serve: requests per 1-shard cell (256 shards: /4); feedback-log: pairs x 4; "
                         "scaler: decisions (default 200)")
    ap.add_argument("--folder", help="feedback-log: write in this folder (default: the temp folder)")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.seconds <= 0:
        ap.error("--repeats must be >= 1 and --seconds > 0")
    if a.what == "sim":
        res = bench_sim(a.repeats, a.seconds)
    elif a.what == "route":
        import ray

        from apex_bdq.config import ClusterConfig
        from apex_bdq.ray_runner import local_ray_init
        local_ray_init(ClusterConfig(), None, include_dashboard=False, log_to_driver=False)
        try:
            res = _route_ms(a.batch, repeats=200)
        finally:
            ray.shutdown()
        print(f"sample {a.batch} + update priorities, one replay shard actor (100,000 transitions):\n"
              f"  attached in place (shared memory): {res['shared_memory_ms']:.3f} ms\n"
              f"  shard RPC through the object store: {res['object_store_ms']:.3f} ms "
              f"({res['object_store_over_shared']:.1f}x)")
    elif a.what == "scaler":
        from launch.bench_scaler import bench_scaler, print_scaler
        res = bench_scaler(decisions=a.requests if a.requests != 1000 else 200, checkpoint=a.checkpoint)
        print_scaler(res)
    elif a.what == "serve-abuse":
        from launch.bench_serve import bench_serve_abuse
        res = bench_serve_abuse(seconds=max(a.seconds, 5.0))
    elif a.what == "feedback-log":
        from launch.bench_feedback_log import bench_feedback_log
        res = bench_feedback_log(pairs=a.requests // 4, repeats=a.repeats, folder=a.folder)
    elif a.what == "serve":
        from launch.bench_serve import bench_serve
        res = bench_serve(a.requests)
    elif a.what == "preference":
        res = bench_preference(a.updates, [v.strip() for v in a.variants.split(",") if v.strip()], a.set,
                               keep=a.keep, minutes=a.minutes)
    elif a.what == "preference-fit":
        if not a.log:
            ap.error("preference-fit needs --log")
        if a.steps < 1 or a.dense < 0:
            ap.error("--steps must be >= 1 and --dense >= 0")
        from launch.bench_preference_fit import bench_preference_fit
        res = bench_preference_fit(a.log, a.checkpoint, steps=a.steps, dense=a.dense)
    elif a.what == "apex":
        res = bench_apex([int(x) for x in a.actors.split(",")], max(a.seconds, 10.0), a.shards_per_actor,
                         not a.no_peers, a.plot)
    else:
        res = bench_replay(a.repeats, a.seconds, a.capacity, a.batch, a.chunk, not a.no_peers)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2, default=str))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
