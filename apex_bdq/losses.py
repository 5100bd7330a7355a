"""Losses as pure functions returning (loss, extras); priorities come back as data."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bdq_td_loss(q: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor, discounts: torch.Tensor,
                q_next_online: torch.Tensor, q_next_target: torch.Tensor, weights: torch.Tensor,
                huber_delta: float = 1.0, priority: str = "mean") -> tuple[torch.Tensor, dict]:
    """BDQ temporal-difference loss with an n-step double-Q target.

    q:              [B, D, n] online Q at s (with grad)
    actions:        [B, D] long, the sub-action taken per branch
    returns:        [B] n-step discounted reward sum R^(n)
    discounts:      [B] gamma^n, 0 where the episode terminated within the n steps
    q_next_online:  [B, D, n] online Q at s' (selects a*, no grad needed)
    q_next_target:  [B, D, n] target-network Q at s' (evaluates a*)
    weights:        [B] importance-sampling weights

    Target, one per transition, averaged over branches (Tavakoli et al. 2018, eq. 6):
        y = R^(n) + gamma^n * (1/D) sum_d Q-_d(s', argmax_a Q_d(s', a))
    Loss: importance-weighted Huber of (y - Q_d(s, a_d)) per branch, averaged over branches
    and the batch. Priority per transition: mean (or sum) over branches of |TD|.
    """
    B, D, n = q.shape
    if actions.shape != (B, D):
        raise ValueError(f"actions must be [B={B}, D={D}], got {list(actions.shape)}")
    for name, t in (("returns", returns), ("discounts", discounts), ("weights", weights)):
        if t.shape != (B,):
            raise ValueError(f"{name} must be [B={B}], got {list(t.shape)}")
    if priority not in ("mean", "sum"):
        raise ValueError(f"priority must be 'mean' or 'sum', got {priority!r}")
    with torch.no_grad():
        a_star = q_next_online.argmax(-1, keepdim=True)  # [B, D, 1]
        q_star = q_next_target.gather(-1, a_star).squeeze(-1)  # [B, D]
        y = returns + discounts * q_star.mean(-1)  # [B]
    q_taken = q.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)  # [B, D]
    td = y.unsqueeze(-1) - q_taken  # [B, D]
    per_branch = F.huber_loss(q_taken, y.unsqueeze(-1).expand_as(q_taken), reduction="none", delta=huber_delta)
    loss = (weights * per_branch.mean(-1)).mean()
    abs_td = td.detach().abs()
    prio = abs_td.mean(-1) if priority == "mean" else abs_td.sum(-1)
    extras = {"priorities": prio, "td": td.detach(), "q_mean": q_taken.detach().mean(),
              "target_mean": y.mean(), "loss_per_sample": per_branch.detach().mean(-1)}
    return loss, extras
