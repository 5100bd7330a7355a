"""Check and time the GPU paths in a few minutes (run where a GPU is lent).

    python -m launch.gpu_check [--json PATH] [--capacity 1000000]

1. device-resident replay: insert rate, sample 512 + update 512 steps/s at full capacity
   (the same settings as `launch.bench replay`), with the sum tree on the GPU;
2. the in-place route: a second process attaches to the replay through CUDA IPC handles and
   samples and updates priorities; the owner sees its updates;
3. the learner step (forward, double-Q target, backward, Adam) of the default network at
   batch 256 and 512, and the greedy forward pass for 1 and 256 observations;
4. a short DDP smoke under Ray Train with use_gpu (skipped with --no-ray).
Without CUDA it says so and exits 0 (nothing is faked).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def _fields():
    from launch.bench import _replay_fields
    return _replay_fields()


def _chunk(fields, m: int, device: str) -> dict:
    from launch.bench import _chunk as host_chunk
    return {k: v.to(device) for k, v in host_chunk(fields, m, seed=0).items()}


def check_replay(capacity: int) -> dict:
    from replay_server.replay import PrioritizedReplay
    fields = _fields()
    rb = PrioritizedReplay(capacity, fields, device="cuda", seed=0)
    chunk = _chunk(fields, 4096, "cuda")
    pr = torch.rand(4096, device="cuda")
    t = _timed(lambda: rb.add(chunk, pr), max(1, capacity // 4096 + 1))
    ins = 4096 / statistics.median(t)

    def step():
        s = rb.sample(512)
        rb.update_priorities(s.indices, s.generations, s.weights.double())
    for _ in range(20):
        step()
    st = _timed(step, 300)
    return {"replay_insert_per_s": ins, "replay_steps_per_s": 1.0 / statistics.median(st),
            "replay_step_p99_ms": sorted(st)[int(0.99 * len(st)) - 1] * 1e3, "replay_size": rb.size,
            "gpu_memory_mb": torch.cuda.max_memory_allocated() / 2 ** 20}


def _ipc_child(spec, q) -> None:
    try:
        from replay_server.replay import PrioritizedReplay
        rb = PrioritizedReplay.attach(spec, 10_000, _fields(), seed=1)
        s = rb.sample(512)
        t0 = time.perf_counter()
        for _ in range(100):
            s = rb.sample(512)
            rb.update_priorities(s.indices, s.generations, torch.full((512,), 1e6, device="cuda",
                                                                      dtype=torch.float64))
        torch.cuda.synchronize()
        q.put({"attached_steps_per_s": 100 / (time.perf_counter() - t0), "attached_size": rb.size})
    except Exception as e:
        q.put({"error": repr(e)})


def check_ipc() -> dict:
    from replay_server.replay import PrioritizedReplay
    from replay_server.shared import SharedArena
    arena = SharedArena.create("cuda", tag="gpucheck")
    rb = PrioritizedReplay(10_000, _fields(), shared=arena, seed=0)
    rb.add(_chunk(_fields(), 8192, "cuda"), torch.ones(8192, device="cuda"))
    before = float(rb.tree.total)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(rb.shared_spec(), q))
    p.start()
    out = q.get(timeout=300)
    p.join(60)
    out["owner_sees_updates"] = float(rb.tree.total) > before * 10
    arena.unlink()
    return out


def check_learner() -> dict:
    from apex_bdq.presets import PRESETS
    from apex_bdq.messages import SampledBatch
    from learner.learner import Learner
    cfg = PRESETS["default"]
    out = {}
    for b in (256, 512):
        ln = Learner(cfg.net, cfg.agent, device="cuda")
        batch = SampledBatch(indices=None, generations=None, weights=torch.ones(b, device="cuda"),
                             **_chunk(_fields(), b, "cuda"))
        for _ in range(10):
            ln.step(batch)
        t = _timed(lambda: ln.step(batch), 200)
        out[f"learner_updates_per_s_b{b}"] = 1.0 / statistics.median(t)
    net = ln.net.eval()
    for n in (1, 256):
        d = _chunk(_fields(), n, "cuda")
        with torch.no_grad():
            t = _timed(lambda: net(d["macro"], d["micro"]).argmax(-1).cpu(), 300)
        out[f"forward_p50_ms_{n}"] = statistics.median(t) * 1e3
        out[f"forward_p99_ms_{n}"] = sorted(t)[int(0.99 * len(t)) - 1] * 1e3
    return out


def check_ray_ddp(tmp: str) -> dict:
    import dataclasses

    from apex_bdq.config import ClusterConfig
    from apex_bdq.ray_runner import ApexRun, local_ray_init
    from apex_bdq.presets import PRESETS
    spec = ClusterConfig(num_actors=2, num_replay_shards=1, num_learners=1, use_gpu=True, replay_gpus=0.25,
                       storage_path=tmp, checkpoint_every_s=1e9, max_restarts=0)  # fail fast: device time is scarce
    local_ray_init(spec, None, include_dashboard=False, log_to_driver=False, num_gpus=1)
    cfg = dataclasses.replace(PRESETS["smoke"], minutes=0.3)
    run = ApexRun(cfg, spec)
    try:
        out = run.run(minutes=0.3)
    finally:
        run.shutdown()
    lr = out["status"]["learner"]
    return {"ray_updates": lr.get("updates"), "ray_route": lr.get("route"),
            "ray_shard_device": out["status"]["shards"][0]["device"], "ray_wait_share": lr.get("learner_wait_share")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--no-ray", action="store_true")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU paths are covered by the tests)")
        return 0
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, fn in (("replay", lambda: check_replay(a.capacity)), ("ipc", check_ipc), ("learner", check_learner),
                     ("ray", lambda: check_ray_ddp("/tmp/apex_bdq_gpu_check"))):
        if name == "ray" and a.no_ray:
            continue
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:  # report and go on: one broken path must not hide the others
            r = {f"{name}_error": repr(e)}
        r[f"{name}_check_s"] = time.perf_counter() - t0
        res.update(r)
        print(json.dumps(r, default=str), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
