"""How one training run is assembled: every component built from one TrainConfig, in one
place, for both runners (no Ray in here).

    make_components(cfg) ─┬─ learner(...)        Learner: network (seeded, initial policy),
                          │                      backend, target copy; the same on both paths
                          ├─ rollout(net, ...)   RolloutWorker: S simulated shards, epsilon
                          │                      ladder, n-step, segments for preferences
                          ├─ replay(device)      PrioritizedReplay (the one-process runner)
                          ├─ shard_config(...)   ShardConfig of each Ray replay shard
                          ├─ actor_config(...)   the TrainConfig a rollout actor runs
                          ├─ preference(log)     PreferenceActor (its plain class)
                          └─ initial_weights()   version 0 of the published weights

The in-process runner (apex_bdq/local_runner.py) calls learner / rollout / replay /
preference directly; the Ray runner (apex_bdq/ray_runner.py) hands shard_config,
actor_config and initial_weights to its actors, whose shells (actors/rollout_actor.py,
learner/train_loop.py) call rollout and learner in their own processes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import numpy as np

from apex_bdq.config import ClusterConfig, TrainConfig


class Components:
    """The factories of one run's parts (see the module docstring)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    # -- learning ----------------------------------------------------------------------------
    def learner(self, device="cpu", backend: str = "plain", micro_batch: int = 1, keep_pref_head: bool = False,
                net_state: Optional[dict] = None):
        """The learner: seeded with cfg.seed (every Ray Train rank and the version-0
        weights get the same network), preference loss weighted by pref.beta when
        preferences are on."""
        from learner.learner import Learner
        c = self.cfg
        return Learner(c.net, c.agent, device=device, seed=c.seed, pref_beta=c.pref.beta if c.pref.enabled else 0.0,
                       sim_cfg=c.sim, backend=backend, micro_batch=micro_batch, keep_pref_head=keep_pref_head,
                       net_state=net_state)

    def initial_weights(self) -> dict:
        """The learner's initial network as numpy arrays (what actors act with before the
        first publication); the caller's torch RNG is left as it was."""
        import torch
        with torch.random.fork_rng(devices=[]):
            ln = self.learner()
            return {k: v.detach().cpu().numpy().copy() for k, v in ln.net.state_dict().items()}

    # -- acting ------------------------------------------------------------------------------
    def rollout(self, net, epsilons: Optional[np.ndarray] = None, seed: Optional[int] = None,
                source: str = "local", preferences: bool = True):
        """S simulated shards acting with `net` (epsilons: one per shard, default the
        agent's ladder over them); preferences: cut segments for the preference actor when
        pref.enabled."""
        from actors.rollout import RolloutWorker
        c = self.cfg
        return RolloutWorker(c.sim, c.agent, net, epsilons=epsilons, seed=c.seed if seed is None else seed,
                             pref_cfg=c.pref if preferences else None, source=source)

    def actor_config(self, cluster: ClusterConfig) -> TrainConfig:
        """The config one rollout actor runs: its share of the simulated shards."""
        per = cluster.shards_per_actor or max(1, self.cfg.sim.num_shards // cluster.num_actors)
        return dataclasses.replace(self.cfg, sim=self.cfg.sim.replace(num_shards=per))

    # -- replay ------------------------------------------------------------------------------
    def replay(self, device="cpu"):
        """The one-process runner's prioritized replay."""
        from replay_server.replay import PrioritizedReplay
        from replay_server.replay_actor import transition_fields
        a = self.cfg.agent
        return PrioritizedReplay(a.replay_capacity, transition_fields(self.cfg.net), device=device, alpha=a.alpha,
                                 beta0=a.beta0, beta_steps=a.beta_steps, seed=self.cfg.seed)

    def shard_config(self, cluster: ClusterConfig, resume: bool = False):
        """Each Ray replay shard's settings: the capacity split between the shards, the
        learning-starts threshold as the rate limiter's minimum size, storage on the GPU
        when the shards have GPU shares, snapshots as configured (a resume loads them)."""
        from replay_server.replay_actor import ShardConfig, transition_fields
        a, s = self.cfg.agent, cluster
        snap = os.path.abspath(s.replay_snapshot_dir) if s.replay_snapshot_dir else None
        return ShardConfig(capacity=max(a.batch_size, a.replay_capacity // s.num_replay_shards), alpha=a.alpha,
                           beta0=a.beta0, beta_steps=a.beta_steps,
                           min_size=max(a.batch_size, a.learning_starts // s.num_replay_shards),
                           samples_per_insert=s.samples_per_insert, error_buffer=s.limiter_slack,
                           device="cuda" if s.use_gpu and s.replay_gpus > 0 else "cpu", seed=self.cfg.seed,
                           fields=transition_fields(self.cfg.net), snapshot_dir=snap,
                           snapshot_every_s=s.replay_snapshot_every_s, on_restart=s.replay_on_restart,
                           load_snapshot=resume and snap is not None)

    # -- preferences -------------------------------------------------------------------------
    def feedback_log(self, resumed: Optional[str] = None, prefix: str = "local") -> str:
        """The durable feedback log: pref.log_path, else the resumed run's (a resume keeps
        adding to it), else runs/feedback/<prefix>-<time>.log."""
        return os.path.abspath(self.cfg.pref.log_path or resumed or
                               os.path.join("runs", "feedback", f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.log"))

    def preference(self, log: str, heldout_every: int = 0):
        """The preference actor's plain class (the Ray runner wraps the same class)."""
        from actors.preference_actor import PreferenceActor
        return PreferenceActor(self.cfg.net, self.cfg.pref, log, seed=self.cfg.seed, heldout_every=heldout_every)


def make_components(cfg: TrainConfig) -> Components:
    return Components(cfg)
