"""n-step returns, the learner step, the rollout worker, checkpoints and the local trainer."""

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from actors.rollout import RolloutWorker
from apex_bdq.checkpoint import CheckpointError, load_checkpoint, load_policy
from apex_bdq.config import AgentConfig, AugmentConfig, ConfigError, NetConfig, SimConfig, TrainConfig, apply_overrides
from apex_bdq.nstep import NStepAccumulator
from apex_bdq.local_runner import LocalTrainer
from apex_bdq.presets import PRESETS
from launch import evaluate, train
from apex_bdq.messages import SampledBatch
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


@pytest.mark.slow
def test_learner_fits_a_fixed_batch_and_copies_the_target():
    cfg = NetConfig(macro_hidden=32, micro_channels=8, z_dim=32, head_hidden=32)
    agent = AgentConfig(batch_size=16, replay_capacity=64, learning_starts=16, target_update=5, lr=1e-3)
    ln = Learner(cfg, agent, seed=0)
    g = torch.Generator().manual_seed(0)
    data = {"macro": torch.randn(16, 16, generator=g), "micro": torch.randn(16, 4, 8, 6, generator=g),
            "action": torch.randint(0, 5, (16, 4), generator=g).to(torch.uint8),
            "reward": torch.randn(16, generator=g), "discount": torch.zeros(16),
            "next_macro": torch.randn(16, 16, generator=g), "next_micro": torch.randn(16, 4, 8, 6, generator=g)}
    batch = SampledBatch(indices=None, generations=None, weights=torch.ones(16), **data)
    losses = [ln.step(batch).loss for _ in range(60)]
    assert losses[-1] < 0.2 * losses[0]
    for p, q in zip(ln.net.parameters(), ln.target.parameters()):
        torch.testing.assert_close(p, q)  # 60 updates: last copy at update 60
    out = ln.step(batch)
    assert out.priorities.shape == (16,) and (out.priorities >= 0).all()
    assert any(not torch.equal(p, q) for p, q in zip(ln.net.parameters(), ln.target.parameters()))


@pytest.mark.slow
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


@pytest.mark.slow
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
    trainer = LocalTrainer(PRESETS["smoke"])
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
    cfg = dataclasses.replace(PRESETS["smoke"], sim=v1, net=None)
    t = LocalTrainer(cfg)
    ck = tmp_path / "v1.pt"
    t.checkpoint(ck)
    with pytest.raises(CheckpointError, match="trained on platform v1, this run's platform is v2"):
        load_policy(ck, SimConfig())
    assert load_policy(ck, v1).platform == "v1"
    with pytest.raises(CheckpointError, match="trained with network"):
        LocalTrainer(PRESETS["smoke"]).resume(ck)
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
    LocalTrainer(PRESETS["smoke"]).checkpoint(smoke_ck)
    assert evaluate.main(["--policy", f"checkpoint:{ck},checkpoint:{smoke_ck}", "--quiet"]) == 2
    assert "trained on different platforms (sim fields platform" in capsys.readouterr().err
    # Trace augmentation is training-only: a checkpoint trained with it shares the table.
    aug_cfg = dataclasses.replace(PRESETS["smoke"], sim=PRESETS["smoke"].sim.replace(augment=AugmentConfig(enabled=True)))
    aug_ck = tmp_path / "aug.pt"
    LocalTrainer(aug_cfg).checkpoint(aug_ck)
    cfg_both, _ = evaluate.checkpoint_platform([f"checkpoint:{smoke_ck}", f"checkpoint:{aug_ck}"], SimConfig())
    assert cfg_both.platform == "v2" and not cfg_both.augment.enabled


def test_train_config_checks():
    with pytest.raises(ConfigError, match="not a multiple of agent.decision_ticks=7"):
        TrainConfig(agent=AgentConfig(decision_ticks=7))
    with pytest.raises(ConfigError, match="learning_starts=10 must be >= batch_size=32"):
        AgentConfig(batch_size=32, learning_starts=10)
    with pytest.raises(ConfigError, match="num_branches=5 does not match"):
        TrainConfig(net=dataclasses.replace(NetConfig.for_sim(SimConfig()), num_branches=5))
    with pytest.raises(ConfigError, match="macro_features=16 does not match the simulator"):
        TrainConfig(net=NetConfig())  # v1's observation width on the v2 platform


