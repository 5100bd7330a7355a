"""Cluster runs beyond one node (issue 26), on a real `ray.cluster_utils.Cluster` (a head and two workers):
node-local checkpoint storage and feedback logs are refused with the way out, URIs are kept
as they are, the feedback log defaults to shared storage, and the preference actor comes back
with its log on whichever node it lands. (`pip install .` importing everything a node needs:
tests/test_packaging.py.)"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from apex_bdq.cluster_storage import check_storage, feedback_log_path, fs_type, is_shared_fs
from apex_bdq.config import ConfigError, apply_overrides
from apex_bdq.preference import PREFERENCE_METRICS, Segment
from apex_bdq.presets import PRESETS


def test_filesystem_types_from_the_mount_table(tmp_path):
    shared, bucket, other = tmp_path / "shared", tmp_path / "bucket", tmp_path / "sharedother"
    for d in (shared, bucket, other):
        d.mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"overlay / overlay rw 0 0\nserver:/export {shared} nfs4 rw 0 0\n"
                      f"bucket {bucket} fuse.s3fs rw 0 0\n")
    assert fs_type(str(shared / "runs" / "x"), str(mounts)) == "nfs4"  # not created yet: its mount counts
    assert fs_type(str(other), str(mounts)) == "overlay"  # a prefix of a name is not its parent
    assert fs_type(str(bucket / "a"), str(mounts)) == "fuse.s3fs"
    assert not is_shared_fs(str(tmp_path))  # this machine's temp folder is node-local


@pytest.mark.ray
def test_a_two_node_run_needs_shared_storage_and_the_feedback_actor_follows_its_log(own_ray_cluster, tmp_path):
    ray = own_ray_cluster
    from ray.cluster_utils import Cluster

    from actors.preference_actor import remote_preference_class
    from apex_bdq.ray_runner import ApexRun
    from launch import train

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    # two worker nodes that may hold the preference actor (resource `pref`); the head may not
    workers = [cluster.add_node(num_cpus=1, resources={"pref": 1}) for _ in range(2)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        cfg = PRESETS["smoke"]
        # storage: the default temp folder and a node-local folder are refused with the way out
        for storage in (None, str(tmp_path / "ckpt")):
            run = ApexRun(cfg, cfg.cluster.replace(storage_path=storage))
            with pytest.raises(ConfigError, match=r"\d nodes.*(temporary folder|node-local).*s3://"):
                run._check_storage()
        # ... also from the command line, before anything starts
        assert train.main(["--address", cluster.address, "--preset", "smoke", "--storage-path",
                           str(tmp_path / "ckpt"), "--quiet"]) == 2
        # a URI is storage as it is (never made a local path), and then the feedback log of a run with
        # preferences has nowhere shared to go by default: refused
        uri = "s3://some-bucket/apex/runs"
        run = ApexRun(cfg, cfg.cluster.replace(storage_path=uri))
        run._check_storage()
        assert run.multi_node and check_storage(uri, False, "x") == uri
        pref_cfg = apply_overrides(cfg, ["pref.enabled=true"])
        pref_cfg = dataclasses.replace(pref_cfg, pref=dataclasses.replace(pref_cfg.pref, log_path=None))
        with pytest.raises(ConfigError, match="feedback log needs a shared filesystem"):
            ApexRun(pref_cfg, cfg.cluster.replace(storage_path=uri))._check_storage()
        with pytest.raises(ConfigError, match="not an object-store URI"):
            feedback_log_path("s3://b/feedback.log", uri, False, "r", "x")
        # shared storage (vouched for: this machine has no NFS): the log goes next to the checkpoints
        shared = str(tmp_path / "shared")
        run = ApexRun(pref_cfg, cfg.cluster.replace(storage_path=shared, storage_is_shared=True))
        run._check_storage()
        assert run.cfg.pref.log_path == f"{shared}/feedback/{run.run_name}.log"

        # The preference actor on a worker node, then that node gone: it restarts on the other
        # one and replays the same log (a shared path), losing no accepted pair.
        net = pref_cfg.net
        rng = np.random.default_rng(0)
        segs = [Segment(id=f"s{i}", macro=rng.random((4, net.macro_features), dtype=np.float32),
                        micro=rng.random((4, net.num_classes, net.history, net.micro_features), dtype=np.float32),
                        action=rng.integers(0, net.sub_actions, (4, net.num_branches)),
                        metrics={m: float(rng.random()) for m in PREFERENCE_METRICS}) for i in range(6)]
        log = run.cfg.pref.log_path
        actor = remote_preference_class(max_restarts=-1).options(
            num_cpus=0, max_concurrency=1, resources={"pref": 0.01}).remote(net, pref_cfg.pref, log)
        ray.get(actor.add_segments.remote(segs))
        assert ray.get(actor.rank_many.remote([{"a": "s0", "b": "s1"}, {"a": "s2", "b": "s3", "label": 0.5}])) == [
            "accepted", "accepted"]
        first = ray.get(actor.where.remote())
        (gone,) = [w for w in workers if w.node_id == first["node"]]
        cluster.remove_node(gone)  # its node is gone: Ray restarts it on the other worker node
        from _util import wait_for
        st = wait_for(lambda: ray.get(actor.stats.remote(), timeout=10), 120, "the preference actor back",
                      ignore=(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError), interval=1.0)
        assert st.replayed_pairs == 2 and st.pid != first["pid"]
        assert ray.get(actor.where.remote())["node"] != first["node"]
    finally:
        ray.shutdown()
        cluster.shutdown()
