"""Ape-X components without a Ray cluster: rate limiter, replay shard, rollout actor, config
overrides, cluster.yaml validation."""

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from actors.rollout_actor import RolloutActor, actor_epsilons
from apex_bdq.config import AgentConfig, ConfigError, apply_overrides
from apex_bdq.presets import PRESETS
from replay_server.rate_limiter import RateLimiter
from replay_server.replay import ReplayError
from apex_bdq.messages import PriorityUpdate, TransitionBatch
from replay_server.replay_actor import ReplayShard, ShardConfig, transition_fields

ROOT = Path(__file__).resolve().parents[1]
SMOKE = PRESETS["smoke"]


def test_rate_limiter_bounds_both_sides():
    rl = RateLimiter(min_size=100, samples_per_insert=2.0, error_buffer=50)
    assert not rl.can_sample(size=99, inserted=99, sampled=0, b=10)  # below min size
    assert rl.can_sample(size=100, inserted=100, sampled=0, b=10)
    # The learner far ahead of the actors: sampling stops, inserting goes on.
    assert not rl.can_sample(size=200, inserted=200, sampled=400 - 100 * 2 + 51 + 200, b=10)
    assert rl.can_insert(inserted=200, sampled=400, m=10)
    # The actors far ahead: inserting stops until the learner catches up.
    assert not rl.can_insert(inserted=1000, sampled=0, m=10)
    assert rl.can_insert(inserted=1000, sampled=2000 - 200 - 50, m=10)
    free = RateLimiter(min_size=10)
    assert free.can_insert(10 ** 9, 0, 10) and free.can_sample(10, 10, 10 ** 9, 10)
    with pytest.raises(ValueError, match="samples_per_insert"):
        RateLimiter(samples_per_insert=0)


def _batch(m: int, net_cfg, actor_id: int = 0, **over) -> TransitionBatch:
    f = transition_fields(net_cfg)
    arrays = {k: np.zeros((m, *spec.shape), dtype=torch.empty((), dtype=spec.dtype).numpy().dtype) for k, spec in f.items()}
    arrays.update(over)
    return TransitionBatch(**arrays, priorities=np.ones(m, np.float32), actor_id=actor_id, weight_version=3,
                           env_steps=m * 10)


@pytest.mark.slow
def test_replay_shard_validates_chunks_and_counts(tmp_path):
    shard = ReplayShard(0, ShardConfig(capacity=64, fields=transition_fields(SMOKE.net), shared=False))
    assert shard.add(_batch(10, SMOKE.net)) == 10
    bad = _batch(4, SMOKE.net)
    bad.reward[2] = np.nan
    with pytest.raises(ReplayError, match="reward.*NaN"):
        shard.add(bad)
    wrong = _batch(4, SMOKE.net, micro=np.zeros((4, 1, 1, 1), np.float32))
    with pytest.raises(ReplayError, match="micro"):
        shard.add(wrong)
    with pytest.raises(ReplayError, match="TransitionBatch"):
        shard.add({"reward": np.zeros(3)})
    st = shard.stats()
    import ray
    assert not ray.is_initialized() and st.node_id == "local"  # a plain shard starts no Ray cluster
    assert st.size == 10 and st.inserted == 10  # nothing of a refused chunk was written
    assert st.inserted_by_actor == {0: 10} and st.actor_versions == {0: 3} and st.env_steps == 100
    out = shard.sample(8)
    assert out.macro.shape == (8, SMOKE.net.macro_features) and isinstance(out.macro, np.ndarray)
    assert shard.update_priorities(out.update(np.full(8, 5.0))) == 8
    with pytest.raises(ReplayError, match="PriorityUpdate"):
        shard.update_priorities((out.indices, out.generations, np.full(8, 5.0)))


def test_actor_epsilon_ladder_is_apex_per_explorer():
    a = AgentConfig()
    # One shard per actor: exactly eps_i = 0.4^(1 + 7 i/(M-1)).
    M = 8
    got = np.concatenate([actor_epsilons(a, i, M, 1) for i in range(M)])
    want = np.array([0.4 ** (1 + 7 * i / (M - 1)) for i in range(M)])
    np.testing.assert_allclose(got, want)
    # S shards per actor: actor i takes its S consecutive rungs of the M*S ladder.
    e1 = actor_epsilons(a, 1, 4, 3)
    np.testing.assert_allclose(e1, np.asarray(a.epsilons(12))[3:6])


