"""Ape-X on a real local Ray cluster, at small size: every backend trains, a 2-worker DDP
group equals one learner, back-pressure, placement across two nodes."""

import dataclasses
import time

import numpy as np
import pytest
import torch

from apex_bdq.checkpoint import load_policy
from launch import train
from launch.distributed import ApexRun, ClusterSpec, copy_checkpoint, initial_weights

SMOKE = train.PRESETS["smoke"]


def _run(spec: ClusterSpec, tmp_path, minutes: float = 3.0, max_updates=40, cfg=SMOKE) -> dict:
    """Until the learner has made `max_updates` updates (minutes is only a safety cap: a
    loaded 2-core machine can take tens of seconds to start actors and Train workers)."""
    spec = dataclasses.replace(spec, storage_path=str(tmp_path / "ray_train"), checkpoint_every_s=3.0)
    run = ApexRun(cfg, spec)
    try:
        out = run.run(minutes=minutes, max_updates=max_updates)
    finally:
        run.shutdown()
    return out


@pytest.mark.parametrize("backend", ["ddp", "deepspeed", "accelerate"])
def test_each_backend_trains_for_real(ray_local, tmp_path, backend):
    out = _run(ClusterSpec(num_actors=2, num_replay_shards=1, num_learners=1, backend=backend, actor_cpus=1,
                           learner_cpus=1, publish_every=10), tmp_path)
    st = out["status"]
    lr = st["learner"]
    assert lr["updates"] == 40, lr
    assert np.isfinite(lr["td_loss"])
    assert lr["route"] == "shared-memory"  # the learner attached to the shard on its node
    assert lr["backend"] == backend
    assert st["inserted"] > 0 and st["sampled"] >= lr["updates"] * SMOKE.agent.batch_size
    assert st["version"] == 40 and all(a["weight_version"] >= 0 for a in st["actors"])  # actors pulled weights
    assert {a["actor"] for a in out["actor_stats"]} == {0, 1}
    ck = copy_checkpoint(out["result"], tmp_path / "final.pt")
    pol = load_policy(ck, SMOKE.sim)  # launch.evaluate --policy checkpoint:PATH reads it
    assert pol.net is not None and pol.net.cfg == SMOKE.net


def test_two_worker_ddp_equals_one_learner_on_the_same_batches(ray_local, tmp_path):
    """Each of 2 DDP workers takes half of every global batch; averaged gradients make the
    group's step the single learner's step on the whole batch."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from apex_bdq.checkpoint import config_to_dict
    from learner.train_loop import train_loop_per_worker
    cfg = dataclasses.replace(SMOKE, agent=dataclasses.replace(SMOKE.agent, batch_size=16, target_update=3))
    n = cfg.net
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(6):
        B = 16
        data = {"macro": rng.normal(size=(B, n.macro_features)).astype(np.float32),
                "micro": rng.normal(size=(B, n.num_classes, n.history, n.micro_features)).astype(np.float32),
                "action": rng.integers(0, n.sub_actions, size=(B, n.num_branches)).astype(np.uint8),
                "reward": rng.normal(size=B).astype(np.float32), "discount": np.full(B, 0.9, np.float32)}
        data["next_macro"] = rng.normal(size=(B, n.macro_features)).astype(np.float32)
        data["next_micro"] = rng.normal(size=(B, n.num_classes, n.history, n.micro_features)).astype(np.float32)
        batches.append({"data": data, "weights": rng.uniform(0.2, 1, size=B).astype(np.float32)})
    params = {}
    for world in (1, 2):
        out = tmp_path / f"params_{world}.pt"
        TorchTrainer(train_loop_per_worker,
                     train_loop_config={"cfg": config_to_dict(cfg), "backend": "ddp", "fixed_batches": batches,
                                        "minutes": 5, "params_out": str(out), "checkpoint_every_s": 1e9},
                     scaling_config=ScalingConfig(num_workers=world, resources_per_worker={"CPU": 1}),
                     run_config=RunConfig(storage_path=str(tmp_path / f"rt{world}"), name=f"eq{world}")).fit()
        params[world] = torch.load(out)
    init = {k: v for k, v in _initial_params(cfg).items()}
    moved = 0
    for k in params[1]:
        torch.testing.assert_close(params[2][k], params[1][k], rtol=1e-4, atol=1e-5)
        moved += int(not torch.equal(params[1][k], init[k]))
    assert moved > 0  # the batches did train the network


def _initial_params(cfg):
    from apex_bdq.networks import BDQNetwork
    torch.manual_seed(cfg.seed)
    return BDQNetwork(cfg.net).state_dict()


@pytest.mark.parametrize("initial_policy", ["network", "default"])
def test_actors_start_with_the_learners_initial_weights(ray_local, tmp_path, initial_policy):
    """Before any learner exists the weight store holds version 0 = the network the Train
    learner starts from, so the first decisions (and the replay they fill) are the learner's
    own policy, not some other random network's (this made the Ape-X run over-provision);
    with agent.initial_policy=default both start from the platform's default setting."""
    cfg = dataclasses.replace(SMOKE, agent=dataclasses.replace(SMOKE.agent, initial_policy=initial_policy))
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from apex_bdq.checkpoint import config_to_dict
    from learner.train_loop import train_loop_per_worker
    from learner.weight_store import load_numpy_state
    from apex_bdq.networks import BDQNetwork
    out = tmp_path / "params_start.pt"  # no batches: the learner's parameters as it starts
    TorchTrainer(train_loop_per_worker,
                 train_loop_config={"cfg": config_to_dict(cfg), "backend": "ddp", "fixed_batches": [],
                                    "minutes": 5, "params_out": str(out), "checkpoint_every_s": 1e9},
                 scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                 run_config=RunConfig(storage_path=str(tmp_path / "rt"), name="start")).fit()
    learner_start = torch.load(out)
    init = initial_weights(cfg)
    assert set(init) == set(learner_start)
    assert (np.abs(init["head.w2"]).sum() == 0) == (initial_policy == "default")  # the default start: zeroed layer
    for k, v in learner_start.items():
        np.testing.assert_array_equal(init[k], v.numpy())
    run = ApexRun(cfg, ClusterSpec(num_actors=1, actor_cpus=1, storage_path=str(tmp_path / "rt2")))
    try:
        run.start()
        version, (ref,) = ray.get(run.store.get_if_newer.remote(-1))
        assert version == 0
        net = BDQNetwork(cfg.net)
        load_numpy_state(net, ray.get(ref))
        for k, v in net.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), init[k])
        deadline = time.time() + 60
        while ray.get(run.actors[0].stats.remote())["weight_version"] < 0 and time.time() < deadline:
            time.sleep(0.2)
        assert ray.get(run.actors[0].stats.remote())["weight_version"] == 0  # acting with them
    finally:
        ray.get(run.store.set_stop.remote(True))
        for a in run.actors:
            ray.kill(a, no_restart=True)
        run.shutdown()


