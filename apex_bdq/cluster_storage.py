"""Where a run on more than one node may keep what must outlive a node: checkpoints (Ray Train
storage) and the feedback log.

A path on one node's disk (the default temporary folder, or any local filesystem) is seen by
that node only: a learner group restarted on another node, or a preference actor that lands
elsewhere, would not find it. On a multi-node cluster a run therefore refuses such a path
with the reason, and takes shared storage as it is: a URI (`s3://`, `gs://`, ... — what
pyarrow's filesystems read; never turned into a local path) or a path on a network
filesystem (NFS, Lustre, CephFS, a FUSE mount of a bucket ...), recognised from /proc/mounts.
`cluster.storage_is_shared=true` vouches for a shared filesystem this check does not know.

The feedback log is a local-file API (append, fsync, an exclusive lock), so on a multi-node
cluster it must be on a shared filesystem: by default it goes next to the checkpoints when
those are on one, and a run with preferences refuses to start otherwise.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from apex_bdq.config import ConfigError

NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "cephfs", "glusterfs",
              "ocfs2", "gfs2", "panfs", "wekafs", "orangefs", "9p", "virtiofs", "afs", "davfs"}
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # what `ray up` leaves on the head of an autoscaling cluster


def is_uri(path: str) -> bool:
    return "://" in path


def fs_type(path: str, mounts: str = "/proc/mounts") -> str:
    """The filesystem type holding `path` (its nearest existing ancestor), from /proc/mounts;
    "" when unknown."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    p = p.resolve()
    best, kind = "", ""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (str(p) == mnt or str(p).startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def is_shared_fs(path: str) -> bool:
    kind = fs_type(path)
    return kind in NETWORK_FS or kind.startswith("fuse.") or kind == "fuse"


def multi_node(nodes_alive: Optional[int] = None) -> tuple[bool, str]:
    """Whether the connected Ray cluster has (or will have) more than one node, and why."""
    if nodes_alive is None:
        import ray
        nodes_alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    if nodes_alive > 1:
        return True, f"this Ray cluster has {nodes_alive} nodes"
    if os.path.exists(os.path.expanduser(BOOTSTRAP_CONFIG)):
        return True, f"this Ray cluster autoscales (`ray up`: {BOOTSTRAP_CONFIG} on the head)"
    return False, "one node"


def check_storage(storage_path: Optional[str], trusted: bool, why: str) -> str:
    """The Ray Train storage of a multi-node run: a URI or a shared path as given; a node-local
    one (or none) is refused naming the way out."""
    how = ("give --storage-path s3://BUCKET/PATH, gs://BUCKET/PATH or a folder on a shared filesystem (NFS ...), "
           "or --set cluster.storage_is_shared=true for a shared filesystem this check does not recognise")
    if not storage_path:
        raise ConfigError(f"{why}: checkpoints in the default temporary folder stay on the node that writes them "
                          f"(a learner restarted elsewhere would not find them); {how}")
    if is_uri(storage_path) or trusted or is_shared_fs(storage_path):
        return storage_path
    raise ConfigError(f"{why}: --storage-path {storage_path!r} is on a node-local filesystem "
                      f"({fs_type(storage_path) or 'unknown type'}); {how}")


def feedback_log_path(log_path: Optional[str], storage_path: Optional[str], trusted: bool, run_name: str,
                      why: str) -> str:
    """The feedback log of a multi-node run with preferences: pref.log_path on a shared
    filesystem, else next to the checkpoints when those are on one; refused otherwise."""
    how = ("set pref.log_path to a file on a shared filesystem (NFS ...) every node mounts at the same path, "
           "or --set cluster.storage_is_shared=true if it is one this check does not recognise")
    if log_path:
        if is_uri(log_path):
            raise ConfigError(f"pref.log_path {log_path!r}: the feedback log is a file (appended, fsynced, locked), "
                              f"not an object-store URI; {how}")
        if trusted or is_shared_fs(log_path):
            return os.path.abspath(log_path)
        raise ConfigError(f"{why}: pref.log_path {log_path!r} is on a node-local filesystem "
                          f"({fs_type(log_path) or 'unknown type'}): a preference actor restarted on another node "
                          f"would not find the pairs already given; {how}")
    if storage_path and not is_uri(storage_path) and (trusted or is_shared_fs(storage_path)):
        return os.path.join(os.path.abspath(storage_path), "feedback", f"{run_name}.log")
    raise ConfigError(f"{why}: the feedback log needs a shared filesystem and neither pref.log_path nor the "
                      f"checkpoint storage ({storage_path or 'the default temporary folder'}) is one; {how}")
