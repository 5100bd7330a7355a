"""The Ape-X driver: replay shards, rollout actors, a weight store and a Ray Train learner
group on a Ray cluster (local by default, `address="auto"` for an existing one).

    driver ── creates ──> WeightStore (0 CPU)
            ├─────────> ReplayShard x R   (shared-memory / CUDA-IPC replay + rate limiter)
            ├─────────> RolloutActor x M  (S shards each, eps ladder, n-step, priorities)
            └─ TorchTrainer(train_loop_per_worker) x L learners (ddp | deepspeed | accelerate)
    actors --TransitionBatch (<= max_in_flight)--> shards <==shared memory==> learner (same node)
    learner rank 0 --versioned weights--> WeightStore --get_if_newer--> actors

Placement follows resources: rollout actors ask for `rollout` units, learners and replay
shards for `learner` units, which `cluster.yaml` puts on the rollout and learner node types
(and a local run declares on the one node), so the learner and its replay shards share a
node and its memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from apex_bdq.checkpoint import CheckpointError, load_checkpoint
from apex_bdq.config import ClusterConfig, TrainConfig
from apex_bdq.driver import Driver, Progress
from apex_bdq.durable import atomic_write
from apex_bdq.system import make_components
from apex_bdq.messages import ActorStats, StoreMeta, StoreStatus

_CARRIED = ("env_steps", "overload_ticks", "breached_windows", "settled_windows")
"""A rollout actor's counters that survive its restarts (added over its incarnations); env_steps first."""
_NONE_CARRIED = (0,) * len(_CARRIED)

ROLLOUT_RESOURCE = "rollout"
LEARNER_RESOURCE = "learner"


def local_ray_init(spec: ClusterConfig, address: Optional[str] = None, **kwargs) -> None:
    """Connect to `address`, or start a local cluster big enough (logical CPUs) for the
    components on this machine, declaring the placement resources on its one node."""
    import ray
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, **kwargs)
        return
    need = spec.num_actors * spec.actor_cpus + spec.num_learners * spec.learner_cpus + \
        spec.num_replay_shards * spec.replay_cpus + 1
    cpus = max(os.cpu_count() or 1, math.ceil(need))
    res = {ROLLOUT_RESOURCE: float(spec.num_actors) * 4, LEARNER_RESOURCE: float(spec.num_learners) * 4}
    ray.init(address="local", num_cpus=cpus, resources=res, **kwargs)


