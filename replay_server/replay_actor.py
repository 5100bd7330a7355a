"""ReplayShard: one shard of the distributed prioritized replay, and its Ray actor shell.

Rollout actors insert `TransitionBatch` chunks through the shard (`add`); the learner worker
on the same node attaches to the shard's memory (`shared_spec`, replay_server/shared.py) and
samples and updates priorities in place, with no RPC per batch; a learner on another node
uses the `sample` / `update_priorities` RPCs (the object-store route, kept as the fallback
and as the baseline the benchmark compares against). A Reverb-style rate limiter gates
both sides (replay_server/rate_limiter.py).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from apex_bdq.config import check_snapshot_settings
from apex_bdq.durable import atomic_write
from apex_bdq.messages import PriorityUpdate, SampledBatch, ShardStats, TransitionBatch
from replay_server.rate_limiter import RateLimiter
from replay_server.replay import FieldSpec, PrioritizedReplay, ReplayError

def transition_fields(net_cfg) -> dict:
    """The replay fields for a network config (the simulator's real shapes)."""
    micro = (net_cfg.num_classes, net_cfg.history, net_cfg.micro_features)
    return {"macro": FieldSpec((net_cfg.macro_features,), torch.float32), "micro": FieldSpec(micro, torch.float32),
            "action": FieldSpec((net_cfg.num_branches,), torch.uint8), "reward": FieldSpec((), torch.float32),
            "discount": FieldSpec((), torch.float32), "next_macro": FieldSpec((net_cfg.macro_features,), torch.float32),
            "next_micro": FieldSpec(micro, torch.float32)}


@dataclass
class ShardConfig:
    capacity: int
    alpha: float = 0.6
    beta0: float = 0.4
    beta_steps: int = 50_000
    min_size: int = 1
    samples_per_insert: Optional[float] = None
    error_buffer: float = 0.0
    device: str = "cpu"
    shared: bool = True  # allocate in node-shared memory so a co-located learner attaches
    insert_timeout_s: float = 600.0  # a blocked insert (learner gone?) fails after this
    seed: int = 0
    fields: dict = field(default_factory=dict)
    # Durability (all off by default: replay is a cache of experience the actors regenerate).
    snapshot_dir: Optional[str] = None  # where `snapshot()` writes replay_shard<i>.pt
    snapshot_every_s: float = 0.0  # > 0: a background thread snapshots this often
    on_restart: str = "snapshot"  # a restarted shard: "snapshot" (its last one, if any) or "empty"
    load_snapshot: bool = False  # a fresh (not restarted) shard starts from its snapshot (a resume)

    def __post_init__(self) -> None:
        check_snapshot_settings(self.on_restart, self.snapshot_every_s, self.snapshot_dir)

    @property
    def limiter(self) -> RateLimiter:
        return RateLimiter(self.min_size, self.samples_per_insert, self.error_buffer)


class ReplayShard:
    def __init__(self, shard_id: int, cfg: ShardConfig) -> None:
        self.shard_id = shard_id
        self.cfg = cfg
        self.limiter = cfg.limiter
        self.arena = None
        if cfg.shared:
            from replay_server.shared import SharedArena
            self.arena = SharedArena.create(cfg.device, tag=f"shard{shard_id}")
        self.replay = PrioritizedReplay(cfg.capacity, cfg.fields, device=cfg.device, alpha=cfg.alpha, beta0=cfg.beta0,
                                        beta_steps=cfg.beta_steps, seed=cfg.seed + shard_id, shared=self.arena)
        self.t0 = time.time()
        self.inserted_by_actor: dict[int, int] = {}
        self.env_steps = 0
        self.versions: dict[int, int] = {}  # actor -> weight version of its last chunk
        self.blocked_s = 0.0
        self._stat_lock = threading.Lock()
        # A restart (Ray re-runs __init__ in a new process after max_restarts allows it) comes
        # back from the last snapshot or empty, as configured; a resume loads it on purpose.
        self.restarted = _was_restarted()
        if self.restarted:
            _remove_dead_arenas(f"shard{shard_id}")  # the dead incarnation's /dev/shm files
        self.restored_size = 0
        self.snapshots = 0
        self.snapshot_s = 0.0
        self.last_snapshot_t = 0.0
        want = cfg.on_restart == "snapshot" if self.restarted else cfg.load_snapshot
        if want and cfg.snapshot_dir and os.path.exists(self.snapshot_path()):
            self.restore(self.snapshot_path())
        self._closed = threading.Event()
        if cfg.snapshot_every_s > 0:
            threading.Thread(target=self._snapshot_loop, name=f"replay{shard_id}-snapshot", daemon=True).start()

    # -- identity ------------------------------------------------------------------------
    def node_id(self) -> str:
        """The Ray node this shard runs on; "local" outside Ray (ray.get_runtime_context()
        would start a whole local cluster as a side effect when Ray is not initialised)."""
        try:
            import ray
            if not ray.is_initialized():
                return "local"
            return ray.get_runtime_context().get_node_id()
        except Exception:
            return "local"

    def shared_spec(self):
        """The handle a learner on this node attaches with (None if not shareable)."""
        return None if self.arena is None else self.replay.shared_spec(self.node_id())

    def ready(self) -> int:
        return self.shard_id

    # -- inserts ---------------------------------------------------------------------------
    def add(self, batch: TransitionBatch) -> int:
        """Insert a chunk (validated: shapes, dtypes, NaN); blocks while the rate limiter
        says the learner is behind. Returns the shard's size."""
        if not isinstance(batch, TransitionBatch):
            raise ReplayError(f"replay shard {self.shard_id}: expected a TransitionBatch, got {type(batch).__name__}")
        m = len(batch)
        pr = np.asarray(batch.priorities)
        if pr.shape != (m,):
            raise ReplayError(f"replay shard {self.shard_id}: priorities must be [{m}], got {list(pr.shape)}")
        data = batch.tensors()
        t0 = time.perf_counter()
        while not self.limiter.can_insert(self.replay.writes, self.replay.sampled, m):
            if time.perf_counter() - t0 > self.cfg.insert_timeout_s:
                raise TimeoutError(f"replay shard {self.shard_id}: insert blocked {self.cfg.insert_timeout_s:.0f} s by "
                                   f"the rate limiter (samples_per_insert={self.limiter.samples_per_insert}); "
                                   "is the learner running?")
            time.sleep(0.002)
        waited = time.perf_counter() - t0
        try:
            self.replay.add(data, torch.from_numpy(pr.astype(np.float32, copy=False)))
        except ReplayError as e:
            raise ReplayError(f"replay shard {self.shard_id}, chunk from actor {batch.actor_id}: {e}") from None
        from apex_bdq import metrics as M
        M.record(M.TRANSITIONS_INSERTED, m, "replay", self.shard_id)
        M.record(M.REPLAY_SIZE, self.replay.size, "replay", self.shard_id)
        with self._stat_lock:
            self.blocked_s += waited
            self.inserted_by_actor[batch.actor_id] = self.inserted_by_actor.get(batch.actor_id, 0) + m
            self.env_steps += int(batch.env_steps)
            self.versions[batch.actor_id] = int(batch.weight_version)
        return self.replay.size

    def release(self) -> None:
        """Turn the samples-per-insert ratio off (the learner has finished): blocked and later
        inserts go through, so rollout actors can drain and stop."""
        self.limiter = RateLimiter(self.limiter.min_size)

    # -- the RPC route (a learner on another node) ------------------------------------------
    def sample(self, batch_size: int, timeout_s: float = 60.0) -> Optional[SampledBatch]:
        """A prioritized batch as numpy (None if the limiter still says no after timeout_s)."""
        t0 = time.perf_counter()
        while not self.limiter.can_sample(self.replay.size, self.replay.writes, self.replay.sampled, batch_size):
            if time.perf_counter() - t0 > timeout_s:
                return None
            time.sleep(0.002)
        return SampledBatch.from_replay(self.replay.sample(batch_size), self.shard_id).numpy()

    def update_priorities(self, update: PriorityUpdate) -> int:
        """New priorities for sampled slots; slots overwritten since are left alone. Returns
        how many were updated."""
        if not isinstance(update, PriorityUpdate):
            raise ReplayError(f"replay shard {self.shard_id}: expected a PriorityUpdate, got {type(update).__name__}")
        return self.replay.update_priorities(torch.as_tensor(update.indices), torch.as_tensor(update.generations),
                                             torch.as_tensor(update.priorities))

    # -- state -----------------------------------------------------------------------------
    def stats(self) -> ShardStats:
        with self._stat_lock:
            return ShardStats(shard=self.shard_id, size=self.replay.size, capacity=self.replay.capacity,
                              inserted=self.replay.writes, sampled=self.replay.sampled, env_steps=self.env_steps,
                              inserted_by_actor=dict(self.inserted_by_actor), actor_versions=dict(self.versions),
                              insert_blocked_s=self.blocked_s, uptime_s=time.time() - self.t0, pid=os.getpid(),
                              node_id=self.node_id(), device=str(self.replay.device), restarted=self.restarted,
                              restored_size=self.restored_size, snapshots=self.snapshots, snapshot_s=self.snapshot_s)

    def state_dict(self) -> dict:
        return self.replay.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.replay.load_state_dict(state)

    def snapshot_path(self) -> str:
        if not self.cfg.snapshot_dir:
            raise ReplayError(f"replay shard {self.shard_id} has no snapshot_dir configured")
        return os.path.join(self.cfg.snapshot_dir, f"replay_shard{self.shard_id}.pt")

    def snapshot(self) -> dict:
        """Write the replay (storage, priorities, counters) to snapshot_path() atomically: a
        crash mid-write leaves the previous snapshot. Returns {path, size, seconds}."""
        t0 = time.perf_counter()
        path = self.snapshot_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = self.replay.state_dict()  # a consistent copy, taken under the replay's lock
        atomic_write(path, lambda f: torch.save({"shard": self.shard_id, "time": time.time(), "replay": state}, f))
        dt = time.perf_counter() - t0
        with self._stat_lock:
            self.snapshots += 1
            self.snapshot_s += dt
            self.last_snapshot_t = time.time()
        return {"path": path, "size": int(state["size"]), "seconds": dt}

    def restore(self, path: str) -> int:
        """Load a snapshot written by `snapshot()` (same capacity, fields and alpha; refused
        with the reason otherwise). Returns the restored size."""
        try:
            got = torch.load(path, map_location="cpu", weights_only=True)
            state = got["replay"]
        except Exception as e:
            raise ReplayError(f"replay shard {self.shard_id}: snapshot {path!r} is unreadable: "
                              f"{type(e).__name__}: {e}") from None
        self.replay.load_state_dict(state)
        self.restored_size = self.replay.size
        return self.restored_size

    def _snapshot_loop(self) -> None:
        while not self._closed.wait(self.cfg.snapshot_every_s):
            try:
                self.snapshot()
            except Exception as e:  # a full disk must not kill the shard; stats show no new snapshots
                print(f"replay shard {self.shard_id}: snapshot failed: {type(e).__name__}: {e}")

    def close(self) -> None:
        if getattr(self, "_closed", None) is not None:
            self._closed.set()
        if self.arena is not None:
            self.arena.unlink()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _was_restarted() -> bool:
    """True in a Ray actor that Ray has restarted after its process died."""
    try:
        import ray
        return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:
        return False


def _remove_dead_arenas(tag: str) -> None:
    """Unlink shared replay files of this tag whose owner process is gone (a killed shard
    never ran close(); learners that still map them keep their pages until they let go)."""
    import glob
    from replay_server.shared import shm_dir
    for p in glob.glob(os.path.join(shm_dir(), f"apex_bdq_{tag}_*")):
        try:
            pid = int(os.path.basename(p).split("_")[3])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # alive: another run's shard with the same number
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(p)
        except OSError:
            pass


def remote_shard_class(num_cpus: float = 0.25, num_gpus: float = 0.0, resources: Optional[dict] = None,
                       max_restarts: int = 0):
    """The Ray actor shell: threaded (inserts from several actors, stats, RPC samples run
    side by side; the replay's lock orders them)."""
    import ray
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, max_concurrency=16,
                      max_restarts=max_restarts)(ReplayShard)
