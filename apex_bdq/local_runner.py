"""The in-process runner: the whole agent in one process, no Ray (`launch.train --local`).

    RolloutWorker (S shards, eps ladder, n-step, initial priorities)
        -> PrioritizedReplay -> Learner.step (the same step as a Ray Train worker's)
        -> weights shared in place with the rollout (version lag 0)
    PreferenceActor (pref.enabled): segments in, ranked pairs out to the learner
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from apex_bdq.checkpoint import CheckpointError, config_to_dict, load_checkpoint, save_checkpoint
from apex_bdq.config import TrainConfig, train_config_from_dict
from apex_bdq.evaluation import evaluate_against_hpa
from apex_bdq.messages import SampledBatch
from apex_bdq.system import make_components


class LocalTrainer:
    """The whole agent in one process; the one place it is wired together."""

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
        if p.enabled:
            log = os.path.abspath(feedback_log) if feedback_log else parts.feedback_log(prefix="local")
            self.pref = parts.preference(log, heldout_every)
            self.pref.net = self.learner.net  # same process: disagreement under the current weights
        # Replay: transitions with initial priorities from the rollout, sampled by the learner.
        self.replay = parts.replay(device)
        self.decisions = 0
        self.update_credit = 0.0
        self.history: list[dict] = []  # learning curve: one row per evaluation
        self.t_offset = 0.0  # training time before a resume, so the curve keeps going forward
        self.last_loss = float("nan")
        self._hpa_cache: dict = {}

    # -- state ---------------------------------------------------------------------------
    def checkpoint(self, path: str | Path) -> None:
        save_checkpoint(path, config_to_dict(self.cfg), self.learner.state_dict(),
                        {"decisions": self.decisions, "env_steps": self.rollout.env_steps, "updates": self.learner.updates,
                         "history": self.history, "feedback_log": self.pref.log.path if self.pref is not None else None})

    def resume(self, path: str | Path) -> None:
        """Warm start: weights, target, optimiser (its learning rate included), counters and
        learning curve come back; the replay refills from fresh rollouts and the time budget
        starts again (replay and simulator state are not in checkpoints)."""
        ck = load_checkpoint(path)
        try:
            saved = train_config_from_dict(ck["config"])
            if dataclasses.asdict(saved.net) != dataclasses.asdict(self.cfg.net):
                raise CheckpointError(f"checkpoint {str(path)!r} was trained with network {saved.net}, "
                                      f"this run has {self.cfg.net}")
            self.learner.load_state_dict(ck["learner"])
            c = ck["counters"]
            self.decisions, self.rollout.env_steps = int(c["decisions"]), int(c["env_steps"])
            self.history = list(c["history"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"checkpoint {str(path)!r} cannot be resumed: {type(e).__name__}: {e}") from e
        self.t_offset = float(self.history[-1]["t_s"]) if self.history else 0.0
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
            if self.pref is not None and not self.pref_active and self.learner.updates >= self.cfg.pref.warmup_updates:
                self.rollout.set_preference_active(True)
                self.pref_active = True
            out = self.learner.step(SampledBatch.from_replay(s), pb)
            self.replay.update_priorities(s.indices, s.generations, out.priorities)
            self.last_loss = out.loss
            self.rollout.weights_changed()

    def evaluate(self, ticks: Optional[int], shards: int, replicas: int = 1) -> dict:
        return evaluate_against_hpa(self.learner.net, self.cfg, ticks, shards, self._hpa_cache, replicas)

    def run(self, progress: bool = True, checkpoint: Optional[str] = None) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        budget = cfg.minutes * 60.0
        next_eval = cfg.eval_every_s
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=int(budget), unit="s", file=sys.stderr, dynamic_ncols=True,
                       bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s {postfix}")
        last_t, last_steps, last_upd, shown = t0, self.rollout.env_steps, self.learner.updates, 0
        steps0 = self.rollout.env_steps
        eval_r = float("nan")
        while True:
            now = time.perf_counter() - t0
            if now >= budget or (cfg.max_env_ticks is not None and  # both budgets are per invocation (a resume)
                                 self.rollout.env_steps - steps0 >= cfg.max_env_ticks * cfg.sim.num_shards):
                break
            self.train_tick()
            if now >= next_eval:
                ev = self.evaluate(cfg.eval_ticks, cfg.eval_shards)
                eval_r = ev["eval_reward"]
                self.history.append({"t_s": self.t_offset + now, "env_steps": self.rollout.env_steps, "updates": self.learner.updates,
                                     "eval_reward": ev["eval_reward"], "hpa_eval_reward": ev["hpa_eval_reward"],
                                     "slo_violation_rate": ev["slo_violation_rate"],
                                     "hpa_slo_violation_rate": ev["hpa_slo_violation_rate"]})
                next_eval = (time.perf_counter() - t0) + cfg.eval_every_s
                if checkpoint:
                    self.checkpoint(checkpoint)
            if bar is not None and time.perf_counter() - last_t >= 2.0:
                t = time.perf_counter()
                sps = (self.rollout.env_steps - last_steps) / (t - last_t)
                ups = (self.learner.updates - last_upd) / (t - last_t)
                bar.set_postfix_str(f"env {sps:,.0f}/s upd {ups:,.1f}/s td {self.last_loss:.3f} "
                                    f"replay {self.replay.size:,} eval {eval_r:.3f}")
                bar.update(int(t - t0) - shown)
                shown = int(t - t0)
                last_t, last_steps, last_upd = t, self.rollout.env_steps, self.learner.updates
        if bar is not None:
            bar.close()
        train_s = time.perf_counter() - t0
        final = self.evaluate(cfg.final_eval_ticks, cfg.eval_shards, cfg.final_eval_replicas)
        self.history.append({"t_s": self.t_offset + train_s, "env_steps": self.rollout.env_steps, "updates": self.learner.updates,
                             "eval_reward": final["eval_reward"], "hpa_eval_reward": final["hpa_eval_reward"],
                             "slo_violation_rate": final["slo_violation_rate"],
                             "hpa_slo_violation_rate": final["hpa_slo_violation_rate"]})
        if checkpoint:
            self.checkpoint(checkpoint)
        return {**{k: final[k] for k in ("eval_reward", "hpa_eval_reward", "slo_violation_rate",
                                           "hpa_slo_violation_rate", "slo_violation_rate_diff_se") if k in final},
                "learned": final["learned"], "hpa": final["hpa"], "train_seconds": train_s,
                "env_steps": self.rollout.env_steps, "updates": self.learner.updates,
                "env_steps_per_s": self.rollout.env_steps / max(train_s, 1e-9),
                "updates_per_s": self.learner.updates / max(train_s, 1e-9),
                "exploration_overload_rate": self.rollout.overload_ticks / max(self.rollout.env_steps, 1),
                "preference": self.preference_stats(), "history": self.history}

    def preference_stats(self) -> Optional[dict]:
        if self.pref is None:
            return None
        ev = self.pref.eval_pair_accuracy(self.learner.net)
        return {**self.pref.stats().as_dict(), "heldout_pair_accuracy": self.pref.heldout_accuracy(self.learner.net),
                "heldout_pair_accuracy_noise_free": self.pref.heldout_accuracy(self.learner.net, noise_free=True),
                "heldout_label_ceiling": self.pref.heldout_label_ceiling(),
                "eval_pair_accuracy": ev["accuracy"], "eval_pair_accuracy_noise_free": ev["accuracy_noise_free"],
                "eval_label_ceiling": ev["label_ceiling"], "eval_pairs": ev["strict_labels"]}
