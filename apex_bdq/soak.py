"""The fault-injection soak: a distributed run (apex_bdq/ray_runner.py) under random,
bounded kills, with feedback submitted throughout and memory sampled (`python -m
launch.soak` is its entry point; the module docstring there says what it reports).
"""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile
import threading
import time
from typing import Optional

import numpy as np

TARGETS = ("rollout", "replay", "preference", "learner")


@dataclasses.dataclass
class SoakOptions:
    minutes: float = 10.0
    kill_every_s: float = 30.0  # mean gap between kills (exponential, at least min_gap_s)
    min_gap_s: float = 5.0
    max_kills: Optional[int] = None  # once this many are made and recovered from, the run ends early
    targets: tuple = TARGETS
    num_actors: int = 2
    num_replay_shards: int = 2
    replay_capacity: int = 4_000
    checkpoint_every_s: float = 10.0
    snapshot_every_s: float = 10.0
    replay_on_restart: str = "snapshot"
    feedback_every_s: float = 1.0
    recovery_timeout_s: float = 180.0
    seed: int = 0
    workdir: Optional[str] = None
    address: Optional[str] = None

    def __post_init__(self) -> None:
        from apex_bdq.config import ConfigError
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ConfigError(f"soak targets must be among {', '.join(TARGETS)}, got {list(self.targets)}")
        if self.minutes <= 0 or self.kill_every_s <= 0:
            raise ConfigError(f"minutes and kill-every must be > 0, got {self.minutes} and {self.kill_every_s}")


def soak_config(o: SoakOptions):
    from apex_bdq.config import apply_overrides
    from apex_bdq.presets import PRESETS
    cfg = apply_overrides(PRESETS["smoke"], [
        f"agent.replay_capacity={o.replay_capacity}", "pref.enabled=true", "pref.segment_decisions=4",
        "pref.min_pairs=4", "pref.batch_pairs=4", "pref.oracle_pairs=400", f"seed={o.seed}"])
    return dataclasses.replace(cfg, max_env_ticks=None, minutes=o.minutes,
                               pref=dataclasses.replace(cfg.pref, log_path=os.path.join(o.workdir, "feedback.log")))


def _random_segment(rng: np.random.Generator, net, sid: str):
    from apex_bdq.preference import Segment
    n = 4
    return Segment(id=sid, macro=rng.normal(size=(n, net.macro_features)).astype(np.float32),
                   micro=rng.normal(size=(n, net.num_classes, net.history, net.micro_features)).astype(np.float32),
                   action=rng.integers(0, net.sub_actions, size=(n, net.num_branches)),
                   metrics={"overload": float(rng.random()), "unfairness": 0.0, "slo_violation": 0.0},
                   series={"load": np.ones(8, np.float32), "capacity": np.ones(8, np.float32),
                           "p99_ms": np.ones(8, np.float32)})