class ApexRun:
    """One distributed training run: the Ray runner of `apex_bdq.driver.Driver` (which owns
    evaluation, history, checkpoints, progress and the result); `run()` drives it."""

    def __init__(self, cfg: TrainConfig, spec: Optional[ClusterConfig] = None, resume: Optional[dict] = None,
                 heldout_every: int = 0) -> None:
        """spec: the cluster layout (default: cfg.cluster); the run's config records it, so
        its checkpoints say which cluster trained them."""
        spec = cfg.cluster if spec is None else spec
        self.cfg, self.spec, self.resume = dataclasses.replace(cfg, cluster=spec), spec, resume
        self.heldout_every = heldout_every
        # The counters of the checkpoint this run continues (its learning curve goes on in the driver).
        self.resumed: dict = dict((resume or {}).get("counters", {}))
        self.env_steps_base = self._last_env_steps = int(self.resumed.get("env_steps", 0))  # of the runs resumed
        self._driver_counters: Callable[[], dict] = dict
        # Supervision: restarted rollout actors get their loop back; their counters carry on.
        self.recoveries = {"rollout": 0, "replay": 0, "learner": 0, "preference": 0}
        self.dead_actors: set = set()
        self._actor_seen: dict = {}  # actor -> (pid, counters) last seen
        self._actor_offset: dict = {}  # actor -> counters of its dead incarnations
        self._shard_pids: dict = {}
        self._pref_pid = None
        self._last_copied = None  # the learner checkpoint last copied to spec.checkpoint_path
        self._restarts: dict = {}
        self._fit_thread: Optional[threading.Thread] = None  # Ray Train's fit(), once started
        self._failure: Optional[BaseException] = None  # what stopped the run early
        self.feedback_log = None
        self.run_name = f"apex_bdq_{int(time.time())}"
        self.multi_node = False

    def _check_storage(self) -> None:
        """On a multi-node cluster: checkpoints on shared storage and the feedback log on a
        shared filesystem, or a clear refusal (apex_bdq/cluster_storage.py)."""
        from apex_bdq.cluster_storage import check_storage, feedback_log_path, multi_node
        self.multi_node, why = multi_node()
        if not self.multi_node:
            return
        s = self.spec
        check_storage(s.storage_path, s.storage_is_shared, why)
        if self.cfg.pref.enabled:
            resumed = (self.resume or {}).get("counters", {}).get("feedback_log")
            log = feedback_log_path(self.cfg.pref.log_path or resumed, s.storage_path, s.storage_is_shared,
                                    self.run_name, why)
            self.cfg = dataclasses.replace(self.cfg, pref=dataclasses.replace(self.cfg.pref, log_path=log))

    # -- components ------------------------------------------------------------------------
    def _placement(self, kind: str) -> dict:
        import ray
        if not self.spec.use_placement_resources:
            return {}
        have = ray.cluster_resources()
        name = ROLLOUT_RESOURCE if kind == "rollout" else LEARNER_RESOURCE
        if name not in have:
            return {}  # a cluster without the node types of cluster.yaml: place by CPU only
        return {name: 0.001}

    def _build(self) -> None:
        import ray
        from actors.rollout_actor import remote_actor_class
        from learner.weight_store import remote_store_class
        from replay_server.replay_actor import remote_shard_class
        self._check_storage()
        s, parts = self.spec, make_components(self.cfg)
        # Weight store: versioned weights out to the actors (and Serve), the stop flag, the
        # learner's reports.
        self.store = self._weight_store(remote_store_class(max_restarts=s.max_restarts))
        # Replay shards on the learner nodes: the learner attaches to their memory in place.
        self.shard_cfg = parts.shard_config(s, resume=self.resume is not None)
        Shard = remote_shard_class(num_cpus=s.replay_cpus,
                                   num_gpus=s.replay_gpus if self.shard_cfg.device == "cuda" else 0.0,
                                   resources=self._placement("learner"), max_restarts=s.max_restarts)
        self.shards = [Shard.remote(i, self.shard_cfg) for i in range(s.num_replay_shards)]
        ray.get([sh.ready.remote() for sh in self.shards])
        self.specs = ray.get([sh.shared_spec.remote() for sh in self.shards])
        # Rollout actors on the rollout nodes, each with its share of the simulated shards.
        actor_cfg = parts.actor_config(s)
        Actor = remote_actor_class(num_cpus=s.actor_cpus, resources=self._placement("rollout"),
                                   max_restarts=s.max_restarts)
        # Preference actor (pref.enabled): segments from the actors, ranked pairs (oracle, the
        # feedback CLI, Serve) into its durable log, PreferenceBatches to the learners.
        self.pref = None
        if self.cfg.pref.enabled:
            from actors.preference_actor import NAMESPACE, PREFERENCE_ACTOR_NAME, remote_preference_class
            log = parts.feedback_log((self.resume or {}).get("counters", {}).get("feedback_log"), prefix="apex")
            self.feedback_log = log
            Pref = remote_preference_class(max_restarts=-1)  # it replays its log: restarting loses nothing
            self.pref = Pref.options(name=PREFERENCE_ACTOR_NAME, namespace=NAMESPACE, num_cpus=0,
                                     max_concurrency=1).remote(self.cfg.net, self.cfg.pref, log, self.cfg.seed,
                                                               self.heldout_every)
        self.actors = [Actor.remote(i, s.num_actors, actor_cfg, self.shards, self.store, s.max_in_flight,
                                    s.weight_pull_every, preference=self.pref) for i in range(s.num_actors)]
        # Actors act with the learner's weights from their first decision: the checkpoint's on a
        # resume, else the learner's initial ones (it seeds its network with cfg.seed), so the
        # replay never fills with the play of networks the learner does not have.
        if self.resume is not None:
            state = {k: t.detach().cpu().numpy().copy() for k, t in self.resume["learner"]["net"].items()}
            version = int(self.resume["learner"].get("version", self.resume["learner"].get("updates", 0)))
        else:
            state, version = parts.initial_weights(), 0
        ray.get(self.store.put.remote(version, state))
        self.actor_runs = [act.run.remote() for act in self.actors]

    def _weight_store(self, Store):
        """The weight store, registered by name so Serve can follow the run; a second run on
        the same cluster (the name taken) gets an unnamed one and says so."""
        from learner.weight_store import WEIGHT_STORE_NAME
        from actors.preference_actor import NAMESPACE
        from apex_bdq.guard import guard_for
        meta = StoreMeta(net=self.cfg.net, branches=tuple(self.cfg.sim.branch_names), guard=guard_for(self.cfg))
        try:  # creating under a taken name raises; no check-then-create race between two runs
            store = Store.options(name=WEIGHT_STORE_NAME, namespace=NAMESPACE).remote(meta)
            self.store_named = True
            return store
        except ValueError:
            pass
        print(f"note: a weight store {WEIGHT_STORE_NAME!r} already runs on this cluster (another run); this run's "
              f"store is unnamed, so `launch.serve --follow` follows the other run")
        self.store_named = False
        return Store.remote(meta)

    def _trainer(self, minutes: float, max_updates: Optional[int]):
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from apex_bdq.messages import LearnerLoopConfig
        from learner.train_loop import LOOP_KEY, train_loop_per_worker
        s = self.spec
        env = {"DS_ACCELERATOR": "cpu"} if not s.use_gpu else {}
        if os.environ.get("TORCH_EXTENSIONS_DIR"):
            env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
        per_worker = {"CPU": s.learner_cpus, **self._placement("learner")}
        storage = s.storage_path or os.path.join(tempfile.gettempdir(), "apex_bdq_train")
        self.storage = storage
        loop = LearnerLoopConfig(cfg=self.cfg, backend=s.backend, shards=self.shards, specs=self.specs,
                                 shard_cfg=self.shard_cfg, store=self.store, preference=self.pref, minutes=minutes,
                                 max_updates=max_updates, publish_every=s.publish_every,
                                 checkpoint_every_s=s.checkpoint_every_s, use_gpu=s.use_gpu, resume=self.resume,
                                 torch_threads=max(1, int(s.learner_cpus)))
        return TorchTrainer(train_loop_per_worker, train_loop_config={LOOP_KEY: loop},
                            scaling_config=ScalingConfig(num_workers=s.num_learners, use_gpu=s.use_gpu,
                                                         resources_per_worker=per_worker),
                            run_config=RunConfig(name=self.run_name, storage_path=storage,
                                                 failure_config=FailureConfig(max_failures=s.max_restarts),
                                                 checkpoint_config=CheckpointConfig(num_to_keep=2),
                                                 worker_runtime_env={"env_vars": env}))

    # -- monitoring --------------------------------------------------------------------------
    def status(self) -> dict:
        """The run's figures. A component that is dead or restarting is listed under
        `unavailable` instead of failing the call; counters of restarted rollout actors carry
        on from their previous incarnation."""
        from apex_bdq.ray_util import answers
        st, pref, *rest = answers([self.store.status.remote(),
                                   self.pref.stats.remote() if self.pref is not None else None] +
                                  [sh.stats.remote() for sh in self.shards] + [a.stats.remote() for a in self.actors],
                                  timeout_s=5.0)
        shards_all, actors_all = rest[:len(self.shards)], rest[len(self.shards):]
        st = st or StoreStatus(unavailable=True)
        for j, x in enumerate(shards_all):  # a shard answering from a new process was restarted
            if x is not None:
                if self._shard_pids.get(j) not in (None, x.pid):
                    self.recoveries["replay"] += 1
                self._shard_pids[j] = x.pid
        if pref is not None:
            if self._pref_pid not in (None, pref.pid):
                self.recoveries["preference"] += 1
            self._pref_pid = pref.pid
        for x in actors_all:
            if x is None:
                continue
            i = x.actor
            seen = self._actor_seen.get(i)
            if seen is not None and seen[0] != x.pid:  # a new incarnation: keep what the old one did
                off = self._actor_offset.get(i, _NONE_CARRIED)
                self._actor_offset[i] = tuple(a + b for a, b in zip(off, seen[1]))
            self._actor_seen[i] = (x.pid, tuple(getattr(x, k) for k in _CARRIED))
            for k, v in zip(_CARRIED, self._actor_offset.get(i, _NONE_CARRIED)):
                setattr(x, k, getattr(x, k) + v)
        shards = [x for x in shards_all if x is not None]
        actors = [x for x in actors_all if x is not None]
        self.recoveries["learner"] = int(st.learner_restarts)
        versions = [x.weight_version for x in actors]
        # Staleness of the acting weights in learner updates: the learner's newest update
        # (published or not) minus the oldest version an actor acts with.
        newest = max(st.version, st.learner.updates if st.learner is not None else -1)
        lag = max(0, newest - min(versions)) if versions and st.version >= 0 else 0
        self.store.record_driver_metrics.remote(lag, len(actors))
        # Env steps: live actors plus the last figure seen of any not answering right now.
        env = sum(x.env_steps for x in actors) + sum(
            self._actor_seen[i][1][0] + self._actor_offset.get(i, _NONE_CARRIED)[0] for i in self._actor_seen
            if i not in {x.actor for x in actors})
        # The driver's view, as plain values (progress lines, the result JSON).
        return {"version": st.version, "learner": st.learner.as_dict() if st.learner is not None else {},
                "weight_lag": lag, "preference": pref.as_dict() if pref is not None else None,
                "replay_size": sum(x.size for x in shards), "inserted": sum(x.inserted for x in shards),
                "sampled": sum(x.sampled for x in shards), "env_steps": self.env_steps_base + env,
                "actors": [x.as_dict() for x in actors], "shards": [x.as_dict() for x in shards],
                "recoveries": dict(self.recoveries), "updates_lost": int(st.updates_lost),
                "unavailable": {"actors": [i for i, x in enumerate(actors_all) if x is None],
                                "shards": [j for j, x in enumerate(shards_all) if x is None],
                                "preference": self.pref is not None and pref is None,
                                "weight_store": st.unavailable}}

    def _supervise(self) -> None:
        """Give a restarted rollout actor its loop back (Ray restarts the process, not the
        call that was running); one that is out of restarts is dropped, and the run stops
        with the reason when none is left. Any other actor failure stops the run."""
        import ray
        for i, ref in enumerate(self.actor_runs):
            if ref is None:
                continue
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            try:
                ray.get(ref)
                self.actor_runs[i] = None  # finished: the stop flag
            except ray.exceptions.RayError as e:
                limit = self.spec.max_restarts
                restarts = self._restarts.get(i, 0)
                if not isinstance(e, ray.exceptions.RayActorError) or limit == 0 or (limit > 0 and restarts >= limit):
                    self.actor_runs[i] = None
                    self.dead_actors.add(i)
                    if not isinstance(e, ray.exceptions.RayActorError):
                        raise RuntimeError(f"rollout actor {i} failed: {e}") from e
                    print(f"rollout actor {i} died and has no restarts left (--max-restarts {limit}): "
                          f"{type(e).__name__}: {str(e).splitlines()[0]}")
                    if len(self.dead_actors) == len(self.actors):
                        raise RuntimeError("every rollout actor died and none has restarts left "
                                           f"(--max-restarts {limit}); the learner has no more data") from e
                    continue
                self._restarts[i] = restarts + 1
                self.recoveries["rollout"] = sum(self._restarts.values())
                self.actor_runs[i] = self.actors[i].run.remote()  # queued until the actor is back

    def _copy_latest_checkpoint(self) -> None:
        """Copy the newest learner checkpoint to spec.checkpoint_path as it lands, with the
        driver's counters, so a crashed or cancelled run can be resumed from that path."""
        import glob
        from learner.train_loop import CHECKPOINT_NAME
        if not self.spec.checkpoint_path or "://" in getattr(self, "storage", "://"):
            return
        found = glob.glob(os.path.join(self.storage, self.run_name, "checkpoint_*", CHECKPOINT_NAME))
        if not found:
            return
        newest = max(found, key=os.path.getmtime)
        key = (newest, os.path.getmtime(newest))
        if key == self._last_copied:
            return
        try:
            ck = load_checkpoint(newest)  # a file still being written fails here: try again later
        except CheckpointError:
            return
        from apex_bdq.checkpoint import save_checkpoint
        save_checkpoint(self.spec.checkpoint_path, ck["config"], ck["learner"],
                        {**ck["counters"], **self.counters()})
        self._last_copied = key

    def counters(self) -> dict:
        """What a checkpoint carries besides the learner: env steps (as last seen), the
        driver's counters (learning curve), feedback log."""
        return {"history": list(self.resumed.get("history", [])), **self._driver_counters(),
                "env_steps": int(self._last_env_steps), "feedback_log": self.feedback_log}

    # -- the runner's side of the driver (apex_bdq/driver.py) -------------------------------
    def start(self, minutes: Optional[float] = None, max_updates: Optional[int] = None,
              counters: Optional[Callable[[], dict]] = None) -> None:
        """Build the components; with `minutes`, also start the Ray Train learner group (in
        a thread: `fit()` blocks) for that budget. counters: the driver's counters (the
        learning curve), written into every checkpoint copied to spec.checkpoint_path."""
        self._build()
        if minutes is None:
            return
        self._driver_counters = counters or dict
        trainer = self._trainer(minutes, max_updates)
        self._fit: dict = {}

        def fit() -> None:
            try:
                self._fit["result"] = trainer.fit()
            except BaseException as e:  # re-raised by stop(), in the driver's thread
                self._fit["error"] = e

        self._fit_thread = threading.Thread(target=fit, name="train-fit", daemon=True)
        self._fit_thread.start()

    def running(self) -> bool:
        return self._fit_thread is not None and self._fit_thread.is_alive() and self._failure is None

    def advance(self, deadline: float) -> Optional[Progress]:
        """One supervision poll: wait for the learner group until `deadline` (at most a
        poll), give restarted actors their loop back, read every component's figures and
        mirror the newest learner checkpoint. None when the figures cannot be read now."""
        import ray
        self._fit_thread.join(timeout=max(0.0, min(deadline - time.perf_counter(), 2.0)))
        try:
            self._supervise()
        except RuntimeError as e:  # no rollout actor left: stop the learner, report why in stop()
            self._failure = e
            self.store.set_stop.remote(True)  # the learner reads it too
            self._fit_thread.join(timeout=120)
            return None
        try:
            self._copy_latest_checkpoint()
        except OSError as e:
            print(f"note: copying the latest checkpoint to {self.spec.checkpoint_path} failed: {e}")
        try:
            st = self.status()
            self._last_env_steps = st["env_steps"]
        except ray.exceptions.RayError as e:
            print(f"note: the run's status could not be read this time: {type(e).__name__}")
            return None
        return self._progress(st)

    @staticmethod
    def _progress(st: dict) -> Progress:
        lr = st.get("learner") or {}
        return Progress(env_steps=st["env_steps"], updates=int(lr.get("updates", 0)), version=st["version"],
                        replay_size=st["replay_size"], td_loss=lr.get("td_loss", float("nan")),
                        weight_lag=st["weight_lag"], updates_per_s=lr.get("updates_per_s"), status=st)

    def policy(self):
        """The newest published weights (the weight store's) as a network, and their version
        (-1: none published yet)."""
        import ray
        from apex_bdq.networks import BDQNetwork
        from learner.weight_store import load_numpy_state
        got = ray.get(self.store.get_if_newer.remote(-1))
        net = BDQNetwork(self.cfg.net)
        if got is not None:
            load_numpy_state(net, ray.get(got.ref[0]))
        return net, (got.version if got else -1)

    def save(self, path: str, counters: dict) -> None:
        """The run's checkpoint file is the learner's, copied to spec.checkpoint_path as it
        lands; this adds the driver's counters to it. Nothing to do before this run has
        copied one (a file already there belongs to an earlier run: it keeps its own
        counters). A failure to write is reported, not fatal: the next save tries again."""
        if not path:
            return
        if os.path.abspath(path) != os.path.abspath(self.spec.checkpoint_path or ""):
            raise ValueError(f"the Ray runner writes its checkpoint to cluster.checkpoint_path "
                             f"({self.spec.checkpoint_path!r}), not {path!r}")
        if self._last_copied is None:
            return
        try:
            annotate_checkpoint(Path(path), {**self.counters(), **counters})
        except (OSError, CheckpointError) as e:
            print(f"note: writing the run's counters into {path} failed: {e}")

    def stop(self) -> dict:
        """Stop the actors, collect their figures and the learner group's result; raise what
        stopped the run early. Returns the runner's own result keys."""
        import ray
        if getattr(self, "store", None) is not None:
            self.store.set_stop.remote(True)
        for sh in getattr(self, "shards", []):  # no learner any more: let blocked inserts through
            sh.release.remote()
        actor_stats = []
        for i, ref in enumerate(getattr(self, "actor_runs", [])):
            if ref is None:
                continue
            try:
                actor_stats.append(ray.get(ref, timeout=120).as_dict())
            except ray.exceptions.RayError as e:
                actor_stats.append(ActorStats(actor=i, error=repr(e)).as_dict())
        if self._failure is not None:  # the learner was told to stop and given 120 s in advance()
            raise self._failure
        if self._fit_thread is None:  # start() failed before the learner group: nothing ran
            return {}
        self._fit_thread.join()
        if "error" in self._fit:
            raise self._fit["error"]
        result = self._fit["result"]
        st = self.status()
        self._last_env_steps = st["env_steps"]
        ck = None
        if self.spec.checkpoint_path and copy_checkpoint(result, self.spec.checkpoint_path) is not None:
            ck = self.spec.checkpoint_path
            self._last_copied = (ck, "final")
            annotate_checkpoint(Path(ck), self.counters())  # the final one
        lr = st.get("learner") or {}
        s = self.spec
        return {"progress": self._progress(st), "result": result, "actor_stats": actor_stats, "status": st,
                "learner_wait_share": lr.get("learner_wait_share"), "data_route": lr.get("route"),
                "weight_version": st["version"], "weight_lag": st["weight_lag"], "replay_size": st["replay_size"],
                "transitions_inserted": st["inserted"], "transitions_sampled": st["sampled"],
                "num_actors": s.num_actors, "num_replay_shards": s.num_replay_shards,
                "num_learners": s.num_learners, "backend": s.backend,
                "exploration_overload_rate": sum(x.get("overload_ticks", 0) for x in st["actors"]) /
                max(st["env_steps"], 1),
                "exploration_breach_rate": sum(x.get("breached_windows", 0) for x in st["actors"]) /
                max(sum(x.get("settled_windows", 0) for x in st["actors"]), 1),
                "preference": st.get("preference"), "checkpoint": ck}

    def run(self, minutes: Optional[float] = None, max_updates: Optional[int] = None,
            on_progress: Optional[Callable[[dict], None]] = None, evaluate=False, final_split: Optional[str] = None,
            progress: bool = False) -> dict:
        """Train with the driver (apex_bdq/driver.py); by default without evaluations, as
        benchmarks and tests run it."""
        return Driver(self.cfg, self, checkpoint=self.spec.checkpoint_path, progress=progress,
                      on_progress=on_progress, evaluate=evaluate, final_split=final_split).run(minutes, max_updates)

    def shutdown(self) -> None:
        import ray
        for sh in getattr(self, "shards", []):
            try:
                ray.get(sh.close.remote(), timeout=10)
            except Exception:
                pass
        if getattr(self, "pref", None) is not None:  # frees the name for the next run on this cluster
            try:
                ray.get(self.pref.close.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(self.pref, no_restart=True)
        if getattr(self, "store_named", False):  # frees the name; Serve keeps the last version it loaded
            ray.kill(self.store, no_restart=True)


def initial_weights(cfg: TrainConfig) -> dict:
    """The learner's initial network as numpy arrays (version 0 of the published weights)."""
    return make_components(cfg).initial_weights()


def copy_checkpoint(result, dest: str | Path) -> Optional[Path]:
    """Copy the run's latest checkpoint file to `dest` (the path `launch.evaluate` reads)."""
    from learner.train_loop import CHECKPOINT_NAME
    ck = getattr(result, "checkpoint", None)
    if ck is None:
        return None
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with ck.as_directory() as d:
        src = Path(d) / CHECKPOINT_NAME
        if not src.exists():
            raise CheckpointError(f"Ray Train checkpoint {ck.path} has no {CHECKPOINT_NAME}")
        with open(src, "rb") as s:
            atomic_write(dest, lambda f: shutil.copyfileobj(s, f))
    return dest


def annotate_checkpoint(path: Path, counters: dict) -> None:
    """Write the driver's counters (env steps, learning curve) into the copied checkpoint."""
    from apex_bdq.checkpoint import save_checkpoint
    ck = load_checkpoint(path)
    save_checkpoint(path, ck["config"], ck["learner"], {**ck["counters"], **counters})

