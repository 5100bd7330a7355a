"""The network's greedy forward for serving, folded into seven matrix products.

A served decision runs the trained BDQNetwork once per request, mostly for one shard. As
torch modules that forward is ~40 small operations (two 1-D convolutions, concatenations, a
mean, two einsums, the dueling combination), and at one shard their fixed cost per operation
is the whole cost. Every stage between the ReLUs is linear, so its algebra can be done once,
when the weights load:

- each 1-D convolution over the H history steps (kernel 3, zero padding) is a banded
  [H*F_in, H*C] matrix on the flattened history: one GEMM per layer for all K classes;
- the class code (last step and mean over time of the second convolution) and the class
  embedding feed the fusion layer linearly: folded into the fusion weights and bias;
- the value layer and the D advantage layers read the same z: one GEMM;
- V + A_d - mean_a A_d is linear in the heads' hidden units: one GEMM gives Q [B, D*n].

The result equals the network's Q up to float32 rounding (tests/test_inference.py checks
both against each other on trained-like and random weights); on the 2-core VM one shard's
forward is ~10x faster (0.88 -> 0.07 ms); at 1,024 shards the GEMMs' arithmetic dominates
and the gain is ~1.1x (`python -m launch.bench serve` prints both side by side). The
network itself stays the model that trains and that checkpoints hold; this is a read-only
view of one version of its weights.
"""

from __future__ import annotations

import torch
from torch import nn

from apex_bdq.networks import BDQNetwork


def _banded(conv: nn.Conv1d, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Conv1d (stride 1, 'same' zero padding) over `steps` time steps as a matrix on the
    time-major flattened input: x [N, steps*C_in] @ T [steps*C_in, steps*C_out] + b."""
    w, b = conv.weight.detach(), conv.bias.detach()  # [C_out, C_in, k]
    c_out, c_in, k = w.shape
    if conv.stride != (1,) or conv.dilation != (1,) or conv.groups != 1 or conv.padding != (k // 2,) or k % 2 == 0:
        raise ValueError(f"only odd-kernel, stride-1, same-padded convolutions fold into a matrix, got {conv}")
    t = torch.zeros(steps * c_in, steps * c_out, dtype=w.dtype)
    for out_step in range(steps):
        for j in range(k):
            s = out_step + j - k // 2
            if 0 <= s < steps:
                t[s * c_in:(s + 1) * c_in, out_step * c_out:(out_step + 1) * c_out] += w[:, :, j].T
    return t, b.repeat(steps)


class FoldedQNet:
    """Q [B, D, n] of one BDQNetwork version (float32, CPU or the network's device)."""

    def __init__(self, net: BDQNetwork) -> None:
        cfg = net.cfg
        self.cfg = cfg
        k, h, c, e = cfg.num_classes, cfg.history, cfg.micro_channels, cfg.class_embedding
        d, n = cfg.num_branches, cfg.sub_actions
        with torch.no_grad():
            m1, m2 = net.macro.net[0], net.macro.net[2]
            w: dict[str, torch.Tensor] = {"m1": m1.weight.T, "mb1": m1.bias, "m2": m2.weight.T, "mb2": m2.bias}
            w["c1"], w["cb1"] = _banded(net.micro.conv[0], h)
            w["c2"], w["cb2"] = _banded(net.micro.conv[2], h)
            fuse = net.fuse[0]
            wf, hm = fuse.weight, cfg.macro_hidden
            w["fm"] = wf[:, :hm].T
            # The class code [last step (C), mean over time (C)] then the embedding (E), per class.
            fold = torch.zeros(k * h * c, wf.shape[0], dtype=wf.dtype)
            bias = fuse.bias.clone()
            for cls in range(k):
                base = hm + cls * (2 * c + e)
                rows = slice(cls * h * c, (cls + 1) * h * c)
                fold[rows] = (wf[:, base + c:base + 2 * c].T / h).repeat(h, 1)  # the mean: every step
                fold[cls * h * c + (h - 1) * c:(cls + 1) * h * c] += wf[:, base:base + c].T  # the last step
                bias += wf[:, base + 2 * c:base + 2 * c + e] @ net.micro.class_emb[cls]
            w["fy"], w["fb"] = fold, bias
            head = net.head
            v1, v2 = head.value[0], head.value[2]
            hv = v1.out_features
            hh = head.w1.shape[2]
            w["h1"] = torch.cat([v1.weight.T, head.w1.permute(1, 0, 2).reshape(wf.shape[0], d * hh)], 1)
            w["hb1"] = torch.cat([v1.bias, head.b1.reshape(-1)])
            q = torch.zeros(hv + d * hh, d * n, dtype=wf.dtype)
            qb = torch.zeros(d * n, dtype=wf.dtype)
            for br in range(d):  # Q_d = V + A_d - mean_a A_d, each linear in the hidden units
                w2, b2 = head.w2[br], head.b2[br]
                q[:hv, br * n:(br + 1) * n] = v2.weight[0][:, None]
                q[hv + br * hh:hv + (br + 1) * hh, br * n:(br + 1) * n] = w2 - w2.mean(1, keepdim=True)
                qb[br * n:(br + 1) * n] = v2.bias[0] + b2 - b2.mean()
            w["q"], w["qb"] = q, qb
        self.w = {name: t.detach().clone().contiguous() for name, t in w.items()}  # its own copy

    @torch.inference_mode()
    def __call__(self, macro: torch.Tensor, micro: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        b = macro.shape[0]
        x = torch.relu_(torch.addmm(w["mb1"], macro, w["m1"]))
        x = torch.relu_(torch.addmm(w["mb2"], x, w["m2"]))
        y = micro.reshape(b * cfg.num_classes, cfg.history * cfg.micro_features)
        y = torch.relu_(torch.addmm(w["cb1"], y, w["c1"]))
        y = torch.relu_(torch.addmm(w["cb2"], y, w["c2"]))
        z = torch.addmm(w["fb"], x, w["fm"])
        z = torch.relu_(z.addmm_(y.reshape(b, w["fy"].shape[0]), w["fy"]))
        hid = torch.relu_(torch.addmm(w["hb1"], z, w["h1"]))
        return torch.addmm(w["qb"], hid, w["q"]).reshape(b, cfg.num_branches, cfg.sub_actions)
