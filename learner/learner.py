"""The learner step (no Ray): BDQ TD loss on a prioritized batch, Adam, target network."""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np
import torch

from apex_bdq.config import AgentConfig
from apex_bdq.losses import bdq_td_loss
from apex_bdq.networks import BDQNetwork, NetConfig


def batch_td_loss(forward, module: BDQNetwork, target: BDQNetwork, data: dict, weights: torch.Tensor,
                  cfg: AgentConfig, where: str = "") -> tuple[torch.Tensor, dict]:
    """The BDQ TD loss of a sampled batch: `forward` (the trained model, possibly wrapped by
    DDP / DeepSpeed / Accelerate) gives Q(s) with gradients, the bare `module` picks a* at s'
    and `target` evaluates it. A non-finite loss raises, naming `where`."""
    q = forward(data["macro"], data["micro"])  # [B, D, n]
    with torch.no_grad():
        q_next_online = module(data["next_macro"], data["next_micro"])
        q_next_target = target(data["next_macro"], data["next_micro"])
    loss, ex = bdq_td_loss(q, data["action"].long(), data["reward"], data["discount"], q_next_online, q_next_target,
                           weights, huber_delta=cfg.huber_delta, priority=cfg.priority_rule)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"TD loss is {loss.item()} {where}: check rewards and lr")
    return loss, ex


class Learner:
    def __init__(self, net_cfg: NetConfig, agent_cfg: AgentConfig, device: str | torch.device = "cpu",
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.cfg = agent_cfg
        self.net = BDQNetwork(net_cfg).to(self.device)
        self.target = copy.deepcopy(self.net).requires_grad_(False)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=agent_cfg.lr)
        self.updates = 0
        self.version = 0  # bumped whenever the weights change; stamped on what they produce

    def update(self, data: dict, weights: torch.Tensor) -> dict:
        """One gradient step on a sampled batch; returns metrics and new priorities [B]."""
        c = self.cfg
        loss, ex = batch_td_loss(self.net, self.net, self.target, data, weights.to(self.device), c,
                                 f"at update {self.updates}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), c.grad_clip)
        self.opt.step()
        self.updates += 1
        self.version += 1
        if self.updates % c.target_update == 0:
            self.target.load_state_dict(self.net.state_dict())
        return {"loss": float(loss.detach()), "q_mean": float(ex["q_mean"]), "grad_norm": float(grad_norm),
                "priorities": ex["priorities"]}

    def state_dict(self) -> dict:
        return {"net": self.net.state_dict(), "target": self.target.state_dict(), "opt": self.opt.state_dict(),
                "updates": self.updates, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["net"])
        self.target.load_state_dict(state["target"])
        self.opt.load_state_dict(state["opt"])
        self.updates, self.version = state["updates"], state["version"]


@torch.no_grad()
def act_epsilon_greedy(net: BDQNetwork, macro: np.ndarray, micro: np.ndarray, eps: np.ndarray,
                       rng: np.random.Generator, device: Optional[torch.device] = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-branch epsilon-greedy: each branch explores on its own with its shard's eps.

    Returns (actions [S, D] int64, q [S, D, n] float32)."""
    dev = device or next(net.parameters()).device
    q = net(torch.as_tensor(macro, device=dev), torch.as_tensor(micro, device=dev)).cpu().numpy()
    greedy = q.argmax(-1)  # [S, D]
    S, D, n = q.shape
    explore = rng.random((S, D)) < eps[:, None]
    return np.where(explore, rng.integers(0, n, size=(S, D)), greedy), q


class Explorer:
    """Per-branch epsilon-greedy over S shards, optionally temporally extended (ez-greedy).

    With hold_mu = 0 this is `act_epsilon_greedy`. With hold_mu > 1, a branch that starts
    exploring (probability eps of its shard) draws a sub-action uniformly and keeps it for
    n ~ Zipf(hold_mu) decisions (capped at max_hold), whatever the greedy choice is meanwhile
    (Dabney, Ostrovski & Barreto, "Temporally-Extended epsilon-Greedy Exploration", 2021).
    """

    def __init__(self, num_shards: int, num_branches: int, eps: np.ndarray, rng: np.random.Generator,
                 hold_mu: float = 0.0, max_hold: int = 12) -> None:
        self.eps = np.asarray(eps, dtype=np.float64)
        if self.eps.shape != (num_shards,):
            raise ValueError(f"epsilons must be one per shard ({num_shards}), got {self.eps.shape}")
        self.rng = rng
        self.hold_mu, self.max_hold = float(hold_mu), int(max_hold)
        self.left = np.zeros((num_shards, num_branches), dtype=np.int64)  # decisions still held
        self.held = np.zeros((num_shards, num_branches), dtype=np.int64)

    def reset(self, shards: np.ndarray | None = None) -> None:
        """Forget held exploration (all shards, or a boolean mask of them)."""
        if shards is None:
            self.left[:] = 0
        else:
            self.left[shards] = 0

    @torch.no_grad()
    def act(self, net: BDQNetwork, macro: np.ndarray, micro: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Returns (actions [S, D] int64, q [S, D, n] float32)."""
        if self.hold_mu <= 0:
            return act_epsilon_greedy(net, macro, micro, self.eps, self.rng)
        dev = next(net.parameters()).device
        q = net(torch.as_tensor(macro, device=dev), torch.as_tensor(micro, device=dev)).cpu().numpy()
        S, D, n = q.shape
        holding = self.left > 0
        start = ~holding & (self.rng.random((S, D)) < self.eps[:, None])
        if start.any():
            k = int(start.sum())
            self.held[start] = self.rng.integers(0, n, size=k)
            self.left[start] = np.minimum(self.rng.zipf(self.hold_mu, size=k), self.max_hold)
        explore = self.left > 0
        self.left[explore] -= 1
        return np.where(explore, self.held, q.argmax(-1)), q
