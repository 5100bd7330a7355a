"""n-step returns, the learner step, the rollout worker, checkpoints and the local trainer."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from actors.rollout import RolloutWorker
from apex_bdq.checkpoint import CheckpointError, load_checkpoint, load_policy
from apex_bdq.config import AgentConfig, ConfigError, NetConfig, SimConfig, TrainConfig, apply_overrides
from apex_bdq.nstep import NStepAccumulator
from launch import evaluate, train
from learner.learner import Learner
from apex_bdq.sim import make_sim


def test_nstep_returns_by_hand():
    acc = NStepAccumulator(num_shards=2, n=3, gamma=0.5)
    obs = [np.full((2, 1), t, np.float32) for t in range(6)]
    micro = [np.full((2, 1, 1, 1), t, np.float32) for t in range(6)]
    rewards = [np.array([1.0, 10.0]) * (t + 1) for t in range(5)]
    outs = []
    for t in range(5):
        outs.append(acc.push(obs[t], micro[t], np.array([[t], [t]]), rewards[t], obs[t + 1], micro[t + 1]))
    assert outs[0] is None and outs[1] is None
    first = outs[2]
    # s_0, R = 1 + 0.5 * 2 + 0.25 * 3 = 2.75 (x10 for shard 1), discount 0.5^3, s_3.
    np.testing.assert_allclose(first.reward, [2.75, 27.5])
    np.testing.assert_allclose(first.discount, [0.125, 0.125])
    assert first.macro[0, 0] == 0 and first.next_macro[0, 0] == 3 and first.action[0, 0] == 0
    np.testing.assert_allclose(outs[4].reward, [3 + 0.5 * 4 + 0.25 * 5, 30 + 0.5 * 40 + 0.25 * 50])
    # Time-limit end: the two pending ticks leave with 2- and 1-step returns, bootstrapping from s_5.
    tail = acc.flush(obs[5], micro[5])
    np.testing.assert_allclose(tail.reward, [4 + 0.5 * 5, 40 + 25, 5, 50])
    np.testing.assert_allclose(tail.discount, [0.25, 0.25, 0.5, 0.5])
    assert (tail.next_macro == 5).all()
    with pytest.raises(ValueError, match="n must be >= 1"):
        NStepAccumulator(2, 0, 0.9)


def test_learner_fits_a_fixed_batch_and_copies_the_target():
    cfg = NetConfig(macro_hidden=32, micro_channels=8, z_dim=32, head_hidden=32)
    agent = AgentConfig(batch_size=16, replay_capacity=64, learning_starts=16, target_update=5, lr=1e-3)
    ln = Learner(cfg, agent, seed=0)
    g = torch.Generator().manual_seed(0)
    data = {"macro": torch.randn(16, 16, generator=g), "micro": torch.randn(16, 4, 8, 6, generator=g),
            "action": torch.randint(0, 5, (16, 4), generator=g).to(torch.uint8),
            "reward": torch.randn(16, generator=g), "discount": torch.zeros(16),
            "next_macro": torch.randn(16, 16, generator=g), "next_micro": torch.randn(16, 4, 8, 6, generator=g)}
    losses = [ln.update(data, torch.ones(16))["loss"] for _ in range(60)]
    assert losses[-1] < 0.2 * losses[0]
    for p, q in zip(ln.net.parameters(), ln.target.parameters()):
        torch.testing.assert_close(p, q)  # 60 updates: last copy at update 60
    out = ln.update(data, torch.ones(16))
    assert out["priorities"].shape == (16,) and (out["priorities"] >= 0).all()
    assert any(not torch.equal(p, q) for p, q in zip(ln.net.parameters(), ln.target.parameters()))


def test_rollout_worker_ladder_transitions_and_priorities():
    sim = SimConfig(num_shards=4, episode_s=20.0)
    agent = AgentConfig(n_step=3, decision_ticks=2, gamma=0.9, reward_scale=1.0)
    assert agent.epsilons(4)[0] == pytest.approx(0.4) and agent.epsilons(4)[-1] == pytest.approx(0.4 ** 8)
    net = Learner(NetConfig.for_sim(sim), agent).net
    w = RolloutWorker(sim, agent, net, seed=0)
    ref = make_sim(sim.replace(seed=0))
    ref.reset(seed=0)
    got = [w.step() for _ in range(10)]
    assert got[0] is None and got[1] is None and len(got[2]) == 4
    # 20 ticks = 10 decisions of 2 ticks: 8 full 3-decision transitions per shard, plus 2 tails.
    assert sum(len(t) for t in got if t is not None) == 10 * 4
    assert len(w.finished_rewards) == 4 and w.sim.t == 0 and w.env_steps == 20 * 4
    # Discount per decision is gamma^2; a full transition spans 3 decisions = 6 ticks.
    np.testing.assert_allclose(got[2].discount, 0.9 ** 6, rtol=1e-6)
    pr = w.priorities(got[5])
    assert pr.shape == (4,) and (pr >= 0).all() and np.isfinite(pr).all()
    # The priorities the worker computed from the Q-values it acted on (no extra forward
    # pass) equal two fresh passes with the same weights, the episode-end tails included.
    for tr in got[2:]:
        assert tr.priority is not None and tr.priority.shape == (len(tr),)
        np.testing.assert_allclose(tr.priority, w.priorities(tr, recompute=True), rtol=1e-4, atol=1e-6)
    assert len(got[-1]) == 3 * 4  # the last decision completes one transition and flushes two tails
    # The first transition's return is the per-tick discounted sum of its 6 ticks of reward,
    # each decision's action held for two ticks: replay the same actions on an identical
    # simulator (same seed, so the same arrivals).
    rewards = []
    for tr in got[2:5]:  # the transitions starting at decisions 0, 1, 2 carry their actions
        for _ in range(2):
            rewards.append(ref.step(tr.action.astype(np.int64))[1])
    expect = sum(0.9 ** i * rewards[i] for i in range(6))
    np.testing.assert_allclose(got[2].reward, expect, rtol=1e-5, atol=1e-5)


def test_smoke_training_writes_json_checkpoint_and_evaluates(tmp_path, capsys):
    out, ck, curve = tmp_path / "train.json", tmp_path / "ck.pt", tmp_path / "curve.png"
    assert train.main(["--local", "--preset", "smoke", "--json", str(out), "--checkpoint", str(ck),
                       "--curve", str(curve), "--quiet"]) == 0
    res = json.loads(out.read_text())
    for key in ("eval_reward", "hpa_eval_reward", "slo_violation_rate", "hpa_slo_violation_rate"):
        assert isinstance(res[key], float)
    assert res["updates"] > 0 and res["env_steps"] > 0 and curve.stat().st_size > 5000
    # The final evaluation covers the range train.final_eval_replicas times (2 in the smoke
    # preset), with a paired standard error of the violation-rate difference.
    assert res["learned"]["replicas"] == res["hpa"]["replicas"] == 2 and res["learned"]["shards"] == 2 * 2
    assert "slo_violation_rate_diff_se" in res
    # The checkpoint is a policy for the evaluate entry point.
    ev = tmp_path / "ev.json"
    assert evaluate.main(["--policy", f"checkpoint:{ck}", "--ticks", "30", "--shards", "2", "--json", str(ev),
                          "--no-frontier", "--quiet"]) == 0
    m = json.loads(ev.read_text())["policies"][f"checkpoint:{ck}"]
    assert np.isfinite(m["reward"])
    # Resume continues the counters.
    trainer = train.LocalTrainer(train.PRESETS["smoke"])
    trainer.resume(ck)
    assert trainer.learner.updates == res["updates"] and trainer.decisions > 0


def test_checkpoint_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt or not a checkpoint"):
        load_policy(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_policy(tmp_path / "none.pt")
    other = tmp_path / "other.pt"
    torch.save({"format": "something-else"}, other)
    with pytest.raises(CheckpointError, match="format 'something-else'"):
        load_policy(other)
    # A checkpoint trained on platform v1 (D = 4) does not act on v2 (D = 9), and says why ...
    v1 = SimConfig(platform="v1", num_shards=4)
    cfg = dataclasses.replace(train.PRESETS["smoke"], sim=v1, net=None)
    t = train.LocalTrainer(cfg)
    ck = tmp_path / "v1.pt"
    t.checkpoint(ck)
    with pytest.raises(CheckpointError, match="trained on platform v1, this run's platform is v2"):
        load_policy(ck, SimConfig())
    assert load_policy(ck, v1).platform == "v1"
    with pytest.raises(CheckpointError, match="trained with network"):
        train.LocalTrainer(train.PRESETS["smoke"]).resume(ck)
    # ... a checkpoint saved before platform v2 existed (no `platform` field) is a v1 one ...
    old = torch.load(ck, weights_only=True)
    del old["config"]["sim"]["platform"]
    torch.save(old, tmp_path / "old.pt")
    assert load_policy(tmp_path / "old.pt", v1).platform == "v1"
    # ... launch.evaluate scores a checkpoint on the platform it was trained for ...
    capsys.readouterr()
    assert evaluate.main(["--policy", f"checkpoint:{tmp_path / 'old.pt'}", "--ticks", "4", "--shards", "1",
                          "--no-frontier", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("platform v1")
    assert evaluate.main(["--policy", f"checkpoint:{ck}", "--platform", "v2", "--quiet"]) == 2
    assert "trained on platform v1" in capsys.readouterr().err
    # ... and does not put checkpoints of different platforms in one table.
    smoke_ck = tmp_path / "smoke.pt"
    train.LocalTrainer(train.PRESETS["smoke"]).checkpoint(smoke_ck)
    assert evaluate.main(["--policy", f"checkpoint:{ck},checkpoint:{smoke_ck}", "--quiet"]) == 2
    assert "trained on different platforms (sim fields platform" in capsys.readouterr().err


def test_train_config_checks():
    with pytest.raises(ConfigError, match="not a multiple of agent.decision_ticks=7"):
        TrainConfig(agent=AgentConfig(decision_ticks=7))
    with pytest.raises(ConfigError, match="learning_starts=10 must be >= batch_size=32"):
        AgentConfig(batch_size=32, learning_starts=10)
    with pytest.raises(ConfigError, match="num_branches=5 does not match"):
        TrainConfig(net=dataclasses.replace(NetConfig.for_sim(SimConfig()), num_branches=5))
    with pytest.raises(ConfigError, match="macro_features=16 does not match the simulator"):
        TrainConfig(net=NetConfig())  # v1's observation width on the v2 platform


def test_resume_auto_continues_the_checkpoint_with_its_own_config(tmp_path, capsys):
    ck, out = tmp_path / "ck.pt", tmp_path / "res.json"
    args = ["--local", "--resume", "auto", "--checkpoint", str(ck), "--quiet", "--json", str(out)]
    assert train.main(args + ["--preset", "smoke", "--set", "agent.target_update=77"]) == 0
    assert "no checkpoint yet, starting fresh" in capsys.readouterr().out
    first = load_checkpoint(ck)
    # The resubmitted command (no preset): the checkpoint's own config, counters carried on.
    assert train.main(args) == 0
    assert f"continuing from {ck}" in capsys.readouterr().out
    second = load_checkpoint(ck)
    assert second["config"]["agent"]["target_update"] == 77
    assert second["learner"]["updates"] > first["learner"]["updates"]
    assert second["counters"]["env_steps"] > first["counters"]["env_steps"]
    assert len(second["counters"]["history"]) > len(first["counters"]["history"])
    assert train.main(["--local", "--resume", str(tmp_path / "none.pt"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert train.main(["--publish-every", "0", "--quiet"]) == 2  # refused before any Ray start
    assert "publish-every must be >= 1" in capsys.readouterr().err


def test_one_step_returns_cross_an_episode_end():
    """n = 1 leaves nothing pending at a time limit: the episode's last decision still yields
    its S transitions (a crash here once killed rollout actors of n_step=1 sweeps)."""
    sim = SimConfig(num_shards=3, episode_s=8.0)
    agent = AgentConfig(n_step=1, decision_ticks=2, gamma=0.9, reward_scale=1.0)
    w = RolloutWorker(sim, agent, Learner(NetConfig.for_sim(sim), agent).net, seed=0)
    got = [w.step() for _ in range(6)]  # 4 decisions per episode: crosses one end
    assert all(t is not None and len(t) == 3 for t in got)
    assert len(w.finished_rewards) == 3 and w.env_steps == 12 * 3


def test_slo_penalty_is_a_lagrange_multiplier_adapted_on_the_training_range(tmp_path):
    """agent.slo_target_vs_hpa: a violation rate above target x HPA's (on the training range)
    raises the penalty the rollout charges, one below lowers it, within the bounds; the
    adapted value is what the rewards in replay carry, and a checkpoint keeps it."""
    base = train.PRESETS["smoke"]
    cfg = dataclasses.replace(base, agent=dataclasses.replace(base.agent, slo_penalty=50.0, slo_target_vs_hpa=0.5),
                              constraint_shards=32, constraint_replicas=1)
    tr = train.LocalTrainer(cfg)
    for _ in range(60):
        tr.train_tick()
    row = tr.adapt_slo_penalty(1.0)
    # An untrained network breaks SLOs far above half of HPA's rate: the step is clipped to +1.
    assert row["train_violation"] > row["target"] > 0
    assert row["slo_penalty"] == pytest.approx(50.0 * np.exp(0.3)) == tr.rollout.slo_penalty
    # The rewards the rollout now produces carry the new penalty: same seed and actions,
    # the difference per decision is exactly the extra penalty on the broken class-windows.
    a, sim = cfg.agent, cfg.sim
    w1 = RolloutWorker(sim, a, tr.learner.net, seed=3)
    w2 = RolloutWorker(sim, a, tr.learner.net, seed=3)
    w2.slo_penalty = 80.0
    broke = False
    for _ in range(40):  # smoke preset: 2 ticks per decision, SLO windows settle every few ticks
        t1, t2 = w1.step(), w2.step()
        assert (t1 is None) == (t2 is None)
        if t1 is not None:
            np.testing.assert_array_equal(t1.action, t2.action)
            assert (t2.reward <= t1.reward + 1e-5).all()
            broke |= bool((t2.reward < t1.reward - 1e-3).any())
    assert broke
    # Below target the penalty falls (67.5 x e^-1 = 24.8), but not below 0.9 x the initial 50.
    tr.cfg = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, slo_target_vs_hpa=1e6,
                                                                  slo_penalty_step=1.0, slo_penalty_bounds=(0.9, 2.0)))
    row = tr.adapt_slo_penalty(2.0)
    assert row["slo_penalty_before"] == pytest.approx(50.0 * np.exp(0.3))
    assert row["slo_penalty"] == pytest.approx(45.0) and len(tr.constraint_log) == 2
    ck = tmp_path / "ck.pt"
    tr.checkpoint(ck)
    again = train.LocalTrainer(cfg)
    again.resume(ck)
    assert again.rollout.slo_penalty == pytest.approx(45.0) and len(again.constraint_log) == 2


def test_adaptive_slo_penalty_config_checks():
    with pytest.raises(ConfigError, match="give it an initial value > 0"):
        AgentConfig(slo_target_vs_hpa=1.0)
    with pytest.raises(ConfigError, match="slo_target_vs_hpa must be > 0"):
        AgentConfig(slo_penalty=10.0, slo_target_vs_hpa=0.0)
    with pytest.raises(ConfigError, match="slo_penalty_bounds must be"):
        AgentConfig(slo_penalty=10.0, slo_penalty_bounds=(2.0, 4.0))
    with pytest.raises(ConfigError, match="constraint_every_s must be > 0"):
        TrainConfig(constraint_every_s=0)
    # The Ape-X path keeps a fixed penalty and says so before it starts anything.
    cfg = dataclasses.replace(train.PRESETS["smoke"], agent=AgentConfig(
        batch_size=32, replay_capacity=4_000, learning_starts=200, decision_ticks=2, slo_penalty=10.0,
        slo_target_vs_hpa=0.9))
    with pytest.raises(ConfigError, match="local trainer only: run with --local"):
        train.run_distributed(cfg, None, None)


def test_local_trainer_with_the_distributional_head_trains_and_checkpoints(tmp_path):
    base = train.PRESETS["smoke"]
    cfg = dataclasses.replace(base, net=dataclasses.replace(base.net, quantiles=4))
    tr = train.LocalTrainer(cfg)
    for _ in range(80):
        tr.train_tick()
    assert tr.learner.updates > 0 and np.isfinite(tr.last_loss)
    ck = tmp_path / "q.pt"
    tr.checkpoint(ck)
    pol = load_policy(ck, cfg.sim)
    assert pol.net.cfg.quantiles == 4
    o = make_sim(cfg.sim).reset(seed=0)
    q = pol.net(torch.from_numpy(o.macro), torch.from_numpy(o.micro))
    assert q.shape == (cfg.sim.num_shards, cfg.net.num_branches, cfg.net.sub_actions)


def _force_actions(net, choice):
    """Make the greedy policy of `net` the constant `choice` (one sub-action per branch)."""
    with torch.no_grad():
        net.head.w2.zero_()
        net.head.b2.zero_()
        for d, a in enumerate(choice):
            net.head.b2[d, a] = 10.0


def test_policy_selection_keeps_the_best_validated_weights(tmp_path):
    """Policy selection scores each check on the training range and ends the run with the
    best: a cautious constant policy (top capacity tier, fastest servers) checked first
    beats a reckless one (bottom tier, slowest servers) checked last, whatever the limit."""
    base = train.PRESETS["smoke"]
    cfg = dataclasses.replace(base, select_every_s=1e9, constraint_shards=16, constraint_replicas=1)
    tr = train.LocalTrainer(cfg)
    for _ in range(60):
        tr.train_tick()
    n = cfg.sim.sub_actions
    _force_actions(tr.learner.net, (n - 1, n // 2, 0, n - 1))
    cautious = {k: v.clone() for k, v in tr.learner.net.state_dict().items()}
    first = tr.validate(1.0)
    for _ in range(5):
        tr.train_tick()  # more updates: a later check has another update count
    _force_actions(tr.learner.net, (0, n // 2, 0, 0))
    second = tr.validate(2.0)
    assert second["slo_violation_rate"] > first["slo_violation_rate"]
    assert not second["feasible"] and second["best_so_far"] == first["updates"] != second["updates"]
    assert first["hpa_slo_violation_rate"] == second["hpa_slo_violation_rate"] > 0
    row = tr.select_policy()
    assert row is not None and row["updates"] == first["updates"]
    for k, v in tr.learner.net.state_dict().items():
        torch.testing.assert_close(v, cautious[k])
        torch.testing.assert_close(tr.learner.target.state_dict()[k], cautious[k])
    # Feasible checks are ranked by reward: a limit no policy meets makes both infeasible
    # (lower violation wins, as above); one every policy meets makes the higher reward win.
    tr2 = train.LocalTrainer(dataclasses.replace(cfg, select_violation_vs_hpa=1e6))
    for _ in range(60):
        tr2.train_tick()
    states, rows = [], []
    for t, choice in enumerate([(n - 1, n // 2, 0, n - 1), (0, n // 2, 0, 0), (2, n // 2, 0, n - 1)]):
        _force_actions(tr2.learner.net, choice)
        states.append({k: v.clone() for k, v in tr2.learner.net.state_dict().items()})
        rows.append(tr2.validate(float(t)))
        tr2.train_tick()  # the next check is at another update count
        tr2.train_tick()
    assert all(r["feasible"] for r in rows) and len({r["updates"] for r in rows}) == 3
    best = max(range(3), key=lambda i: rows[i]["reward"])
    assert tr2.select_policy()["updates"] == rows[best]["updates"]
    for k, v in tr2.learner.net.state_dict().items():
        torch.testing.assert_close(v, states[best][k])
    # The log travels in the checkpoint.
    ck = tmp_path / "sel.pt"
    tr.checkpoint(ck)
    assert len(load_checkpoint(ck)["counters"]["selection_log"]) == 2


def test_policy_selection_in_a_run_and_config_checks(tmp_path):
    base = train.PRESETS["smoke"]
    cfg = dataclasses.replace(base, select_every_s=2.0, constraint_shards=8, constraint_replicas=1)
    tr = train.LocalTrainer(cfg)
    res = tr.run(progress=False, checkpoint=str(tmp_path / "ck.pt"))
    log = res["selection_log"]
    assert log and log[-1]["updates"] == res["updates"]  # the last weights are checked too
    assert res["selected"]["updates"] in {r["updates"] for r in log}
    saved = load_checkpoint(tmp_path / "ck.pt")["learner"]["net"]  # the checkpoint holds the selected weights
    for k, v in tr.selector.best_state.items():
        torch.testing.assert_close(saved[k], v)
    with pytest.raises(ConfigError, match="select_every_s must be > 0"):
        TrainConfig(select_every_s=0.0)
    with pytest.raises(ConfigError, match="select_violation_vs_hpa must be > 0"):
        TrainConfig(select_violation_vs_hpa=-1.0)


def test_replay_warmup_acts_uniformly_until_the_first_update():
    """agent.warmup_uniform: before the learner's first update every sub-action of every
    branch is drawn at random (an untrained network's greedy choice is nearly constant);
    from the first update on, the epsilon ladder over the network's choices."""
    base = train.PRESETS["smoke"]
    cfg = dataclasses.replace(base, agent=dataclasses.replace(base.agent, warmup_uniform=True))
    tr = train.LocalTrainer(cfg)
    n = cfg.sim.sub_actions
    _force_actions(tr.learner.net, (0, 0, 0, 0))
    seen = []
    while tr.replay.size + cfg.sim.num_shards < cfg.agent.learning_starts:
        tr.train_tick()
        assert tr.learner.updates == 0 and tr.rollout.uniform
    acts = tr.replay.storage["action"][:tr.replay.size].long()  # [M, D]
    M = acts.shape[0]
    for d in range(cfg.net.num_branches):
        counts = torch.bincount(acts[:, d], minlength=n).double()
        sd = (M * (1 / n) * (1 - 1 / n)) ** 0.5  # binomial spread of one count under uniform draws
        assert ((counts - M / n).abs() < 5 * sd).all(), counts  # uniform, not the forced 0
    while tr.learner.updates == 0:
        tr.train_tick()
    assert not tr.rollout.uniform
    # Without the switch the first replay is the untrained network's (here: forced) choice.
    plain = train.LocalTrainer(base)
    _force_actions(plain.learner.net, (0, 0, 0, 0))
    for _ in range(20):
        plain.train_tick()
    first = plain.replay.storage["action"][:plain.replay.size].long()
    assert (first == 0).float().mean() > 0.5


def test_slo_burn_penalty_charges_each_windows_capped_error_budget_burn_tick_by_tick():
    """agent.slo_burn_penalty: a class-window costs mu x min(burn, cap), burn = its late (or
    dropped) requests over the 1 % the SLO allows of an average window's requests, charged
    as the burn grows and started afresh at every window's close and episode end. Replayed
    against the simulator's own accounting (the late requests of a window are the ones that
    decide whether it broke)."""
    W = 4
    sim = SimConfig(num_shards=4, episode_s=22.0, accounting_window_s=float(W), headroom_min=0.6, headroom_max=1.2)
    mu, cap = 7.0, 0.5
    agent = AgentConfig(n_step=1, decision_ticks=2, gamma=1.0, reward_scale=1.0, slo_burn_penalty=mu, slo_burn_cap=cap)
    net = Learner(NetConfig.for_sim(sim), agent).net
    _force_actions(net, (0, 0, 0, 0))  # too little capacity: late requests in most windows
    w = RolloutWorker(sim, agent, net, seed=3)
    got = [w.step() for _ in range(22)]  # two episodes of 11 decisions (the second reset mid-window)
    trs = [t for t in got if t is not None]
    ref = make_sim(sim.replace(seed=3))
    ref.reset(seed=3)
    unit = ref.inv_mean_n / (0.01 * W)
    burn = np.zeros((4, ref.K))
    charges, saturated = [], 0
    for j, tr in enumerate(trs):
        if j == 11:  # the episode ended after 11 decisions (22 ticks): a fresh one, burn from 0
            ref.reset()
            burn[:] = 0.0
        expect = np.zeros(4)
        for _ in range(2):
            _, r, _, info = ref.step(tr.action.astype(np.int64))
            before = np.minimum(burn, cap).sum(1)
            burn += info["late_requests"] * unit
            charge = np.minimum(burn, cap).sum(1) - before
            charges.append(charge)
            expect += r - mu * charge
            if info["window_violated"] is not None:
                # the window closed (its late requests decided whether it broke): burn from 0
                saturated += int((burn >= cap).sum())
                burn[:] = 0.0
            else:  # the burn follows the simulator's own count of the open window's late requests
                np.testing.assert_allclose(ref.win_late, burn / unit, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(tr.reward, expect, rtol=1e-5, atol=1e-4)
    charges = np.array(charges)
    assert (charges >= -1e-9).all() and charges.sum() > 0
    assert saturated > 0  # some class-windows reach the cap and then cost no more
    with pytest.raises(ConfigError, match="slo_burn_cap"):
        AgentConfig(slo_burn_cap=0.0)
    with pytest.raises(ConfigError, match="slo_burn_penalty"):
        AgentConfig(slo_burn_penalty=-1.0)


@pytest.mark.parametrize("quantiles", [0, 4])
def test_initial_policy_default_starts_from_the_platforms_default_setting(quantiles):
    """agent.initial_policy="default": the untrained network's greedy choice is the
    platform's default setting on any observation (the local learner and the Ape-X
    driver's version 0 alike), and the first updates still move the zeroed output layer."""
    from apex_bdq.sim.baselines import default_action
    from launch.distributed import initial_weights
    base = train.PRESETS["smoke"]
    cfg = dataclasses.replace(base, net=dataclasses.replace(base.net, quantiles=quantiles),
                              agent=dataclasses.replace(base.agent, initial_policy="default"))
    want = default_action(cfg.sim)
    assert want == (2,) * 4 + (4,) * 4 + (0,)  # v2: middle plan factor and HPA's 300-s hold per class, admit all
    tr = train.LocalTrainer(cfg)
    g = torch.Generator().manual_seed(0)
    macro = torch.randn(64, cfg.net.macro_features, generator=g) * 3
    micro = torch.randn(64, cfg.net.num_classes, cfg.net.history, cfg.net.micro_features, generator=g) * 3
    with torch.no_grad():
        greedy = tr.learner.net(macro, micro).argmax(-1)
    assert (greedy == torch.tensor(want)).all()
    v0 = initial_weights(cfg)  # what the Ape-X actors act on before the learner's first publication
    for k, v in tr.learner.net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), v0[k])
    # Without it, the same seed's random init picks something else on some branch.
    plain = train.LocalTrainer(base)
    with torch.no_grad():
        assert (plain.learner.net(macro, micro).argmax(-1) != torch.tensor(want)).any()
    while tr.learner.updates < 3:
        tr.train_tick()
    assert tr.learner.net.head.w2.abs().sum() > 0  # the zeroed layer learns
    with pytest.raises(ConfigError, match="initial_policy"):
        AgentConfig(initial_policy="random")
    with pytest.raises(ValueError, match="one sub-action in"):
        tr.learner.net.head.start_from((0, 1, 2))