def test_rollout_actor_backpressure_bounds_chunks_in_flight(ray_local):
    """A replay shard that is slow to accept: the actor never has more than max_in_flight
    chunks outstanding, and every chunk it sent arrives (nothing accepted is lost)."""
    import ray

    from actors.rollout_actor import remote_actor_class

    @ray.remote(num_cpus=0, max_concurrency=8)
    class SlowShard:
        def __init__(self):
            self.active = 0
            self.peak = 0
            self.rows = 0

        def add(self, batch):
            self.active += 1
            self.peak = max(self.peak, self.active)
            time.sleep(0.2)
            self.rows += len(batch)
            self.active -= 1
            return self.rows

        def stats(self):
            return self.peak, self.rows

    shard = SlowShard.remote()
    cfg = dataclasses.replace(SMOKE, sim=SMOKE.sim.replace(num_shards=2))
    Actor = remote_actor_class(num_cpus=0.5)
    act = Actor.remote(0, 1, cfg, [shard], None, 2, 10, 2)  # a chunk every decision
    st = ray.get(act.run.remote(max_decisions=40))
    peak, rows = ray.get(shard.stats.remote())
    assert peak <= 2
    assert rows == st["transitions_sent"] > 0
    assert st["backpressure_wait_s"] > 0.5


def test_two_node_cluster_places_components_by_node_type(tmp_path):
    """Nodes built like cluster.yaml's types: rollout actors land on the rollout node,
    learner and replay shards on the learner node, and training runs across them."""
    import ray
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        rollout_node = cluster.add_node(num_cpus=3, resources={"rollout": 16})
        learner_node = cluster.add_node(num_cpus=2, resources={"learner": 4})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        out = _run(ClusterSpec(num_actors=2, num_replay_shards=1, num_learners=1, actor_cpus=1, learner_cpus=1,
                               publish_every=10), tmp_path)
        st = out["status"]
        assert {a["node_id"] for a in st["actors"]} == {rollout_node.node_id}
        assert {s["node_id"] for s in st["shards"]} == {learner_node.node_id}
        assert st["learner"]["node_id"] == learner_node.node_id
        assert st["learner"]["route"] == "shared-memory"
        assert st["learner"]["updates"] == 40 and st["inserted"] > 0
    finally:
        ray.shutdown()
        cluster.shutdown()
