"""The one driver of a training run, for both runners (no Ray in here).

    Driver(cfg, runner).run(minutes, max_updates)
        runner.start(minutes, max_updates, counters)   build the parts, start acting/learning
        while runner.running():
            runner.advance(deadline) -> Progress        in-process: train ticks until the
                                                        deadline; Ray: one supervision poll
            every eval_every_s: runner.policy()         the newest weights and their version
                -> evaluate on the validation days -> history row -> runner.save(checkpoint)
            progress bar / on_progress(status)
        runner.stop() -> the runner's own result keys   (Ray: raises the run's failure)
        final evaluation (held-out days) -> history row -> runner.save(checkpoint) -> the result dict

The driver owns the clock, evaluation, the learning curve (history), checkpoints, progress
and the result; a runner owns its components. `LocalTrainer` (apex_bdq/local_runner.py) runs
them in this process, `ApexRun` (apex_bdq/ray_runner.py) on a Ray cluster.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from apex_bdq.config import TrainConfig
from apex_bdq.evaluation import evaluate_against_hpa, selection_split

POLL_S = 2.0  # the longest the driver leaves a runner alone (progress, supervision, evaluation)
EVAL_KEYS = ("eval_reward", "hpa_eval_reward", "slo_violation_rate", "hpa_slo_violation_rate")


@dataclass
class Progress:
    """A runner's figures at one poll. `status` is the runner's full view (what
    `on_progress` callbacks receive, with `t_s` and the rates added)."""
    env_steps: int = 0
    updates: int = 0
    version: int = -1  # the newest published weights (-1: none yet)
    replay_size: int = 0
    td_loss: float = float("nan")
    weight_lag: int = 0
    updates_per_s: Optional[float] = None  # the learner's own figure, when it reports one
    status: dict = field(default_factory=dict)


class Runner(Protocol):
    """What the driver needs of a runner (in-process or Ray)."""
    cfg: TrainConfig
    resumed: dict  # the counters of the checkpoint this run continues ({} when fresh)

    def start(self, minutes: float, max_updates: Optional[int], counters: Callable[[], dict]) -> None: ...

    def running(self) -> bool: ...

    def advance(self, deadline: float) -> Optional[Progress]: ...

    def policy(self): ...  # -> (network, version)

    def save(self, path: str, counters: dict) -> None: ...

    def stop(self) -> dict: ...


Evaluate = Callable[..., Optional[dict]]  # (net, ticks, shards, replicas) -> evaluation or None (skip)


class Driver:
    def __init__(self, cfg: TrainConfig, runner: Runner, checkpoint: Optional[str] = None, progress: bool = False,
                 on_progress: Optional[Callable[[dict], None]] = None, evaluate: Evaluate | bool = True,
                 final_split: Optional[str] = "eval") -> None:
        """checkpoint: where the run's checkpoint goes (after every evaluation and at the
        end; the Ray runner also mirrors each learner checkpoint there as it lands).
        evaluate: True (the policy against HPA on the validation days, `evaluate_against_hpa`),
        False (no periodic evaluation), or a function (net, ticks, shards, replicas) ->
        dict | None (None: skip this one). final_split: the range of the final evaluation
        ("eval", the held-out days; a sweep scores on the validation days; None: none), run
        `final_eval_replicas` times, its keys in the result."""
        self.cfg, self.runner, self.checkpoint = cfg, runner, checkpoint
        self.on_progress, self.final_split = on_progress, final_split
        self._hpa_cache: dict = {}
        if evaluate is True:
            self.evaluate: Optional[Evaluate] = self._against_hpa
        else:
            self.evaluate = evaluate or None
        self.progress, self.bar = progress, None
        # The learning curve: one row per evaluation, carried on from a resumed run.
        self.history: list[dict] = list(runner.resumed.get("history", []))
        self.t_offset = float(self.history[-1]["t_s"]) if self.history else 0.0
        self.last: Progress = Progress()
        self._last_eval = float("nan"), float("nan")

    def _against_hpa(self, net, ticks, shards, replicas=1, split: Optional[str] = None, unguarded=False) -> dict:
        """Periodic evaluations look at the validation days (or the training range): what a
        person watching the curve sees never comes from the held-out days; the final
        evaluation (split="eval") does, with and without the policy's guard."""
        return evaluate_against_hpa(net, self.cfg, ticks, shards, self._hpa_cache, replicas,
                                    split=split or selection_split(self.cfg.sim), unguarded=unguarded)

    def counters(self) -> dict:
        """What a checkpoint carries besides the learner: the learning curve."""
        return {"history": list(self.history)}

    def _row(self, t_s: float, p: Progress, ev: dict, split: str, updates: Optional[int] = None) -> dict:
        """A learning-curve row; `split` says which days it was measured on."""
        return {"t_s": self.t_offset + t_s, "env_steps": p.env_steps,
                "updates": p.updates if updates is None else updates, "split": split,
                **{k: ev[k] for k in EVAL_KEYS}}

    def _show(self, t_s: float, p: Progress) -> None:
        if self.bar is None:
            return
        r, h = self._last_eval
        self.bar.set_postfix_str(f"env {p.status.get('env_steps_per_s', 0.0):,.0f}/s replay {p.replay_size:,} "
                                 f"upd {p.status.get('updates_per_s', 0.0):,.1f}/s td {p.td_loss:.3f} "
                                 f"lag {p.weight_lag} eval {r:.3f} (hpa {h:.3f})")
        t = min(int(t_s), self.bar.total)
        self.bar.update(max(0, t - self.bar.n))

    def run(self, minutes: Optional[float] = None, max_updates: Optional[int] = None) -> dict:
        """Train for `minutes` (default: the config's) or until `max_updates` learner updates
        of this invocation (default: the config's `updates`), whichever comes first; the
        result's `stopped_by` says which ("updates"; "minutes" when the clock ended it, so a
        run with an update budget did not reach it; "other": the env-tick budget). If anything
        fails in the loop (an evaluation, a callback, Ctrl-C), the runner is still stopped
        before the error propagates."""
        cfg, r = self.cfg, self.runner
        minutes = cfg.minutes if minutes is None else minutes
        max_updates = cfg.updates if max_updates is None else max_updates
        if self.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=int(minutes * 60), unit="s", file=sys.stderr, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s {postfix}")
        try:
            r.start(minutes, max_updates, self.counters)
            train_s = self._loop(max(0.0, cfg.eval_every_s))
        except BaseException:
            try:
                r.stop()
            except BaseException as e:  # the first error is the one to see
                print(f"note: stopping the runner after an error failed too: {type(e).__name__}: {e}", file=sys.stderr)
            raise
        finally:
            if self.bar is not None:
                self.bar.close()
        extra = r.stop()  # the runner's own result keys; the run's failure is raised here
        p = extra.pop("progress", None) or self.last
        # Rates of this invocation: a resumed run's counters start from the checkpoint's.
        env0, upd0 = int(r.resumed.get("env_steps", 0)), int(r.resumed.get("updates", 0))
        out = {"train_seconds": train_s, "env_steps": p.env_steps, "updates": p.updates,
               "env_steps_per_s": (p.env_steps - env0) / max(train_s, 1e-9),
               "updates_per_s": p.updates_per_s if p.updates_per_s is not None else
               (p.updates - upd0) / max(train_s, 1e-9), **extra}
        out["updates_budget"] = max_updates
        out["stopped_by"] = ("updates" if max_updates is not None and p.updates - upd0 >= max_updates else
                             "minutes" if train_s >= 0.99 * minutes * 60.0 else "other")  # other: env ticks, data
        if self.final_split is not None:
            net, _ = r.policy()
            final = self._against_hpa(net, cfg.final_eval_ticks, cfg.eval_shards, cfg.final_eval_replicas,
                                      split=self.final_split, unguarded=True)
            self.history.append(self._row(train_s, p, final, self.final_split))
            out.update({k: final[k] for k in EVAL_KEYS + ("slo_violation_rate_diff_se",) if k in final})
            out.update(learned=final["learned"], hpa=final["hpa"])
            if "learned_unguarded" in final:
                out["learned_unguarded"] = final["learned_unguarded"]
        out["history"] = self.history
        if self.checkpoint:
            r.save(self.checkpoint, self.counters())
        return out

    def _loop(self, eval_every_s: float) -> float:
        """Poll the runner until it is done; returns the training time in seconds."""
        cfg, r = self.cfg, self.runner
        t0 = time.perf_counter()
        next_eval = eval_every_s
        prev: Optional[tuple] = None  # (t, env_steps, updates) at the last poll
        while r.running():
            p = r.advance(min(t0 + next_eval, time.perf_counter() + POLL_S))
            now = time.perf_counter() - t0
            if p is None:  # the runner could not be asked this time (Ray: a component restarting)
                continue
            self.last = p
            st = {**p.status, "t_s": now}
            if prev is not None and now > prev[0]:
                st["env_steps_per_s"] = (p.env_steps - prev[1]) / (now - prev[0])
                st["updates_per_s"] = p.updates_per_s if p.updates_per_s is not None else \
                    (p.updates - prev[2]) / (now - prev[0])
            prev = (now, p.env_steps, p.updates)
            p.status = st
            if self.evaluate is not None and now >= next_eval and p.version >= 0:
                net, version = r.policy()
                ev = self.evaluate(net, cfg.eval_ticks, cfg.eval_shards, 1)
                if ev is not None:
                    st["eval"] = ev
                    self._last_eval = ev["eval_reward"], ev["hpa_eval_reward"]
                    self.history.append(self._row(now, p, ev, selection_split(cfg.sim), updates=version))
                    if self.checkpoint:
                        r.save(self.checkpoint, self.counters())
                next_eval = (time.perf_counter() - t0) + eval_every_s
            self._show(now, p)
            if self.on_progress is not None:
                self.on_progress(st)
        return time.perf_counter() - t0