def test_policy_selection_scores_on_the_validation_range_when_there_is_one():
    base = train.PRESETS["smoke"]
    cfg = apply_overrides(base, ["sim.trace.validation_fraction=0.2", "select_every_s=5", "constraint_shards=8",
                                 "constraint_replicas=1"])
    tr = train.LocalTrainer(cfg)
    row = tr.validate(1.0)
    assert row["split"] == "val"
    from apex_bdq.evaluation import evaluate_policy
    from apex_bdq.sim.baselines import HPA
    hpa_val = evaluate_policy(HPA(), cfg.sim, shards=8, replicas=1, split="val", ticks=cfg.constraint_ticks).metrics
    assert row["hpa_reward"] == hpa_val["reward"]  # HPA on the validation range, not the training range
    no_val = apply_overrides(base, ["sim.trace.validation_fraction=0"])
    assert train.PolicySelector(no_val).split == "train" and train.PolicySelector(base).split == "val"
    m, _ = tr.selector.train_range(tr.learner.net)  # the dual-ascent yardstick stays on the training range
    assert m["reward"] != row["reward"]
    with pytest.raises(ConfigError, match=r"TraceConfig has no field 'nope'"):
        apply_overrides(base, ["sim.trace.nope=1"])
    with pytest.raises(ConfigError, match=r"use NAME or sim.NAME.*sim.trace.NAME"):
        apply_overrides(base, ["agent.trace.x=1"])
