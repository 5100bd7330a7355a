"""Ape-X on a real local Ray cluster, at small size: every backend trains, a 2-worker DDP
group equals one learner, back-pressure, placement across two nodes."""

import dataclasses
import time

import numpy as np
import pytest
import torch
from _util import wait_for

from apex_bdq.checkpoint import load_policy
from apex_bdq.presets import PRESETS
from apex_bdq.config import ClusterConfig
from apex_bdq.ray_runner import ApexRun, copy_checkpoint, initial_weights

pytestmark = pytest.mark.ray

SMOKE = PRESETS["smoke"]


def _run(spec: ClusterConfig, tmp_path, minutes: float = 3.0, max_updates=40, cfg=SMOKE) -> dict:
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
    out = _run(ClusterConfig(num_actors=2, num_replay_shards=1, num_learners=1, backend=backend, actor_cpus=1,
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


def _fixed_batches(cfg, count: int, B: int) -> list:
    from apex_bdq.messages import SampledBatch
    n = cfg.net
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        f = {"macro": rng.normal(size=(B, n.macro_features)).astype(np.float32),
             "micro": rng.normal(size=(B, n.num_classes, n.history, n.micro_features)).astype(np.float32),
             "action": rng.integers(0, n.sub_actions, size=(B, n.num_branches)).astype(np.uint8),
             "reward": rng.normal(size=B).astype(np.float32), "discount": np.full(B, 0.9, np.float32),
             "next_macro": rng.normal(size=(B, n.macro_features)).astype(np.float32),
             "next_micro": rng.normal(size=(B, n.num_classes, n.history, n.micro_features)).astype(np.float32)}
        out.append(SampledBatch(indices=np.arange(B), generations=np.zeros(B, np.int64),
                                weights=rng.uniform(0.2, 1, size=B).astype(np.float32), **f))
    return out


def _ray_train_params(cfg, batches: list, world: int, tmp_path, name: str) -> dict:
    """A Ray Train learner group of `world` workers on `batches`; its final parameters, read
    from the checkpoint it reports (the file launch.evaluate reads)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from apex_bdq.checkpoint import load_checkpoint
    from apex_bdq.messages import LearnerLoopConfig
    from learner.train_loop import CHECKPOINT_NAME, LOOP_KEY, train_loop_per_worker
    lc = LearnerLoopConfig(cfg=cfg, backend="ddp", batches=batches, minutes=5,
                           checkpoint_every_s=1e9)
    result = TorchTrainer(train_loop_per_worker, train_loop_config={LOOP_KEY: lc},
                          scaling_config=ScalingConfig(num_workers=world, resources_per_worker={"CPU": 1}),
                          run_config=RunConfig(storage_path=str(tmp_path / name), name=name)).fit()
    with result.checkpoint.as_directory() as d:
        ck = load_checkpoint(f"{d}/{CHECKPOINT_NAME}")
    assert ck["learner"]["updates"] == len(batches)
    return ck["learner"]["net"]


def test_one_process_learner_and_ray_train_groups_give_the_same_parameters(ray_local, tmp_path):
    """The local trainer's Learner (plain backend) and a Ray Train learner group run the same
    `Learner.step`: on the same fixed batches a one-worker group ends with the one-process
    parameters, and a 2-worker DDP group (each worker on half of every batch, gradients
    averaged) with the same up to float summation order."""
    from learner.learner import Learner
    cfg = dataclasses.replace(SMOKE, agent=dataclasses.replace(SMOKE.agent, batch_size=16, target_update=3))
    batches = _fixed_batches(cfg, 6, 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the Train worker (torch_threads=1): the same summation order
    try:
        local = Learner(cfg.net, cfg.agent, seed=cfg.seed, sim_cfg=cfg.sim)
        for b in batches:
            local.step(b)
    finally:
        torch.set_num_threads(threads)
    one = local.net.state_dict()
    init = _initial_params(cfg)
    assert any(not torch.equal(one[k], init[k]) for k in one)  # the batches did train the network
    for world in (1, 2):
        got = _ray_train_params(cfg, batches, world, tmp_path, f"eq{world}")
        assert set(got) == set(one)
        for k in one:
            if world == 1:
                torch.testing.assert_close(got[k], one[k], rtol=0, atol=0, msg=f"{k}: one worker != one process")
            else:
                torch.testing.assert_close(got[k], one[k], rtol=1e-4, atol=1e-5)


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

    from learner.weight_store import load_numpy_state
    from apex_bdq.networks import BDQNetwork
    learner_start = _ray_train_params(cfg, [], 1, tmp_path, "start")  # no batches: the parameters it starts with
    init = initial_weights(cfg)
    assert set(init) == set(learner_start)
    assert (np.abs(init["head.w2"]).sum() == 0) == (initial_policy == "default")  # the default start: zeroed layer
    for k, v in learner_start.items():
        np.testing.assert_array_equal(init[k], v.numpy())
    run = ApexRun(cfg, ClusterConfig(num_actors=1, actor_cpus=1, storage_path=str(tmp_path / "rt2")))
    try:
        run.start()
        got = ray.get(run.store.get_if_newer.remote(-1))
        assert got.version == 0
        net = BDQNetwork(cfg.net)
        load_numpy_state(net, ray.get(got.ref[0]))
        for k, v in net.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), init[k])
        wait_for(lambda: ray.get(run.actors[0].stats.remote()).weight_version >= 0, 60,
                 "the actor to pull the first weights")
        assert ray.get(run.actors[0].stats.remote()).weight_version == 0  # acting with them
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
    assert rows == st.transitions_sent > 0
    assert st.backpressure_wait_s > 0.5


def test_two_node_cluster_places_components_by_node_type(own_ray_cluster, tmp_path):
    """Nodes built like cluster.yaml's types: rollout actors land on the rollout node,
    learner and replay shards on the learner node, and training runs across them."""
    import ray
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        rollout_node = cluster.add_node(num_cpus=3, resources={"rollout": 16})
        learner_node = cluster.add_node(num_cpus=2, resources={"learner": 4})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        # three nodes of one machine share its disk: vouched for, as a shared filesystem would be
        # (a node-local storage path on a multi-node cluster is refused: tests/test_multinode.py)
        out = _run(ClusterConfig(num_actors=2, num_replay_shards=1, num_learners=1, actor_cpus=1, learner_cpus=1,
                               publish_every=10, storage_is_shared=True), tmp_path)
        st = out["status"]
        assert {a["node_id"] for a in st["actors"]} == {rollout_node.node_id}
        assert {s["node_id"] for s in st["shards"]} == {learner_node.node_id}
        assert st["learner"]["node_id"] == learner_node.node_id
        assert st["learner"]["route"] == "shared-memory"
        assert st["learner"]["updates"] == 40 and st["inserted"] > 0
    finally:
        ray.shutdown()
        cluster.shutdown()