@pytest.mark.slow
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


def test_slo_penalty_charges_broken_class_windows_in_the_training_reward():
    """agent.slo_penalty: the same seed and actions give the same transitions, except that
    each broken class-window costs the penalty in the reward replay receives."""
    cfg = PRESETS["smoke"]
    sim = cfg.sim
    net = Learner(cfg.net, cfg.agent).net
    w1 = RolloutWorker(sim, dataclasses.replace(cfg.agent, slo_penalty=50.0), net, seed=3)
    w2 = RolloutWorker(sim, dataclasses.replace(cfg.agent, slo_penalty=80.0), net, seed=3)
    assert _charged_more(w1, w2)


def _charged_more(lo: RolloutWorker, hi: RolloutWorker, decisions: int = 40) -> bool:
    """Step two workers of one seed side by side (smoke preset: 2 ticks per decision, SLO
    windows settle every few ticks): the same actions, `hi`'s rewards never above `lo`'s;
    True if `hi` was charged more somewhere."""
    more = False
    for _ in range(decisions):
        t1, t2 = lo.step(), hi.step()
        assert (t1 is None) == (t2 is None)
        if t1 is not None:
            np.testing.assert_array_equal(t1.action, t2.action)
            assert (t2.reward <= t1.reward + 1e-5).all()
            more |= bool((t2.reward < t1.reward - 1e-3).any())
    return more


def test_burn_penalty_charges_the_error_budget_tick_by_tick_up_to_its_cap():
    """agent.slo_burn_penalty: the training reward pays for late requests as they come (the
    growth of each class's capped burn), at most mu x cap per class-window, and a new window
    starts from no burn; with the same seed the actions are those of the unpenalised run."""
    cfg = PRESETS["smoke"]
    sim = cfg.sim
    net = Learner(cfg.net, cfg.agent).net
    w = RolloutWorker(sim, dataclasses.replace(cfg.agent, slo_burn_penalty=10.0, slo_burn_cap=0.5), net, seed=3)
    S, K = sim.num_shards, w.sim.K
    one_budget = 1.0 / w._burn_unit  # [K] late requests that spend a whole window's budget
    late = np.zeros((S, K))
    late[0, 0] = 0.2 * one_budget[0]
    spent = np.zeros((S, K))
    np.testing.assert_allclose(w._burn_charge(spent, late), [0.2] + [0.0] * (S - 1))
    spent[0, 0] = 0.2
    np.testing.assert_allclose(w._burn_charge(spent, late)[0], 0.2)
    spent[0, 0] = 0.4
    np.testing.assert_allclose(w._burn_charge(spent, late)[0], 0.1)  # reaches the cap of 0.5
    spent[0, 0] = 0.6
    assert w._burn_charge(spent, late)[0] == 0.0  # capped until the window closes ...
    for _ in range(w.sim.W):  # ... and the simulator's window accumulator starts a new budget
        w.sim.step(np.zeros((S, sim.num_branches), dtype=np.int64))
    np.testing.assert_allclose(w._burn_charge(w.sim.win_late * w._burn_unit, late)[0], 0.2)
    w0 = RolloutWorker(sim, cfg.agent, net, seed=3)
    w = RolloutWorker(sim, w.cfg, net, seed=3)
    assert _charged_more(w0, w)


def test_rollout_counts_the_slo_windows_its_exploration_breaks():
    """The exploration-safety counters of a rollout worker (what `launch.bench preference`
    judges the steer by on v2): every settled class-window of every tick, and those whose
    SLO broke, with no SLO penalty set; a random explorer breaks some."""
    cfg = PRESETS["smoke"]
    net = Learner(cfg.net, cfg.agent).net
    w = RolloutWorker(cfg.sim, cfg.agent, net, epsilons=np.ones(cfg.sim.num_shards), seed=5)
    assert cfg.agent.slo_penalty == 0
    seen = {"broke": 0, "settled": 0}
    real = w.sim.step

    def step(a, **kw):
        out = real(a, **kw)
        v = out[3]["window_violated"]
        if v is not None:
            seen["broke"] += int(v.sum())
            seen["settled"] += v.size
        return out
    w.sim.step = step
    for _ in range(60):
        w.step()
    assert w.settled_windows == seen["settled"] > 0
    assert w.breached_windows == seen["broke"] > 0


