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


def segment_scores(u: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry segment scores U = sum over decisions and branches of u_d(z_t, a_t,d).

    u:       [E, P, T, D, n] per-member utilities of every decision of P segments
    actions: [P, T, D] sub-actions taken
    returns  [E, P]
    """
    E, P, T, D, n = u.shape
    if actions.shape != (P, T, D):
        raise ValueError(f"actions must be [P={P}, T={T}, D={D}], got {list(actions.shape)}")
    idx = actions.long().unsqueeze(0).unsqueeze(-1).expand(E, P, T, D, 1)
    return u.gather(-1, idx).squeeze(-1).sum((-1, -2))


def preference_loss(score_a: torch.Tensor, score_b: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Bradley-Terry loss of ranked pairs, per ensemble member, averaged.

    score_a, score_b: [E, P] segment scores; label [P]: 1 = A preferred, 0 = B, 0.5 = tie.
    Loss = -[mu log sigmoid(U(A) - U(B)) + (1 - mu) log sigmoid(U(B) - U(A))] (Christiano et
    al. 2017, eq. 1), i.e. -log sigmoid(U(A) - U(B)) for a strict A > B.
    extras: accuracy of the ensemble-mean prediction on strict pairs, P(A > B) per member
    [E, P], and the ensemble's disagreement (std of P(A > B) over members) [P].
    """
    if score_a.shape != score_b.shape or score_a.dim() != 2 or label.shape != score_a.shape[1:]:
        raise ValueError(f"scores must be [E, P] and label [P], got {list(score_a.shape)}, "
                         f"{list(score_b.shape)}, {list(label.shape)}")
    logit = score_a - score_b  # [E, P]
    loss = F.binary_cross_entropy_with_logits(logit, label.expand_as(logit))
    with torch.no_grad():
        p = torch.sigmoid(logit)  # [E, P]
        strict = label != 0.5
        pred = p.mean(0) > 0.5
        acc = (pred == (label > 0.5))[strict].float().mean() if strict.any() else torch.tensor(float("nan"))
    return loss, {"accuracy": acc, "p_a": p, "score_a": score_a.detach(), "score_b": score_b.detach(),
                  "disagreement": p.std(0) if p.shape[0] > 1 else torch.zeros_like(label)}
