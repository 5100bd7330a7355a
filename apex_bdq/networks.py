"""Branching Dueling Q-Network (Tavakoli et al., AAAI 2018) over macro + micro observations.

    macro [B, Fm] --MacroEncoder (MLP)------------------------------.
                                                                      +--fuse--> z [B, Z]
    micro [B, K, H, Fu] --MicroEncoder (temporal conv, shared over classes,
                           plus a class embedding)-------------------'
    z --(gradient x 1/(D+1))--> V(z) [B, 1]  and  A_d(z, .) [B, D, n]
    Q_d(s, a) = V(s) + A_d(s, a) - mean_a A_d(s, a)                      -> [B, D, n]

The output grows linearly in D (D x n advantages + 1 value), where a flat Q head needs n^D.
`z` is exposed (`BDQNetwork.represent`) so the preference head attaches to it:

    z --> PreferenceHead: E members x D branches of utilities u_d(z, a_d)  -> [E, B, D, n]

The preference head reads z without the 1/(D+1) scaling and shares nothing with V or A, so
a preference-only loss moves the encoders and the head, never the value/advantage heads.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from apex_bdq.config import NetConfig  # noqa: F401  (re-exported: the network's sizes)


class MacroEncoder(nn.Module):
    """MLP over the platform-level (slow, delayed) signals."""

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.macro_features, cfg.macro_hidden), nn.ReLU(),
                                 nn.Linear(cfg.macro_hidden, cfg.macro_hidden), nn.ReLU())

    def forward(self, macro: torch.Tensor) -> torch.Tensor:  # [B, Fm] -> [B, Hm]
        return self.net(macro)


class MicroEncoder(nn.Module):
    """Temporal encoder over each class's last H ticks; one set of weights for all classes.

    Two 1-D convolutions over time, then the last step and the mean over time, plus a learned
    class embedding; the K class codes are concatenated.
    """

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        c = cfg.micro_channels
        self.conv = nn.Sequential(nn.Conv1d(cfg.micro_features, c, 3, padding=1), nn.ReLU(),
                                  nn.Conv1d(c, c, 3, padding=1), nn.ReLU())
        self.class_emb = nn.Parameter(torch.randn(cfg.num_classes, cfg.class_embedding) * 0.1)
        self.out_dim = cfg.num_classes * (2 * c + cfg.class_embedding)

    def forward(self, micro: torch.Tensor) -> torch.Tensor:  # [B, K, H, Fu] -> [B, K * C']
        b, k, h, f = micro.shape
        x = micro.reshape(b * k, h, f).transpose(1, 2)  # [B*K, Fu, H]
        y = self.conv(x)  # [B*K, C, H]
        code = torch.cat([y[:, :, -1], y.mean(-1)], dim=1).reshape(b, k, -1)  # [B, K, 2C]
        emb = self.class_emb.unsqueeze(0).expand(b, -1, -1)  # [B, K, E]
        return torch.cat([code, emb], dim=-1).reshape(b, -1)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):  # noqa: D401
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class BranchingDuelingHead(nn.Module):
    """State value V(z) and one advantage branch per action dimension.

    The D branch MLPs are held as stacked weights and evaluated with one batched matmul, so
    the head costs the same number of kernels for any D.
    """

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        D, n, z, h = cfg.num_branches, cfg.sub_actions, cfg.z_dim, cfg.head_hidden
        self.value = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, 1))
        self.w1 = nn.Parameter(torch.empty(D, z, h))
        self.b1 = nn.Parameter(torch.zeros(D, h))
        self.w2 = nn.Parameter(torch.empty(D, h, n))
        self.b2 = nn.Parameter(torch.zeros(D, n))
        for d in range(D):  # the same init as D separate nn.Linear layers
            nn.init.kaiming_uniform_(self.w1.data[d].T, a=5 ** 0.5)
            nn.init.kaiming_uniform_(self.w2.data[d].T, a=5 ** 0.5)
        bound1, bound2 = 1 / z ** 0.5, 1 / h ** 0.5
        nn.init.uniform_(self.b1, -bound1, bound1)
        nn.init.uniform_(self.b2, -bound2, bound2)

    @torch.no_grad()
    def start_from(self, actions, margin: float = 0.01) -> None:
        """Make the untrained head's greedy choice `actions` (one sub-action per branch): the
        advantage branches' output layer starts at zero (every sub-action ties, gradients still
        reach it) and the given sub-action's bias is `margin` above the others."""
        D, n = self.b2.shape
        if len(actions) != D or not all(0 <= int(a) < n for a in actions):
            raise ValueError(f"start_from needs one sub-action in [0, {n}) per branch ({D}), got {tuple(actions)!r}")
        self.w2.zero_()
        self.b2.zero_()
        for d, a in enumerate(actions):
            self.b2[d, int(a)] = margin

    def advantages(self, z: torch.Tensor) -> torch.Tensor:  # [B, Z] -> [B, D, n]
        hid = torch.relu(torch.einsum("bz,dzh->bdh", z, self.w1) + self.b1)
        return torch.einsum("bdh,dhn->bdn", hid, self.w2) + self.b2

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Q [B, D, n] = V(s) + A_d(s, a) - mean_a A_d(s, a)."""
        v = self.value(z)  # [B, 1]
        a = self.advantages(z)  # [B, D, n]
        return v.unsqueeze(-1) + a - a.mean(-1, keepdim=True)


class PreferenceHead(nn.Module):
    """Per-branch utilities u_d(z, a_d) for each of E ensemble members [E, B, D, n].

    A segment's score is the sum over its decisions and branches of the utility of the
    sub-action taken; Bradley-Terry: P(A > B) = sigmoid(U(A) - U(B)). All E x D branch MLPs
    are one stacked weight, evaluated with two batched matmuls."""

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        E, D, n, z, h = cfg.preference_ensemble, cfg.num_branches, cfg.sub_actions, cfg.z_dim, cfg.preference_hidden
        self.w1 = nn.Parameter(torch.empty(E * D, z, h))
        self.b1 = nn.Parameter(torch.zeros(E * D, h))
        self.w2 = nn.Parameter(torch.empty(E * D, h, n))
        self.b2 = nn.Parameter(torch.zeros(E * D, n))
        for m in range(E * D):  # members start apart: the ensemble's disagreement picks queries
            nn.init.kaiming_uniform_(self.w1.data[m].T, a=5 ** 0.5)
            nn.init.kaiming_uniform_(self.w2.data[m].T, a=5 ** 0.5)
        self.E, self.D, self.n = E, D, n

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # [B, Z] -> [E, B, D, n]
        hid = torch.relu(torch.einsum("bz,mzh->bmh", z, self.w1) + self.b1)  # [B, E*D, h]
        u = torch.einsum("bmh,mhn->bmn", hid, self.w2) + self.b2  # [B, E*D, n]
        return u.reshape(z.shape[0], self.E, self.D, self.n).transpose(0, 1)


class BDQNetwork(nn.Module):
    """Encoders + fusion + branching dueling head (+ the optional preference head)."""

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.macro = MacroEncoder(cfg)
        self.micro = MicroEncoder(cfg)
        self.fuse = nn.Sequential(nn.Linear(cfg.macro_hidden + self.micro.out_dim, cfg.z_dim), nn.ReLU())
        self.head = BranchingDuelingHead(cfg)
        self.pref = PreferenceHead(cfg) if cfg.preference_ensemble > 0 else None
        self.grad_scale = 1.0 / (cfg.num_branches + 1) if cfg.scale_shared_grad else 1.0

    def check_obs(self, macro: torch.Tensor, micro: torch.Tensor) -> None:
        c = self.cfg
        if macro.dim() != 2 or macro.shape[1] != c.macro_features:
            raise ValueError(f"macro observation must be [B, {c.macro_features}], got {list(macro.shape)}")
        want = (c.num_classes, c.history, c.micro_features)
        if micro.dim() != 4 or tuple(micro.shape[1:]) != want or micro.shape[0] != macro.shape[0]:
            raise ValueError(f"micro observation must be [B={macro.shape[0]}, {want[0]}, {want[1]}, {want[2]}], "
                             f"got {list(micro.shape)}")

    def represent(self, macro: torch.Tensor, micro: torch.Tensor) -> torch.Tensor:
        """The shared representation z [B, Z]."""
        self.check_obs(macro, micro)
        return self.fuse(torch.cat([self.macro(macro), self.micro(micro)], dim=-1))

    def q_from_z(self, z: torch.Tensor) -> torch.Tensor:
        if self.grad_scale != 1.0 and z.requires_grad:
            z = _GradScale.apply(z, self.grad_scale)
        return self.head(z)

    def forward(self, macro: torch.Tensor, micro: torch.Tensor, pref_macro: Optional[torch.Tensor] = None,
                pref_micro: Optional[torch.Tensor] = None):
        """Q [B, D, n]; with pref_macro/pref_micro [Bp, ...] also the preference
        utilities [E, Bp, D, n] of those observations, from one encoder pass over both (one
        forward through a DDP / DeepSpeed / Accelerate wrapper, so their gradients are
        synchronised)."""
        if pref_macro is None:
            return self.q_from_z(self.represent(macro, micro))
        if self.pref is None:
            raise ValueError("this network has no preference head (net.preference_ensemble=0)")
        b = macro.shape[0]
        z = self.represent(torch.cat([macro, pref_macro]), torch.cat([micro, pref_micro]))
        return self.q_from_z(z[:b]), self.pref(z[b:])

    def utilities(self, macro: torch.Tensor, micro: torch.Tensor) -> torch.Tensor:  # -> u [E, B, D, n]
        if self.pref is None:
            raise ValueError("this network has no preference head (net.preference_ensemble=0)")
        return self.pref(self.represent(macro, micro))

    def q_and_utilities(self, macro: torch.Tensor, micro: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q [B, D, n] and the ensemble-mean utilities [B, D, n] from one encoder pass."""
        z = self.represent(macro, micro)
        return self.q_from_z(z), self.pref(z).mean(0)


def make_network(cfg: NetConfig) -> BDQNetwork:
    return BDQNetwork(cfg)