def test_overload_reference_of_the_preference_bench():
    """`launch.bench preference`'s references on one network: its greedy policy alone, the
    same with the epsilon ladder (what exploration's own draws add) and the most cautious
    constant action, each a rate over settled class-windows (v2) and shard-ticks."""
    from launch.bench import _overload_reference
    cfg = PRESETS["smoke"]
    net = Learner(cfg.net, cfg.agent).net
    ref = _overload_reference(net, cfg, 30, seed=0)
    for k in ("greedy", "final_explorer", "cautious_constant"):
        assert 0.0 <= ref[f"{k}_breach_rate"] <= 1.0 and 0.0 <= ref[f"{k}_overload_rate"] <= 1.0, k
    again = _overload_reference(net, cfg, 30, seed=0)
    assert again == ref  # seeded: the bench's reference rows repeat


def test_initial_policy_default_starts_from_the_platforms_default_setting():
    """agent.initial_policy="default": the untrained network's greedy choice is the
    platform's default setting on any observation (the local learner and the Ape-X
    driver's version 0 alike), and the first updates still move the zeroed output layer."""
    from apex_bdq.sim.baselines import default_action
    from apex_bdq.ray_runner import initial_weights
    base = PRESETS["smoke"]
    cfg = dataclasses.replace(base, agent=dataclasses.replace(base.agent, initial_policy="default"))
    want = default_action(cfg.sim)
    assert want == (2,) * 4 + (4,) * 4 + (0,)  # v2: middle plan factor and HPA's 300-s hold per class, admit all
    tr = LocalTrainer(cfg)
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
    plain = LocalTrainer(base)
    with torch.no_grad():
        assert (plain.learner.net(macro, micro).argmax(-1) != torch.tensor(want)).any()
    while tr.learner.updates < 3:
        tr.train_tick()
    assert tr.learner.net.head.w2.abs().sum() > 0  # the zeroed layer learns
    with pytest.raises(ConfigError, match="initial_policy"):
        AgentConfig(initial_policy="random")
    with pytest.raises(ValueError, match="one sub-action in"):
        tr.learner.net.head.start_from((0, 1, 2))


def test_overrides_of_nested_sections_name_the_problem():
    base = PRESETS["smoke"]
    assert apply_overrides(base, ["sim.trace.validation_fraction=0.2"]).sim.trace.validation_fraction == 0.2
    with pytest.raises(ConfigError, match=r"TraceConfig has no field 'nope'"):
        apply_overrides(base, ["sim.trace.nope=1"])
    with pytest.raises(ConfigError, match=r"use NAME or sim.NAME.*sim.trace.NAME"):
        apply_overrides(base, ["agent.trace.x=1"])


def test_saved_configs_load_without_the_removed_experiments(tmp_path):
    """A checkpoint saved before the experiments were removed (commit a1f8305) still loads
    when they were off; one trained with an experiment on is refused, naming it."""
    from apex_bdq.checkpoint import config_to_dict, save_checkpoint
    from apex_bdq.config import train_config_from_dict
    cfg = PRESETS["smoke"]
    old = config_to_dict(cfg)  # the fields as a1f8305 saved them, at their defaults
    old["net"]["quantiles"] = 0
    old["agent"].update(slo_target_vs_hpa=None, slo_penalty_step=0.3,
                        slo_penalty_bounds=[0.25, 4.0], explore_hold_mu=0.0, explore_max_hold=12,
                        warmup_uniform=False)
    old.update(constraint_every_s=45.0, constraint_shards=32, constraint_replicas=2, constraint_ticks=3600,
               select_every_s=None, select_violation_vs_hpa=1.0)
    assert train_config_from_dict(old) == cfg
    tr = LocalTrainer(cfg)
    ck = tmp_path / "old.pt"
    save_checkpoint(ck, old, tr.learner.state_dict(), {"decisions": 0, "env_steps": 0, "updates": 0, "history": []})
    assert load_policy(ck, cfg.sim).net.cfg == cfg.net
    for section, key, val in (("agent", "warmup_uniform", True),
                              ("agent", "slo_target_vs_hpa", 0.9), (None, "select_every_s", 60.0)):
        bad = json.loads(json.dumps(old))
        (bad[section] if section else bad)[key] = val
        with pytest.raises(ConfigError, match=rf"{key}={val!r}, an experiment removed after commit a1f8305"):
            train_config_from_dict(bad)
    bad = json.loads(json.dumps(old))
    bad["net"]["action_band"] = [1, 2]  # a policy reads the net section: its removed field is refused there
    save_checkpoint(ck, bad, tr.learner.state_dict(), {"decisions": 0, "env_steps": 0, "updates": 0, "history": []})
    with pytest.raises(CheckpointError, match=re.escape("net.action_band=[1, 2], an experiment removed")):
        load_policy(ck, cfg.sim)
    # Experiments removed later (in any section) name the commit that last had them; saved
    # off (a list where the field was a tuple included), they load.
    later = json.loads(json.dumps(old))
    later["agent"]["policy_ema"] = 0.0
    later["net"]["action_band"] = []
    later["pref"].update(greedy_tolerance=0.0, oracle_slo="tick")
    later["guard"]["in_training"] = False
    assert train_config_from_dict(later) == cfg
    for section, key, val, commit in (("agent", "policy_ema", 0.999, "43b3d27"),
                                      ("pref", "oracle_slo", "window", "87e2800"),
                                      ("guard", "in_training", True, "84ed603"),
                                      ("net", "action_band", [1, 2], "84ed603"),
                                      ("net", "quantiles", 16, "cf3bf41")):
        bad = json.loads(json.dumps(later))
        bad[section][key] = val
        msg = f"{section}.{key}={val!r}, an experiment removed after commit {commit}"
        with pytest.raises(ConfigError, match=re.escape(msg)):
            train_config_from_dict(bad)


