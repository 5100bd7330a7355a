"""RolloutWorker: S simulated shards acting with a copy of the network (no Ray).

Acts per-branch epsilon-greedily with the Ape-X ladder over its shards, accumulates n-step
transitions, and computes their initial priorities with its own network copy, so replay
receives them ready to sample. The Ray actor of the distributed issue is a thin shell
around this class.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from apex_bdq.config import AgentConfig, SimConfig
from apex_bdq.nstep import NStepAccumulator, Transitions
from apex_bdq.networks import BDQNetwork
from apex_bdq.sim.platform import PlatformSim
from learner.learner import Explorer


class RolloutWorker:
    def __init__(self, sim_cfg: SimConfig, agent_cfg: AgentConfig, net: BDQNetwork,
                 epsilons: Optional[np.ndarray] = None, seed: int = 0) -> None:
        self.sim = PlatformSim(sim_cfg.replace(seed=seed))
        self.cfg = agent_cfg
        self.net = net
        self.eps = np.asarray(epsilons if epsilons is not None else agent_cfg.epsilons(sim_cfg.num_shards))
        if self.eps.shape != (sim_cfg.num_shards,):
            raise ValueError(f"epsilons must be one per shard ({sim_cfg.num_shards}), got {self.eps.shape}")
        self.rng = np.random.default_rng(seed + 1)
        self.explorer = Explorer(sim_cfg.num_shards, sim_cfg.num_branches, self.eps, self.rng,
                                 agent_cfg.explore_hold_mu, agent_cfg.explore_max_hold)
        # Discount per decision: gamma^k for a decision held k ticks.
        self.nstep = NStepAccumulator(sim_cfg.num_shards, agent_cfg.n_step, agent_cfg.gamma ** agent_cfg.decision_ticks)
        self.obs = self.sim.reset(seed=seed)
        self.env_steps = 0
        self.episode_reward = np.zeros(sim_cfg.num_shards)
        self.finished_rewards: list[float] = []

    def step(self) -> Optional[Transitions]:
        """One decision of every shard: act, hold the action for `decision_ticks` ticks,
        and return the n-step transitions (over decisions) completed by it (or None)."""
        o = self.obs
        actions, _ = self.explorer.act(self.net, o.macro, o.micro)
        k, g = self.cfg.decision_ticks, self.cfg.gamma
        block = np.zeros(self.sim.S)  # discounted reward of the held action
        truncated = False
        for i in range(k):
            nxt, reward, truncated, _ = self.sim.step(actions)
            self.env_steps += self.sim.S
            self.episode_reward += reward
            block += (g ** i) * reward
            if truncated:
                break
        out = self.nstep.push(o.macro, o.micro, actions, block * self.cfg.reward_scale, nxt.macro, nxt.micro)
        if truncated:
            tail = self.nstep.flush(nxt.macro, nxt.micro)
            out = tail if out is None else Transitions.concat([out, tail])
            self.finished_rewards.extend((self.episode_reward / self.sim.t).tolist())
            self.episode_reward[:] = 0
            nxt = self.sim.reset()
            self.explorer.reset()
        self.obs = nxt
        return out

    @torch.no_grad()
    def priorities(self, tr: Transitions) -> np.ndarray:
        """Initial |TD| priorities from this worker's network copy. Like Ape-X actors it has no
        target network, so it bootstraps with its own max; the aggregation over branches
        (mean or sum of |TD|) is the learner's rule."""
        dev = next(self.net.parameters()).device
        q = self.net(torch.as_tensor(tr.macro, device=dev), torch.as_tensor(tr.micro, device=dev))
        qn = self.net(torch.as_tensor(tr.next_macro, device=dev), torch.as_tensor(tr.next_micro, device=dev))
        q_taken = q.gather(-1, torch.as_tensor(tr.action, device=dev).long().unsqueeze(-1)).squeeze(-1)
        y = torch.as_tensor(tr.reward, device=dev) + torch.as_tensor(tr.discount, device=dev) * qn.max(-1).values.mean(-1)
        td = (y.unsqueeze(-1) - q_taken).abs()
        return (td.mean(-1) if self.cfg.priority_rule == "mean" else td.sum(-1)).cpu().numpy()
