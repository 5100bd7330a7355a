"""RolloutWorker: S simulated shards acting with a copy of the network (no Ray).

Acts per-branch epsilon-greedily with the Ape-X ladder over its shards, accumulates n-step
transitions, and computes their initial priorities with its own network copy, so replay
receives them ready to sample. The Ray actor of the distributed issue is a thin shell
around this class. With preferences on, it also cuts T-decision segments of a few shards
for the preference actor, explores with the preference head's softmax, and can shape the
reward with its utilities.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from apex_bdq.config import AgentConfig, PreferenceConfig, SimConfig
from apex_bdq.nstep import NStepAccumulator, Transitions
from apex_bdq.networks import BDQNetwork
from apex_bdq.preference import Segment
from apex_bdq.sim import make_sim
from apex_bdq.sim.provisioning import P99_Q
from learner.learner import Explorer, act_values


class SegmentRecorder:
    """Cuts the stream into T-decision segments of `segments_per_emit` shards, drawn at random
    when a segment starts (only those shards are recorded): observations, actions,
    preference metrics and per-tick series."""

    def __init__(self, num_shards: int, cfg: PreferenceConfig, rng: np.random.Generator, source: str) -> None:
        self.S, self.cfg, self.rng, self.source = num_shards, cfg, rng, source
        self.ready: list[Segment] = []
        self._clear()

    def _clear(self) -> None:
        self.pick = np.sort(self.rng.choice(self.S, size=min(self.cfg.segments_per_emit, self.S), replace=False))
        self.macro, self.micro, self.action = [], [], []
        self.ticks = {k: [] for k in ("overload", "fairness", "slo", "load", "capacity", "p99_ms")}

    def decision(self, macro: np.ndarray, micro: np.ndarray, action: np.ndarray) -> None:
        p = self.pick
        self.macro.append(macro[p])  # fancy indexing copies
        self.micro.append(micro[p])
        self.action.append(action[p])

    def tick(self, info: dict, overload: np.ndarray) -> None:
        p, t = self.pick, self.ticks
        t["overload"].append(overload[p])
        t["fairness"].append(info["fairness"][p])
        t["slo"].append(info["slo_violation"][p])
        t["load"].append(info["offered_erlangs"][p])
        t["capacity"].append(info["servers"][p])
        arr = info["arrivals"][p]
        t["p99_ms"].append((info["p99_s"][p] * arr).sum(1) / np.maximum(arr.sum(1), 1e-9) * 1e3)

    def end_decision(self, version: int) -> None:
        if len(self.action) < self.cfg.segment_decisions:
            return
        tk = {k: np.stack(v, 1) for k, v in self.ticks.items()}  # [P, ticks]
        macro, micro, action = np.stack(self.macro, 1), np.stack(self.micro, 1), np.stack(self.action, 1)
        for j, i in enumerate(self.pick):
            self.ready.append(Segment(
                id=Segment.new_id(), macro=macro[j], micro=micro[j], action=action[j].astype(np.int64),
                metrics={"overload": float(tk["overload"][j].mean()), "unfairness": float(1 - tk["fairness"][j].mean()),
                         "slo_violation": float(tk["slo"][j].mean())},
                series={"load": tk["load"][j], "capacity": tk["capacity"][j], "p99_ms": tk["p99_ms"][j]},
                source=f"{self.source}/shard{i}", version=version))
        self._clear()

    def reset(self) -> None:
        """An episode ended: a segment never spans two episodes."""
        self._clear()

    def take(self) -> list[Segment]:
        out, self.ready = self.ready, []
        return out


class RolloutWorker:
    def __init__(self, sim_cfg: SimConfig, agent_cfg: AgentConfig, net: BDQNetwork,
                 epsilons: Optional[np.ndarray] = None, seed: int = 0,
                 pref_cfg: Optional[PreferenceConfig] = None, source: str = "rollout") -> None:
        self.sim = make_sim(sim_cfg.replace(seed=seed))
        self.cfg = agent_cfg
        self.net = net
        self.eps = np.asarray(epsilons if epsilons is not None else agent_cfg.epsilons(sim_cfg.num_shards))
        if self.eps.shape != (sim_cfg.num_shards,):
            raise ValueError(f"epsilons must be one per shard ({sim_cfg.num_shards}), got {self.eps.shape}")
        self.rng = np.random.default_rng(seed + 1)
        self.pref = pref_cfg if pref_cfg is not None and pref_cfg.enabled else None
        self.steer_temperature = self.pref.temperature if (self.pref is not None and self.pref.explore_softmax
                                                           and net.pref is not None) else 0.0
        self.explorer = Explorer(sim_cfg.num_shards, sim_cfg.num_branches, self.eps, self.rng)
        self.shaping_weight = self.pref.shaping if self.pref is not None and net.pref is not None else 0.0
        self.shaping = 0.0  # on once the head is trained (set_preference_active)
        self.recorder = SegmentRecorder(sim_cfg.num_shards, self.pref, self.rng, source) if self.pref else None
        self.overload_util = (pref_cfg or PreferenceConfig()).overload_utilisation
        self.overload_ticks = 0  # shard-ticks above the utilisation threshold (exploration safety)
        self.breached_windows = 0  # settled class-windows whose SLO broke (v2; exploration safety)
        self.settled_windows = 0
        self.version = 0  # of the weights acting; stamped on segments
        # Discount per decision: gamma^k for a decision held k ticks.
        self.nstep = NStepAccumulator(sim_cfg.num_shards, agent_cfg.n_step, agent_cfg.gamma ** agent_cfg.decision_ticks)
        self.obs = self.sim.reset(seed=seed)
        # Q-values (and preference utilities) of self.obs, computed once: the next decision
        # acts on them and the transitions ending at self.obs bootstrap from them (initial
        # priorities without a second forward pass). None = compute before the next decision.
        self._q: Optional[np.ndarray] = None
        self._u: Optional[np.ndarray] = None
        self.slo_penalty = agent_cfg.slo_penalty  # training-only cost per broken class-window
        # Dense surrogate (agent.slo_burn_penalty): each class's error-budget burn in the open
        # window (the simulator's own window accumulator of late requests, in budgets); the
        # charge is the growth of min(burn, cap) over a tick.
        self.burn_penalty = agent_cfg.slo_burn_penalty
        self.burn_cap = agent_cfg.slo_burn_cap
        mean_n = self.sim.lam_table.mean(0).astype(np.float64) * self.sim.dt  # [K] requests per tick
        self._burn_unit = 1.0 / (P99_Q * self.sim.W * np.maximum(mean_n, 1e-9))  # burn per late request
        self.env_steps = 0
        self.episode_reward = np.zeros(sim_cfg.num_shards)
        self.finished_rewards: list[float] = []

    def set_preference_active(self, active: bool) -> None:
        """Steer exploration and shape rewards with the preference head from now on (the
        caller decides when the head is trained: pref.warmup_updates learner updates)."""
        self.explorer.temperature = self.steer_temperature if active else 0.0
        self.shaping = self.shaping_weight if active else 0.0
        self._q = None  # the cached pass may lack the utilities now needed

    def weights_changed(self) -> None:
        """New weights were loaded into the network: act on Q-values computed with them."""
        self._q = None

    def _evaluate(self, obs) -> None:
        want_u = self.shaping > 0 or self.explorer.temperature > 0
        self._q, self._u = act_values(self.net, obs.macro, obs.micro, want_u)

    def step(self) -> Optional[Transitions]:
        """One decision of every shard: act, hold the action for `decision_ticks` ticks,
        and return the n-step transitions (over decisions) completed by it (or None)."""
        o = self.obs
        if self._q is None:
            self._evaluate(o)
        actions = self.explorer.choose(self._q, self._u)
        q_taken = np.take_along_axis(self._q, actions[..., None], -1)[..., 0]  # [S, D]
        if self.recorder is not None:
            self.recorder.decision(o.macro, o.micro, actions)
        k, g = self.cfg.decision_ticks, self.cfg.gamma
        block = np.zeros(self.sim.S)  # discounted reward of the held action
        truncated = False
        lam = self.slo_penalty
        for i in range(k):
            spent = self.sim.win_late * self._burn_unit if self.burn_penalty else None  # [S, K] budgets
            nxt, reward, truncated, info = self.sim.step(actions)
            self.env_steps += self.sim.S
            self.episode_reward += reward
            over = info["utilisation"] > self.overload_util  # [S]
            self.overload_ticks += int(over.sum())
            if self.recorder is not None:
                self.recorder.tick(info, over)
            wv = info.get("window_violated")
            if wv is not None:
                self.breached_windows += int(wv.sum())
                self.settled_windows += wv.size
                if lam:
                    reward = reward - lam * wv.sum(1)  # [S] broken class-windows
            if spent is not None:
                reward = reward - self.burn_penalty * self._burn_charge(spent, info["late_requests"])
            block += (g ** i) * reward
            if truncated:
                break
        block *= self.cfg.reward_scale
        if self.shaping > 0 and self.explorer.utilities is not None:
            u = self.explorer.utilities  # [S, D, n]
            centred = u - u.mean(-1, keepdims=True)
            block += self.shaping * np.take_along_axis(centred, actions[..., None], -1)[..., 0].sum(-1)
        if self.recorder is not None:
            self.recorder.end_decision(self.version)
        out = self.nstep.push(o.macro, o.micro, actions, block, nxt.macro, nxt.micro, q_taken)
        if truncated:
            tail = self.nstep.flush(nxt.macro, nxt.micro)  # None with n = 1: nothing is pending
            if tail is not None:
                out = tail if out is None else Transitions.concat([out, tail])
        # One forward pass over the next state: the next decision's Q-values, and the
        # bootstrap of every transition completed now (they all end at nxt).
        self._evaluate(nxt)
        if out is not None:  # rows are whole [S] blocks (the completed one, then the tails)
            assert len(out) % self.sim.S == 0, (len(out), self.sim.S)
            out.priority = self._priority(out, np.tile(self._q.max(-1).mean(-1), len(out) // self.sim.S))
        if truncated:
            self.finished_rewards.extend((self.episode_reward / self.sim.t).tolist())
            self.episode_reward[:] = 0
            nxt = self.sim.reset()
            self._q = None
            if self.recorder is not None:
                self.recorder.reset()
        self.obs = nxt
        return out

    def _burn_charge(self, spent: np.ndarray, late: np.ndarray) -> np.ndarray:
        """[S] growth of sum_k min(burn_k, cap) over a tick that started with `spent` budgets
        burnt [S, K] and made `late` late or refused requests [S, K] (the simulator starts each
        accounting window, and each episode, from no burn)."""
        cap = self.burn_cap
        return (np.minimum(spent + late * self._burn_unit, cap) - np.minimum(spent, cap)).sum(1)

    def _priority(self, tr: Transitions, v_next: np.ndarray) -> np.ndarray:
        """|TD| of each transition, y = R + discount * v_next against Q_d(s, a_d), aggregated
        over branches by the learner's rule (mean or sum)."""
        y = tr.reward + tr.discount * v_next  # [M]
        td = np.abs(y[:, None] - tr.q_taken)  # [M, D]
        return (td.mean(-1) if self.cfg.priority_rule == "mean" else td.sum(-1)).astype(np.float32)

    @torch.no_grad()
    def priorities(self, tr: Transitions, recompute: bool = False) -> np.ndarray:
        """Initial |TD| priorities. Like Ape-X actors the worker has no target network, so it
        bootstraps with its own max over the next state's Q-values; the aggregation over
        branches (mean or sum of |TD|) is the learner's rule. Transitions from `step` carry
        them already, from the Q-values the worker computed to act (Q(s_t) when deciding at
        s_t, Q(s_t+k) when deciding at s_t+k, k = n or a shorter episode-end tail): no extra
        forward pass; after a weight reload in between, Q(s_t) is the older weights' (as
        with Ape-X actors). Others, or `recompute=True`, get two passes with the current
        weights."""
        if tr.priority is not None and not recompute:
            return tr.priority
        dev = next(self.net.parameters()).device
        q = self.net(torch.as_tensor(tr.macro, device=dev), torch.as_tensor(tr.micro, device=dev))
        qn = self.net(torch.as_tensor(tr.next_macro, device=dev), torch.as_tensor(tr.next_micro, device=dev))
        q_taken = q.gather(-1, torch.as_tensor(tr.action, device=dev).long().unsqueeze(-1)).squeeze(-1)
        return self._priority(dataclasses.replace(tr, q_taken=q_taken.cpu().numpy()),
                              qn.max(-1).values.mean(-1).cpu().numpy())