def test_a_saved_config_with_keys_this_version_does_not_know_is_refused_naming_them(tmp_path, capsys):
    """A checkpoint from a newer version (or from an experiment removed without a
    REMOVED_FIELDS entry) fails with the section, the key and the file, not a TypeError."""
    from apex_bdq.checkpoint import config_to_dict, save_checkpoint, train_config_of
    from apex_bdq.config import train_config_from_dict
    from apex_bdq.serving import policy_from_checkpoint
    cfg = PRESETS["smoke"]
    for where, key in (("agent", "new_knob"), ("guard", "new_band"), ("sim", "new_sim"), (None, "new_top"),
                       ("pref", "new_pref"), ("cluster", "new_cl")):
        d = config_to_dict(cfg)
        (d[where] if where else d)[key] = 1
        place = "the top level" if where is None else f"section {where!r}"
        msg = f"unknown config keys at {place}: ['{key}']; saved by another (older or newer) version"
        with pytest.raises(ConfigError, match=re.escape(msg)):
            train_config_from_dict(d)
    d = config_to_dict(cfg)
    d["sim"]["trace"]["new_col"] = "x"
    with pytest.raises(ConfigError, match=r"section 'sim.trace': \['new_col'\]"):
        train_config_from_dict(d)
    del d["sim"]
    with pytest.raises(ConfigError, match="no 'sim' section"):
        train_config_from_dict(d)
    d = config_to_dict(cfg)
    d["agent"] = None
    with pytest.raises(ConfigError, match="config section 'agent' is NoneType, expected a mapping"):
        train_config_from_dict(d)
    # through a checkpoint file: a CheckpointError naming the file, and the CLIs exit 2 saying so
    tr = LocalTrainer(cfg)
    d = config_to_dict(cfg)
    d["agent"]["new_knob"] = 1
    ck = tmp_path / "newer.pt"
    save_checkpoint(ck, d, tr.learner.state_dict(), {"decisions": 0, "env_steps": 0, "updates": 0, "history": []})
    with pytest.raises(CheckpointError, match=rf"checkpoint '{ck}': its config does not load in this version: "
                                              r"unknown config keys at section 'agent': \['new_knob'\]"):
        train_config_of(load_checkpoint(ck), ck)
    for guard in (True, False):  # Serve's check before it deploys, with and without the guard
        with pytest.raises(CheckpointError, match="new_knob"):
            policy_from_checkpoint(ck, guard=guard)
    capsys.readouterr()
    assert evaluate.main(["--policy", f"checkpoint:{ck}", "--ticks", "4", "--shards", "1", "--no-frontier",
                          "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(ck) in err and "new_knob" in err and "Traceback" not in err
    assert train.main(["--local", "--resume", str(ck), "--quiet"]) == 2
    assert "new_knob" in capsys.readouterr().err