def test_rollout_actor_emits_typed_chunks_with_priorities():
    cfg = dataclasses.replace(SMOKE, sim=SMOKE.sim.replace(num_shards=4))
    act = RolloutActor(1, 2, cfg, replay_shards=["unused"], chunk_transitions=8)
    out = []
    for i in range(cfg.agent.n_step + 1):
        out.append(act.step())
    # n-step transitions start after n decisions (4 shards each); 8 make a chunk.
    assert all(b is None for b in out[:-1])
    b = out[-1]
    assert isinstance(b, TransitionBatch) and b.actor_id == 1 and len(b) == 8
    assert b.priorities.shape == (8,) and np.isfinite(b.priorities).all() and (b.priorities >= 0).all()
    assert b.env_steps == act.worker.env_steps == (cfg.agent.n_step + 1) * 4 * cfg.agent.decision_ticks
    np.testing.assert_allclose(act.eps, actor_epsilons(cfg.agent, 1, 2, 4))
    with pytest.raises(ValueError, match="actor_id"):
        RolloutActor(2, 2, cfg, replay_shards=["x"])
    with pytest.raises(ValueError, match="replay shard"):
        RolloutActor(0, 2, cfg, replay_shards=[])


def test_config_overrides_parse_types_and_name_bad_keys():
    cfg = apply_overrides(SMOKE, ["agent.lr=0.01", "sim.num_shards=3", "minutes=0.5", "agent.eps_base=0.2"])
    assert cfg.agent.lr == 0.01 and cfg.sim.num_shards == 3 and cfg.minutes == 0.5
    assert cfg.agent.eps_base == 0.2
    with pytest.raises(ConfigError, match="no field 'lrr'"):
        apply_overrides(SMOKE, ["agent.lrr=1"])
    with pytest.raises(ConfigError, match="not a valid int"):
        apply_overrides(SMOKE, ["agent.batch_size=big"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides(SMOKE, ["agent.lr"])
    with pytest.raises(ConfigError, match="agent.lr must be > 0"):
        apply_overrides(SMOKE, ["agent.lr=-1"])


def test_config_overrides_parse_optional_and_tuple_fields_by_declared_type():
    # Optional[int] fields used to take the raw string (final_eval_ticks=600 -> "600", which
    # failed only at the end of a training run); tuples could not be set at all.
    cfg = apply_overrides(SMOKE, ["final_eval_ticks=600", "max_env_ticks=none", "pref.oracle_weights=10,1,0.5",
                                  "sim.slo_factor=1.5,2,3,4"])
    assert cfg.final_eval_ticks == 600 and isinstance(cfg.final_eval_ticks, int)
    assert cfg.max_env_ticks is None
    assert cfg.pref.oracle_weights == (10.0, 1.0, 0.5)
    assert cfg.sim.slo_factor == (1.5, 2.0, 3.0, 4.0)
    with pytest.raises(ConfigError, match="'final_eval_ticks': 'soon' is not a valid int"):
        apply_overrides(SMOKE, ["final_eval_ticks=soon"])
    with pytest.raises(ConfigError, match="2 comma-separated values, the field takes 3"):
        apply_overrides(SMOKE, ["pref.oracle_weights=1,2"])
    with pytest.raises(ConfigError, match="cannot be set from the command line"):
        apply_overrides(SMOKE, ["sim.trace=x.csv"])


def _validate(cfg: dict) -> dict:
    """The checks `ray up` runs on a config before it talks to the cloud provider
    (`_bootstrap_config`: prepare_config, then the JSON-schema validation)."""
    from ray.autoscaler._private.util import prepare_config, validate_config
    c = prepare_config(copy.deepcopy(cfg))
    validate_config(c)
    return c


def test_cluster_yaml_validates_and_declares_the_placement_resources():
    from apex_bdq.ray_runner import LEARNER_RESOURCE, ROLLOUT_RESOURCE
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    c = _validate(cfg)
    types = c["available_node_types"]
    rollout = [n for n, t in types.items() if ROLLOUT_RESOURCE in t["resources"]]
    learner = [n for n, t in types.items() if LEARNER_RESOURCE in t["resources"]]
    assert rollout and learner and c["head_node_type"] not in rollout + learner
    assert all(types[n]["resources"].get("GPU", 0) >= 1 for n in learner)
    assert all("GPU" not in types[n]["resources"] for n in rollout)
    setup = " ".join(c["setup_commands"])
    assert "pip install" in setup and "apex-bdq" in setup
    head = " ".join(c["head_start_ray_commands"])
    workers = " ".join(c["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "RAY_AUTH_MODE=disabled" not in head + workers
    assert "RAY_AUTH_MODE=token ~/venv/bin/ray start --head" in head  # token authentication on every node
    assert "RAY_AUTH_MODE=token ~/venv/bin/ray start --address" in workers
    assert c["file_mounts"]["/home/ubuntu/.ray/auth_token"] == "~/.ray/auth_token"  # the same token everywhere


@pytest.mark.parametrize("breakage", ["typo_in_node_type", "unknown_top_level", "bad_type"])
def test_cluster_yaml_with_a_broken_key_fails_validation(breakage):
    import jsonschema
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    if breakage == "typo_in_node_type":
        cfg["available_node_types"]["cpu_rollout"]["max_worker"] = cfg["available_node_types"]["cpu_rollout"].pop(
            "max_workers")
    elif breakage == "unknown_top_level":
        cfg["head_node_types"] = "head"
    else:
        cfg["max_workers"] = "many"
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        _validate(cfg)


@pytest.mark.slow
def test_replay_shard_snapshot_round_trips_and_refuses_what_does_not_fit(tmp_path):
    fields = transition_fields(SMOKE.net)
    cfg = ShardConfig(capacity=64, fields=fields, shared=False, snapshot_dir=str(tmp_path), seed=5)
    shard = ReplayShard(0, cfg)
    rng = np.random.default_rng(0)
    shard.add(_batch(40, SMOKE.net, reward=rng.normal(size=40).astype(np.float32)))
    shard.update_priorities(PriorityUpdate(np.arange(8), np.arange(8), np.linspace(0.1, 5.0, 8).astype(np.float32)))
    got = shard.snapshot()
    assert got["size"] == 40 and (tmp_path / "replay_shard0.pt").exists()
    # A fresh shard told to load it (a resume) has the same memory, priorities and sampler.
    back = ReplayShard(0, dataclasses.replace(cfg, load_snapshot=True))
    assert back.stats().restored_size == 40 and back.stats().inserted == 40
    torch.testing.assert_close(back.replay.storage["reward"][:40], shard.replay.storage["reward"][:40])
    torch.testing.assert_close(back.replay.tree.leaves, shard.replay.tree.leaves)
    a, b = shard.sample(16), back.sample(16)
    np.testing.assert_array_equal(a.indices, b.indices)
    # Without load_snapshot a fresh shard starts empty.
    assert ReplayShard(0, cfg).stats().size == 0
    # Another capacity, a corrupt file: refused with the reason, nothing loaded.
    with pytest.raises(ReplayError, match="capacity 64"):
        ReplayShard(0, dataclasses.replace(cfg, capacity=32, load_snapshot=True))
    (tmp_path / "replay_shard0.pt").write_bytes(b"torn")
    with pytest.raises(ReplayError, match="unreadable"):
        ReplayShard(0, dataclasses.replace(cfg, load_snapshot=True))
    with pytest.raises(ValueError, match="need a snapshot directory"):
        ShardConfig(capacity=8, snapshot_every_s=5.0)
    with pytest.raises(ValueError, match="on-restart"):
        ShardConfig(capacity=8, on_restart="sometimes")
    with pytest.raises(ReplayError, match="no snapshot_dir"):
        ReplayShard(1, ShardConfig(capacity=8, fields=fields, shared=False)).snapshot()


def test_cluster_settings_are_part_of_the_config_tree():
    """One definition of each cluster default (ClusterConfig), settable with --set
    cluster.NAME, validated with the flag's name, and recorded with the run's config (what
    its checkpoints store); configs saved before it existed load with the defaults."""
    from apex_bdq.checkpoint import config_to_dict
    from apex_bdq.config import ClusterConfig, ConfigError, apply_overrides, train_config_from_dict
    from apex_bdq.ray_runner import ApexRun
    cfg = apply_overrides(SMOKE, ["cluster.num_actors=3", "cluster.samples_per_insert=2"])
    assert cfg.cluster.num_actors == 3 and cfg.cluster.limiter_slack == 4096 * 2
    assert train_config_from_dict(config_to_dict(cfg)) == cfg
    old = config_to_dict(SMOKE)
    del old["cluster"]
    assert train_config_from_dict(old).cluster == ClusterConfig()
    spec = ClusterConfig(num_actors=1, backend="accelerate")
    assert ApexRun(cfg, spec).cfg.cluster == spec  # what the run's checkpoints record
    assert ApexRun(cfg).spec == cfg.cluster
    with pytest.raises(ConfigError, match="--num-learners"):
        ClusterConfig(num_learners=0)
    with pytest.raises(ConfigError, match="unknown backend 'zero3'"):
        apply_overrides(SMOKE, ["cluster.backend=zero3"])
    with pytest.raises(ConfigError, match="--replay-snapshot-dir"):
        ClusterConfig(replay_snapshot_every_s=5.0)


def test_weight_store_meta_is_typed():
    """The run's network config reaches Serve as a StoreMeta, never a dict of strings."""
    from apex_bdq.messages import StoreMeta
    from learner.weight_store import WeightStore
    meta = StoreMeta(net=SMOKE.net, branches=tuple(SMOKE.sim.branch_names))
    assert WeightStore(meta).meta() is meta and WeightStore().meta() is None
    with pytest.raises(TypeError, match="StoreMeta, got dict"):
        WeightStore({"net": {}})
