"""BDQ network structure and the TD loss against a hand-computed case."""

import pytest
import torch

from apex_bdq.config import SimConfig
from apex_bdq.losses import bdq_td_loss
from apex_bdq.networks import BDQNetwork, NetConfig
from apex_bdq.sim import make_sim


def obs(cfg: NetConfig, b: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, cfg.macro_features, generator=g),
            torch.randn(b, cfg.num_classes, cfg.history, cfg.micro_features, generator=g))


def test_shapes_and_dueling_identity_on_real_observations():
    sim_cfg = SimConfig(num_shards=6)
    sim = make_sim(sim_cfg)
    o = sim.reset(seed=0)
    net = BDQNetwork(NetConfig.for_sim(sim_cfg))
    macro, micro = torch.from_numpy(o.macro), torch.from_numpy(o.micro)
    q = net(macro, micro)
    D = sim_cfg.num_branches  # v2: capacity and hold per class, admission
    assert q.shape == (6, D, 5) and D == 9
    z = net.represent(macro, micro)
    v = net.head.value(z)  # [B, 1]
    # Q_d = V + A_d - mean A_d: the mean over sub-actions of every branch is V.
    torch.testing.assert_close(q.mean(-1), v.expand(-1, D), rtol=1e-5, atol=1e-5)


def test_output_and_head_grow_linearly_in_branches():
    sizes = {}
    for D in (4, 8, 16, 32):
        cfg = NetConfig(num_branches=D)
        net = BDQNetwork(cfg)
        q = net(*obs(cfg))
        assert q.shape == (3, D, 5)  # D x n outputs, where a flat head needs 5**D (5**32 ~ 2.3e22)
        sizes[D] = sum(p.numel() for p in net.head.parameters())
    per_branch = (sizes[8] - sizes[4]) / 4
    assert sizes[32] - sizes[16] == 16 * per_branch
    assert sizes[16] - sizes[8] == 8 * per_branch


def test_shared_gradient_is_scaled_by_one_over_d_plus_one():
    cfg = NetConfig(num_branches=4)
    torch.manual_seed(0)
    scaled = BDQNetwork(cfg)
    plain = BDQNetwork(NetConfig(num_branches=4, scale_shared_grad=False))
    plain.load_state_dict(scaled.state_dict())
    x = obs(cfg)
    for net in (scaled, plain):
        net.zero_grad()
        net(*x).square().mean().backward()
    g_s, g_p = scaled.fuse[0].weight.grad, plain.fuse[0].weight.grad
    torch.testing.assert_close(g_s, g_p / 5.0)
    # The heads themselves see the unscaled gradient.
    torch.testing.assert_close(scaled.head.w2.grad, plain.head.w2.grad)


def test_bad_observation_shapes_are_named():
    cfg = NetConfig()
    net = BDQNetwork(cfg)
    macro, micro = obs(cfg)
    with pytest.raises(ValueError, match=r"macro observation must be \[B, 16\]"):
        net(macro[:, :3], micro)
    with pytest.raises(ValueError, match=r"micro observation must be \[B=3, 4, 8, 6\]"):
        net(macro, micro[:, :, :4])


def test_td_loss_matches_a_hand_computed_case():
    # B = 2 transitions, D = 2 branches, n = 3 sub-actions.
    q = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 1.0, 0.0]],
                      [[2.0, 2.0, 2.0], [1.0, 0.0, -1.0]]], requires_grad=True)
    actions = torch.tensor([[2, 1], [0, 2]])
    returns = torch.tensor([1.0, 0.5])
    discounts = torch.tensor([0.9, 0.0])  # second transition ended within n steps
    q_next_online = torch.tensor([[[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]],
                                  [[9.0, 0.0, 0.0], [0.0, 9.0, 0.0]]])
    q_next_target = torch.tensor([[[1.0, 2.0, 7.0], [4.0, 8.0, 8.0]],
                                  [[5.0, 5.0, 5.0], [5.0, 5.0, 5.0]]])
    weights = torch.tensor([1.0, 0.5])
    loss, ex = bdq_td_loss(q, actions, returns, discounts, q_next_online, q_next_target, weights)
    # Online net picks a* = (1, 0) at s' for transition 0; the target net values them 2 and 4.
    y0 = 1.0 + 0.9 * (2.0 + 4.0) / 2  # 3.7
    y1 = 0.5  # terminal: no bootstrap
    td = torch.tensor([[y0 - 3.0, y0 - 1.0], [y1 - 2.0, y1 - (-1.0)]])  # [[0.7, 2.7], [-1.5, 1.5]]

    def huber(x):
        return 0.5 * x ** 2 if abs(x) <= 1 else abs(x) - 0.5

    per = [(huber(0.7) + huber(2.7)) / 2, (huber(-1.5) + huber(1.5)) / 2]
    expect = (1.0 * per[0] + 0.5 * per[1]) / 2
    assert loss.item() == pytest.approx(expect, rel=1e-6)
    torch.testing.assert_close(ex["td"], td)
    torch.testing.assert_close(ex["priorities"], td.abs().mean(-1))
    loss.backward()
    # Gradient reaches only the taken sub-actions.
    assert q.grad[0, 0, 2] != 0 and q.grad[0, 0, 0] == 0 and q.grad[1, 1, 2] != 0
    _, ex_sum = bdq_td_loss(q, actions, returns, discounts, q_next_online, q_next_target, weights,
                            priority="sum")
    torch.testing.assert_close(ex_sum["priorities"], td.abs().sum(-1))


def test_td_loss_rejects_mismatched_shapes():
    q = torch.zeros(2, 3, 4)
    ok = dict(actions=torch.zeros(2, 3, dtype=torch.long), returns=torch.zeros(2), discounts=torch.zeros(2),
              q_next_online=q, q_next_target=q, weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"actions must be \[B=2, D=3\]"):
        bdq_td_loss(q, **{**ok, "actions": torch.zeros(2, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"weights must be \[B=2\]"):
        bdq_td_loss(q, **{**ok, "weights": torch.ones(3)})