def _kill_pid(node_id: str, pid: int) -> None:
    """SIGKILL a process on the node it runs on (a one-off task placed there)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def kill(p: int) -> None:
        import signal
        os.kill(p, signal.SIGKILL)

    ray.get(kill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid),
            timeout=60)


class Soak:
    def __init__(self, o: SoakOptions) -> None:
        self.o = o
        self.rng = random.Random(o.seed)
        self.kills: list[dict] = []
        self.accepted: set = set()
        self.feedback_errors = 0
        self.rss: dict = {}  # (role, pid) -> [(t, rss_mb)]
        self.capacity_t: Optional[float] = None
        self.stop = threading.Event()
        self.t0 = time.time()
        self.run = None
        self.last_status: dict = {}

    # -- probes ------------------------------------------------------------------------------
    def _pid_of(self, target: str, index: int) -> tuple[Optional[int], Optional[str]]:
        import ray
        r = self.run
        try:
            if target == "rollout":
                x = ray.get(r.actors[index].stats.remote(), timeout=10)
            elif target == "replay":
                x = ray.get(r.shards[index].stats.remote(), timeout=10)
            elif target == "preference":
                return ray.get(r.pref.stats.remote(), timeout=10).pid, None
            else:
                x = ray.get(r.store.status.remote(), timeout=10).learner
            return (x.pid, x.node_id) if x is not None else (None, None)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None, None

    def _recovered(self, target: str, index: int, old_pid: int, before: dict) -> bool:
        """The component answers from a new process and does its job again."""
        import ray
        r = self.run
        pid, _ = self._pid_of(target, index)
        if pid is None or pid == old_pid:
            return False
        try:
            if target == "rollout":
                return ray.get(r.actors[index].stats.remote(), timeout=10).transitions_sent > 0
            if target == "replay":  # inserts land in the new process (which came back from its snapshot, if any)
                x = ray.get(r.shards[index].stats.remote(), timeout=10)
                first = before.setdefault("first_inserted", x.inserted)
                before["restored_size"] = x.restored_size
                return x.inserted > first
            if target == "preference":  # it replayed its log: every pair accepted so far is there
                keys = set(map(tuple, ray.get(r.pref.pair_keys.remote(), timeout=30)))
                return before["accepted"] <= keys
            lr = ray.get(r.store.status.remote(), timeout=10).learner  # the new group trains
            return lr is not None and lr.start_id != before.get("start_id") and \
                lr.updates > (lr.restored_from_updates or 0)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    # -- threads ------------------------------------------------------------------------------
    def _chaos(self) -> None:
        import ray
        o, r = self.o, self.run
        order: list[str] = []
        budget_end = self.t0 + o.minutes * 60.0 - 20.0  # leave time to see the last recovery
        while not self.stop.wait(0.5):  # kills start once the learner trains (replay filled, a snapshot taken)
            if (self.last_status.get("learner") or {}).get("updates", 0) > 0:
                break
        while not self.stop.is_set():
            gap = max(o.min_gap_s, self.rng.expovariate(1.0 / o.kill_every_s))
            if self.stop.wait(gap) or time.time() + gap > budget_end:
                break
            if o.max_kills is not None and len(self.kills) >= o.max_kills:
                # All kills made and waited for: train on a little, then end the run early.
                if not self.stop.wait(o.min_gap_s):
                    ray.get(r.store.set_stop.remote(True), timeout=30)
                break
            if not order:  # every target once per round, in a random order
                order = list(o.targets)
                self.rng.shuffle(order)
            target = order.pop()
            n = {"rollout": len(r.actors), "replay": len(r.shards), "preference": 1, "learner": 1}[target]
            index = self.rng.randrange(n)
            pid, node = self._pid_of(target, index)
            if pid is None:  # not up yet (the learner reports its process once it trains): later
                order.insert(0, target)
                continue
            before: dict = {}
            if target == "preference":
                before["accepted"] = set(self.accepted)
            if target == "learner":
                lr = ray.get(r.store.status.remote()).learner
                before["start_id"] = lr.start_id if lr is not None else None
            lr = ray.get(r.store.status.remote(), timeout=10).learner
            upd0 = lr.updates if lr is not None else 0
            t_kill = time.time()
            if target == "rollout":
                ray.kill(r.actors[index], no_restart=False)
            elif target == "replay":
                ray.kill(r.shards[index], no_restart=False)
            elif target == "preference":
                ray.kill(r.pref, no_restart=False)
            else:
                _kill_pid(node, pid)
            k = {"target": target, "index": index, "pid": pid, "t_s": t_kill - self.t0, "recovered": False}
            self.kills.append(k)
            while time.time() - t_kill < o.recovery_timeout_s and not self.stop.is_set():
                if self._recovered(target, index, pid, before):
                    k.update(recovered=True, recovery_s=time.time() - t_kill)
                    if "restored_size" in before:
                        k["restored_size"] = before["restored_size"]
                    if target != "learner":  # did the learner go on meanwhile?
                        lr = ray.get(r.store.status.remote(), timeout=10).learner
                        k["learner_updates_during"] = (lr.updates if lr is not None else 0) - int(upd0)
                    break
                time.sleep(0.5)
            print(f"[soak {time.time() - self.t0:6.0f} s] killed {target} {index} (pid {pid}): "
                  + (f"recovered in {k['recovery_s']:.1f} s" if k["recovered"] else "NOT recovered"), flush=True)

    def _feedback(self) -> None:
        import ray
        net = self.run.cfg.net
        rng = np.random.default_rng(self.o.seed + 1)
        i = 0
        while not self.stop.wait(self.o.feedback_every_s):
            a, b = _random_segment(rng, net, f"soak-{i}-a"), _random_segment(rng, net, f"soak-{i}-b")
            i += 1
            try:
                got = ray.get(self.run.pref.rank_many.remote([{"a": a.id, "b": b.id, "label": 1.0}], [a, b],
                                                             source="soak"), timeout=30)
                if got[0] in ("accepted", "duplicate"):
                    self.accepted.add((a.id, b.id) if a.id < b.id else (b.id, a.id))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self.feedback_errors += 1  # not acknowledged: the sender would retry; not counted accepted

    def _memory(self) -> None:
        import psutil
        while not self.stop.wait(2.0):
            st = self.last_status
            procs = [("rollout", x.get("pid")) for x in st.get("actors", [])]
            procs += [("replay", x.get("pid")) for x in st.get("shards", [])]
            procs += [("preference", (st.get("preference") or {}).get("pid")),
                      ("learner", (st.get("learner") or {}).get("pid")), ("driver", os.getpid())]
            t = time.time() - self.t0
            for role, pid in procs:
                if not pid:
                    continue
                try:
                    rss = psutil.Process(pid).memory_info().rss / 2**20
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                self.rss.setdefault((role, pid), []).append((t, rss))

    def _on_progress(self, st: dict) -> None:
        if "env_steps" not in st:
            return
        self.last_status = st
        cap = sum(x["capacity"] for x in st.get("shards", []))
        if self.capacity_t is None and cap and st["replay_size"] >= cap and len(st["shards"]) == len(self.run.shards):
            self.capacity_t = time.time() - self.t0

    # -- the run ------------------------------------------------------------------------------
    def execute(self) -> dict:
        import ray
        from apex_bdq.config import ClusterConfig
        from apex_bdq.ray_runner import ApexRun, local_ray_init
        o = self.o
        cfg = soak_config(o)
        spec = ClusterConfig(num_actors=o.num_actors, num_replay_shards=o.num_replay_shards, num_learners=1,
                           max_restarts=100, checkpoint_every_s=o.checkpoint_every_s,
                           storage_path=os.path.join(o.workdir, "ray_train"),
                           checkpoint_path=os.path.join(o.workdir, "checkpoint.pt"),
                           replay_snapshot_dir=os.path.join(o.workdir, "replay"),
                           replay_snapshot_every_s=o.snapshot_every_s, replay_on_restart=o.replay_on_restart,
                           publish_every=10)
        local_ray_init(spec, o.address, log_to_driver=False)
        self.run = run = ApexRun(cfg, spec)
        box: dict = {}

        def go() -> None:
            try:
                box["out"] = run.run(minutes=o.minutes, on_progress=self._on_progress)
            except BaseException as e:
                box["error"] = e

        th = threading.Thread(target=go, name="soak-run", daemon=True)
        self.t0 = time.time()
        th.start()
        while not hasattr(run, "actor_runs") and th.is_alive():  # start() has made the components
            time.sleep(0.2)
        workers = [threading.Thread(target=f, daemon=True) for f in (self._chaos, self._feedback, self._memory)]
        for w in workers:
            w.start()
        th.join()
        self.stop.set()
        for w in workers:
            w.join(timeout=o.recovery_timeout_s + 30)
        try:
            if "error" in box:
                raise box["error"]
            present = set(map(tuple, ray.get(run.pref.pair_keys.remote(), timeout=60)))
            from apex_bdq.preference import load_log
            _, _, logged = load_log(cfg.pref.log_path)
            in_log = {p.key() for p in logged}
            st = box["out"]["status"]
        finally:
            run.shutdown()
        lost = self.accepted - (present & in_log)
        return self.report(st, len(lost))

    def report(self, st: dict, feedback_lost: int) -> dict:
        start = self.capacity_t
        growth, peaks = 0.0, {}
        for (role, pid), series in self.rss.items():
            peaks[role] = max(peaks.get(role, 0.0), max(v for _, v in series))
            steady = [(t, v) for t, v in series if start is None or t >= start]
            if len(steady) >= 6:  # growth within one process once replay is full: first third vs last third
                k = len(steady) // 3
                growth = max(growth, max(v for _, v in steady[-k:]) - max(v for _, v in steady[:k]))
        by_target = {t: sum(k["target"] == t for k in self.kills) for t in TARGETS}
        rec = [k["recovery_s"] for k in self.kills if k["recovered"]]
        lr = st.get("learner") or {}
        actors = st.get("actors", [])
        return {"kills": len(self.kills), "recovered": sum(k["recovered"] for k in self.kills),
                "feedback_lost": feedback_lost, "max_rss_growth_mb": round(growth, 1),
                "kills_by_target": by_target, "recovery_s_max": max(rec) if rec else None,
                "recovery_s_mean": float(np.mean(rec)) if rec else None,
                "feedback_accepted": len(self.accepted), "feedback_unacknowledged": self.feedback_errors,
                "updates": lr.get("updates", 0), "updates_lost": st.get("updates_lost", 0),
                "learner_restarts": (st.get("recoveries") or {}).get("learner", 0),
                "env_steps": st.get("env_steps", 0),
                "transitions_lost": sum(a.get("transitions_lost", 0) for a in actors),
                "replay_at_capacity_s": self.capacity_t, "peak_rss_mb": {k: round(v, 1) for k, v in peaks.items()},
                "rss_mb": [{"role": role, "pid": pid,  # memory per process over time, <= 60 points each
                            "samples": [[round(t, 1), round(v, 1)] for t, v in series[::max(1, len(series) // 60)]]}
                           for (role, pid), series in self.rss.items()],
                "minutes": self.o.minutes, "kill_log": self.kills}


def soak(o: SoakOptions) -> dict:
    own = o.workdir is None
    if own:
        o = dataclasses.replace(o, workdir=tempfile.mkdtemp(prefix="apex_bdq_soak_"))
    os.makedirs(o.workdir, exist_ok=True)
    return Soak(o).execute()
