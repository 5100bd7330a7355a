"""The folded serving forward (apex_bdq/inference.py) against the network it is folded from."""

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from apex_bdq.config import SimConfig
from apex_bdq.inference import FoldedQNet, _banded
from apex_bdq.networks import BDQNetwork, NetConfig

V2 = NetConfig.for_sim(SimConfig())
SMALL = NetConfig(macro_features=6, num_classes=3, history=5, micro_features=3, num_branches=4, sub_actions=3,
                  macro_hidden=16, micro_channels=8, class_embedding=4, z_dim=24, head_hidden=12)


def _net(cfg: NetConfig, seed: int) -> BDQNetwork:
    torch.manual_seed(seed)
    net = BDQNetwork(cfg).eval()
    with torch.no_grad():  # biases and the embedding away from their init, as after training
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return net


def _obs(cfg: NetConfig, b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, cfg.macro_features, generator=g),
            torch.randn(b, cfg.num_classes, cfg.history, cfg.micro_features, generator=g))


@pytest.mark.parametrize("cfg", [V2, SMALL, dataclasses.replace(SMALL, preference_ensemble=2)],
                         ids=["v2", "small", "with-preference-head"])
@pytest.mark.parametrize("b", [0, 1, 7, 300])
def test_folded_equals_network(cfg, b):
    net = _net(cfg, seed=b)
    macro, micro = _obs(cfg, b, seed=100 + b)
    if b == 0:  # the network's own forward does not take an empty batch; the folded one does
        assert FoldedQNet(net)(macro, micro).shape == (0, cfg.num_branches, cfg.sub_actions)
        return
    with torch.inference_mode():
        want = net(macro, micro)
    got = FoldedQNet(net)(macro, micro)
    assert got.shape == want.shape == (b, cfg.num_branches, cfg.sub_actions)
    scale = float(want.abs().max())
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * max(1.0, scale)), float((got - want).abs().max())
    # the greedy action is the same wherever the best two Q-values are not a float tie
    top2 = want.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4 * max(1.0, scale)
    assert bool((got.argmax(-1) == want.argmax(-1))[clear].all())
    assert float(clear.float().mean()) > 0.95


def test_folded_is_a_snapshot_of_one_version():
    """Training the network further does not change a folded view taken before."""
    net = _net(SMALL, seed=1)
    macro, micro = _obs(SMALL, 5, seed=2)
    folded = FoldedQNet(net)
    before = folded(macro, micro).clone()
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(1.5)
    assert torch.equal(folded(macro, micro), before)
    with torch.inference_mode():
        assert not torch.allclose(net(macro, micro), before)


@pytest.mark.parametrize("steps", [1, 2, 6])
def test_banded_matrix_is_the_convolution(steps):
    torch.manual_seed(steps)
    conv = nn.Conv1d(3, 5, 3, padding=1)
    x = torch.randn(4, 3, steps)  # [N, C_in, T]
    t, b = _banded(conv, steps)
    flat = x.transpose(1, 2).reshape(4, steps * 3)  # time-major
    got = (flat @ t + b).reshape(4, steps, 5).transpose(1, 2)
    assert torch.allclose(got, conv(x), atol=1e-6)


@pytest.mark.parametrize("conv", [nn.Conv1d(3, 5, 3, padding=0), nn.Conv1d(3, 5, 3, padding=1, stride=2),
                                  nn.Conv1d(3, 5, 2, padding=1)], ids=["valid", "strided", "even-kernel"])
def test_convolutions_that_do_not_fold_are_refused(conv):
    with pytest.raises(ValueError, match="fold"):
        _banded(conv, 4)


def test_serving_policy_decides_with_the_folded_forward():
    from apex_bdq.serving import Policy
    net = _net(V2, seed=3)
    p = Policy(net, 1, "test")
    macro, micro = _obs(V2, 16, seed=4)
    actions, q = p.decide(macro.numpy(), micro.numpy())
    with torch.inference_mode():
        want = net(macro, micro)
    assert np.allclose(q, want.numpy(), atol=1e-5)
    assert np.array_equal(actions, want.argmax(-1).numpy())
