"""The in-process runner: the whole agent in one process, no Ray (`launch.train --local`).

    RolloutWorker (S shards, eps ladder, n-step, initial priorities)
        -> PrioritizedReplay -> Learner.step (the same step as a Ray Train worker's)
        -> weights shared in place with the rollout (version lag 0)
    PreferenceActor (pref.enabled): segments in, ranked pairs out to the learner
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Optional

import torch

from apex_bdq.checkpoint import CheckpointError, config_to_dict, load_checkpoint, save_checkpoint, train_config_of
from apex_bdq.config import TrainConfig
from apex_bdq.driver import Driver, Progress
from apex_bdq.messages import SampledBatch
from apex_bdq.system import make_components


class LocalTrainer:
    """The whole agent in one process; the one place it is wired together. A runner of
    `apex_bdq.driver.Driver`, which owns evaluation, checkpoints, history and the result."""

    def __init__(self, cfg: TrainConfig, device: str = "cpu", feedback_log: Optional[str] = None,
                 heldout_every: int = 0) -> None:
        """feedback_log: the preference actor's durable log (with `pref.enabled`; default
        `pref.log_path`, else runs/feedback/local-<time>.log). heldout_every: keep every k-th
        oracle pair out of training (for the held-out ranking accuracy)."""
        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        parts = make_components(cfg)
        p = cfg.pref
        # Learner: online + target BDQ networks and the optimiser (the plain backend).
        self.learner = parts.learner(device=device)
        # Rollout: S shards acting with the learner's own network (in one process the copy
        # is the same object; after every tick with updates the worker drops its cached
        # Q-values, so it acts on current weights: version lag 0). With preferences on it
        # also cuts segments for the preference actor.
        self.rollout = parts.rollout(self.learner.net, source="local")
        # Preference actor: segments in, ranked pairs (oracle, people) out to the learner;
        # every accepted pair is in the durable log before it counts.
        self.pref = None
        self.pref_active = False
        # (broken, settled) class-windows when the updates reached pref.warmup_updates.
        self._warm_counts: Optional[tuple[int, int]] = None
        if p.enabled:
            log = os.path.abspath(feedback_log) if feedback_log else parts.feedback_log(prefix="local")
            self.pref = parts.preference(log, heldout_every)
            self.pref.net = self.learner.net  # same process: disagreement under the current weights
        # Replay: transitions with initial priorities from the rollout, sampled by the learner.
        self.replay = parts.replay(device)
        self.decisions = 0
        self.update_credit = 0.0
        self.resumed: dict = {}  # the counters of a resumed checkpoint (its learning curve)
        self.last_loss = float("nan")

    # -- state ---------------------------------------------------------------------------
    def checkpoint(self, path: str | Path, counters: Optional[dict] = None) -> None:
        """counters: the driver's (the learning curve); default the resumed run's."""
        save_checkpoint(path, config_to_dict(self.cfg), self.learner.state_dict(),
                        {"history": list(self.resumed.get("history", [])), **(counters or {}),
                         "decisions": self.decisions, "env_steps": self.rollout.env_steps, "updates": self.learner.updates,
                         "feedback_log": self.pref.log.path if self.pref is not None else None})

    def resume(self, path: str | Path) -> None:
        """Warm start: weights, target, optimiser (its learning rate included), counters and
        learning curve come back; the replay refills from fresh rollouts and the time budget
        starts again (replay and simulator state are not in checkpoints)."""
        ck = load_checkpoint(path)
        try:
            saved = train_config_of(ck, path)
            if dataclasses.asdict(saved.net) != dataclasses.asdict(self.cfg.net):
                raise CheckpointError(f"checkpoint {str(path)!r} was trained with network {saved.net}, "
                                      f"this run has {self.cfg.net}")
            self.learner.load_state_dict(ck["learner"])
            c = ck["counters"]
            self.decisions, self.rollout.env_steps = int(c["decisions"]), int(c["env_steps"])
            self.resumed = {"history": list(c["history"]), "env_steps": int(c["env_steps"]),
                            "updates": self.learner.updates}
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"checkpoint {str(path)!r} cannot be resumed: {type(e).__name__}: {e}") from e
        self.rollout.weights_changed()

    # -- loop ----------------------------------------------------------------------------
    def train_tick(self) -> None:
        tr = self.rollout.step()
        self.decisions += 1
        if self.pref is not None:
            segs = self.rollout.recorder.take()
            if segs:
                self.pref.submit(segs)
        if tr is not None:
            pr = self.rollout.priorities(tr)
            self.replay.add({k: torch.from_numpy(v) for k, v in tr.as_dict().items()}, torch.from_numpy(pr))
        if self.replay.size < self.cfg.agent.learning_starts:
            return
        self.update_credit += self.cfg.agent.updates_per_decision
        while self.update_credit >= 1.0:
            self.update_credit -= 1.0
            s = self.replay.sample(self.cfg.agent.batch_size)
            pb = self.pref.sample() if self.pref is not None and \
                self.learner.updates % self.cfg.pref.update_every == 0 else None
            if self._warm_counts is None and self.learner.updates >= self.cfg.pref.warmup_updates:
                # From here on a steer can act (with or without one: the same stretch is compared).
                self._warm_counts = (self.rollout.breached_windows, self.rollout.settled_windows)
                if self.pref is not None:
                    self.rollout.set_preference_active(True)
                    self.pref_active = True
            out = self.learner.step(SampledBatch.from_replay(s), pb)
            self.replay.update_priorities(s.indices, s.generations, out.priorities)
            self.last_loss = out.loss
            self.rollout.weights_changed()

    # -- the runner's side of the driver (apex_bdq/driver.py) -------------------------------
    def start(self, minutes: float, max_updates: Optional[int], counters=None) -> None:
        """The budgets of this invocation (a resume's budgets start again)."""
        self._t_end = time.perf_counter() + minutes * 60.0
        self._max_updates = max_updates
        self._steps0, self._updates0 = self.rollout.env_steps, self.learner.updates

    def running(self) -> bool:
        c = self.cfg
        return time.perf_counter() < self._t_end and \
            not (c.max_env_ticks is not None and self.rollout.env_steps - self._steps0 >= c.max_env_ticks * c.sim.num_shards) \
            and not (self._max_updates is not None and self.learner.updates - self._updates0 >= self._max_updates)

    def advance(self, deadline: float) -> Progress:
        """Train ticks until `deadline` (perf_counter seconds) or the end of the budget."""
        while time.perf_counter() < deadline and self.running():
            self.train_tick()
        return self.progress()

    def progress(self) -> Progress:
        u = self.learner.updates
        return Progress(env_steps=self.rollout.env_steps, updates=u, version=u, replay_size=self.replay.size,
                        td_loss=self.last_loss, weight_lag=0)

    def policy(self):
        """The learner's own network (the rollout acts with the same object)."""
        return self.learner.net, self.learner.updates

    def save(self, path: str | Path, counters: dict) -> None:
        self.checkpoint(path, counters)

    def stop(self) -> dict:
        b0, n0 = self._warm_counts if self._warm_counts is not None else (None, None)
        return {"progress": self.progress(),
                "exploration_overload_rate": self.rollout.overload_ticks / max(self.rollout.env_steps, 1),
                "exploration_breach_rate": self.rollout.breached_windows / max(self.rollout.settled_windows, 1),
                "exploration_breach_rate_after_warmup": None if b0 is None else
                (self.rollout.breached_windows - b0) / max(self.rollout.settled_windows - n0, 1),
                "preference": self.preference_stats()}

    def run(self, progress: bool = True, checkpoint: Optional[str] = None, minutes: Optional[float] = None,
            max_updates: Optional[int] = None) -> dict:
        """Train with the driver (evaluation, history, checkpoints, the result)."""
        return Driver(self.cfg, self, checkpoint=checkpoint, progress=progress).run(minutes, max_updates)

    def preference_stats(self) -> Optional[dict]:
        if self.pref is None:
            return None
        ev = self.pref.eval_pair_accuracy(self.learner.net)
        return {**self.pref.stats().as_dict(), "heldout_pair_accuracy": self.pref.heldout_accuracy(self.learner.net),
                "heldout_pair_accuracy_noise_free": self.pref.heldout_accuracy(self.learner.net, noise_free=True),
                "heldout_label_ceiling": self.pref.heldout_label_ceiling(),
                "eval_pair_accuracy": ev["accuracy"], "eval_pair_accuracy_noise_free": ev["accuracy_noise_free"],
                "eval_label_ceiling": ev["label_ceiling"], "eval_pairs": ev["strict_labels"]}
