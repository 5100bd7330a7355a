"""RolloutActor: S simulated shards acting with a copy of the network, feeding replay shards.

The plain class does the work (and is what the tests drive without Ray); `remote_actor_class`
wraps it as a Ray actor. Per Ape-X (Horgan et al. 2018): actor i of M explores with
eps_i = eps_base^(1 + eps_alpha i/(M-1)); here every simulated shard is an explorer, so the
ladder runs over all M x S shards and actor i takes its S consecutive rungs (with S = 1 that
is exactly Ape-X's per-actor eps_i). n-step transitions get initial priorities from the
actor's own network copy, go out as `TransitionBatch` chunks round-robin over the replay
shards with at most `max_in_flight` unacknowledged (back-pressure: the actor waits instead
of queueing without bound), and the actor pulls the newest weights every `weight_pull_every`
decisions.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

import numpy as np
import torch

from apex_bdq.config import ClusterConfig, TrainConfig
from apex_bdq.networks import BDQNetwork
from apex_bdq.system import make_components
from apex_bdq.messages import ActorStats, TransitionBatch, WeightPoll


def _node_id() -> str:
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    except Exception:
        return "local"


def actor_epsilons(agent_cfg, actor_id: int, num_actors: int, shards_per_actor: int) -> np.ndarray:
    ladder = np.asarray(agent_cfg.epsilons(num_actors * shards_per_actor))
    return ladder[actor_id * shards_per_actor:(actor_id + 1) * shards_per_actor]


class RolloutActor:
    def __init__(self, actor_id: int, num_actors: int, cfg: TrainConfig | dict, replay_shards: list,
                 weight_store=None, max_in_flight: int = ClusterConfig.max_in_flight,
                 weight_pull_every: int = ClusterConfig.weight_pull_every,
                 chunk_transitions: int = 256, preference=None) -> None:
        """preference: the PreferenceActor handle of a run with pref.enabled; segments of a
        few shards go to it every T decisions (fire-and-forget, at most 4 batches in flight)."""
        if not 0 <= actor_id < num_actors:
            raise ValueError(f"actor_id must be in [0, {num_actors}), got {actor_id}")
        if not replay_shards:
            raise ValueError("a rollout actor needs at least one replay shard")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"a rollout actor takes a TrainConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        torch.set_num_threads(1)
        self.actor_id, self.num_actors = actor_id, num_actors
        S = self.cfg.sim.num_shards
        self.eps = actor_epsilons(self.cfg.agent, actor_id, num_actors, S)
        torch.manual_seed(self.cfg.seed + 1000 + actor_id)
        self.net = BDQNetwork(self.cfg.net)
        self.net.eval()
        seed = self.cfg.seed + 7919 * (actor_id + 1)
        self.preference = preference if self.cfg.pref.enabled else None
        self.worker = make_components(self.cfg).rollout(self.net, epsilons=self.eps, seed=seed,
                                                        source=f"actor{actor_id}",
                                                        preferences=self.preference is not None)
        self.segments_in_flight: list = []
        self.segments_sent = 0
        self.shards = list(replay_shards)
        self.store = weight_store
        self.max_in_flight, self.pull_every = max_in_flight, weight_pull_every
        self.chunk_transitions = max(1, int(chunk_transitions))
        self.version = -1
        self.in_flight: list = []
        self._sizes: dict = {}  # in-flight insert -> transitions
        self.chunks_lost = self.transitions_lost = self.segments_lost = 0
        self.next_shard = actor_id % len(self.shards)
        self.decisions = 0
        self.sent = 0
        self.wait_s = 0.0  # time blocked on back-pressure
        self.t_start = time.time()
        self._stop = threading.Event()
        self._pending: list = []
        self._pending_n = 0
        self._pending_env = 0
        self._stop_flag = False

    # -- weights -------------------------------------------------------------------------
    def pull_weights(self) -> bool:
        """Load the newest published weights if there are newer ones than ours."""
        if self.store is None:
            return False
        import ray
        try:  # one RPC: newer weights (if any) + stop flag
            got: WeightPoll = ray.get(self.store.poll.remote(self.version), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False  # the store is restarting: act on with the weights we have
        self._stop_flag = got.stop
        if got.weights is None:
            return False
        from learner.weight_store import load_numpy_state
        load_numpy_state(self.net, ray.get(got.weights.ref[0]))
        self._set_version(got.weights.version)
        return True

    def set_weights(self, state: dict, version: int) -> None:
        from learner.weight_store import load_numpy_state
        load_numpy_state(self.net, state)
        self._set_version(version)

    def _set_version(self, version: int) -> None:
        self.version = self.worker.version = version
        self.worker.weights_changed()
        if self.preference is not None:  # weights this far on carry a trained preference head
            self.worker.set_preference_active(version >= self.cfg.pref.warmup_updates)

    # -- sending ---------------------------------------------------------------------------
    def _settle(self, done: list) -> None:
        """Results of finished inserts: a shard's refusal (bad data) raises here; a chunk
        whose shard died with it is counted lost (experience, regenerated by acting on)."""
        import ray
        for ref in done:
            n = self._sizes.pop(ref, 0)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                self.chunks_lost += 1
                self.transitions_lost += n

    def _send(self, batch: TransitionBatch) -> None:
        import ray
        while len(self.in_flight) >= self.max_in_flight:
            t0 = time.perf_counter()
            done, self.in_flight = ray.wait(self.in_flight, num_returns=1)
            self.wait_s += time.perf_counter() - t0
            self._settle(done)
        shard = self.shards[self.next_shard]
        self.next_shard = (self.next_shard + 1) % len(self.shards)
        ref = shard.add.remote(batch)
        self._sizes[ref] = len(batch)
        self.in_flight.append(ref)
        self.sent += len(batch)

    def _send_segments(self) -> None:
        import ray
        segs = self.worker.recorder.take()
        if not segs:
            return
        if len(self.segments_in_flight) >= 4:
            done, self.segments_in_flight = ray.wait(self.segments_in_flight, num_returns=1)
            try:
                ray.get(done)  # surfaces a refusal (malformed segment)
            except ray.exceptions.RayActorError:
                self.segments_lost += 1  # unranked candidates only: ranked pairs are in its log
        self.segments_in_flight.append(self.preference.submit.remote(segs))
        self.segments_sent += len(segs)

    def flush(self) -> None:
        if self.in_flight:
            self._settle(self.in_flight)
            self.in_flight = []

    # -- loop ------------------------------------------------------------------------------
    def step(self) -> Optional[TransitionBatch]:
        """One decision of every shard; returns a chunk to send once at least
        `chunk_transitions` transitions are buffered (priorities are computed for the whole
        chunk in one batched forward pass, and one RPC carries it)."""
        steps0 = self.worker.env_steps
        tr = self.worker.step()
        self.decisions += 1
        self._pending_env += self.worker.env_steps - steps0
        if tr is not None:
            self._pending.append(tr)
            self._pending_n += len(tr)
        if self.preference is not None:
            self._send_segments()
        if self._pending_n < self.chunk_transitions:
            return None
        return self._make_batch()

    def _make_batch(self) -> TransitionBatch:
        from apex_bdq.nstep import Transitions
        tr = Transitions.concat(self._pending) if len(self._pending) > 1 else self._pending[0]
        pr = self.worker.priorities(tr).astype(np.float32)
        batch = TransitionBatch(**tr.as_dict(), priorities=pr, actor_id=self.actor_id, weight_version=self.version,
                                env_steps=self._pending_env)
        self._pending, self._pending_n, self._pending_env = [], 0, 0
        return batch

    def run(self, max_decisions: Optional[int] = None, max_seconds: Optional[float] = None) -> ActorStats:
        """Act until stopped (`stop()`, or the weight store's stop flag), or the limits."""
        self._stop.clear()
        t0 = time.time()
        n = 0
        if self.version < 0:
            self.pull_weights()
        while not self._stop.is_set():
            if max_decisions is not None and n >= max_decisions:
                break
            if max_seconds is not None and time.time() - t0 >= max_seconds:
                break
            if n % self.pull_every == 0 and n:
                self.pull_weights()
                if self._stop_flag:
                    break
            batch = self.step()
            n += 1
            if batch is not None:
                self._send(batch)
                self._metrics()
        if self._pending_n:  # the partial chunk goes out too
            self._send(self._make_batch())
        self.flush()
        return self.stats()

    def _metrics(self) -> None:
        from apex_bdq import metrics as M
        now = time.time()
        last_t, last_steps = getattr(self, "_m_last", (self.t_start, 0))
        if now - last_t < 1.0:
            return
        steps = self.worker.env_steps
        M.record(M.ENV_STEPS, steps - last_steps, "rollout", self.actor_id)
        M.record(M.ENV_STEPS_PER_S, (steps - last_steps) / (now - last_t), "rollout", self.actor_id)
        self._m_last = (now, steps)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> ActorStats:
        el = max(time.time() - self.t_start, 1e-9)
        return ActorStats(actor=self.actor_id, env_steps=self.worker.env_steps, decisions=self.decisions,
                          transitions_sent=self.sent, weight_version=self.version, backpressure_wait_s=self.wait_s,
                          segments_sent=self.segments_sent, overload_ticks=self.worker.overload_ticks,
                          breached_windows=self.worker.breached_windows,
                          settled_windows=self.worker.settled_windows,
                          chunks_lost=self.chunks_lost, transitions_lost=self.transitions_lost,
                          segments_lost=self.segments_lost, env_steps_per_s=self.worker.env_steps / el,
                          epsilon_min=float(self.eps.min()), epsilon_max=float(self.eps.max()),
                          episode_rewards=list(self.worker.finished_rewards[-16:]), pid=os.getpid(),
                          node_id=_node_id())


def remote_actor_class(num_cpus: float = 1.0, resources: Optional[dict] = None, max_restarts: int = 0):
    """The Ray shell: max_concurrency 2 so `stats` and `stop` answer while `run` loops."""
    import ray
    return ray.remote(num_cpus=num_cpus, resources=resources or {}, max_concurrency=2,
                      max_restarts=max_restarts)(RolloutActor)
