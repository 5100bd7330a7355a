"""Replay memory that two processes on one node use in place.

A replay shard actor owns the replay; the learner worker on the same node attaches to it
and samples and updates priorities without any copy through Ray's object store or an RPC
per batch (`../shared/KNOWN.md`: 3-8 ms a batch that way, against ~0.3 ms in-process):

- CPU: every tensor of the replay (packed storage, generations, sum-tree levels, counters)
  is carved out of one file in /dev/shm mapped MAP_SHARED by both processes
  (`torch.from_file(..., shared=True)`); attaching maps the same file with the same layout.
- CUDA: the tensors are allocated on the GPU by the owner and exported as CUDA IPC handles
  (`torch.multiprocessing.reductions.reduce_tensor`, the mechanism torch.multiprocessing uses);
  the attaching process on the same GPU rebuilds them as views of the same device memory.

Both sides serialise their operations with an exclusive `flock` on a lock file on the node
(plus a thread lock, since the learner samples from a prefetch thread), so an insert, a
sample and a priority update never interleave. A handle (`SharedSpec`) is plain picklable
data and travels through Ray like any argument.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from typing import Optional

import torch

_ALIGN = 64


def shm_dir() -> str:
    """Where shared replay files live: /dev/shm when present (RAM-backed), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ProcessLock:
    """A re-entrant lock held across threads of this process and across processes of the node
    (an exclusive flock on `path`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._thread = threading.RLock()
        self._fd: Optional[int] = None
        self._depth = 0

    def __enter__(self) -> "ProcessLock":
        self._thread.acquire()
        if self._depth == 0:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread.release()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self):
        raise TypeError("ProcessLock is per process: pass the SharedSpec, not the lock")


@dataclass
class SharedSpec:
    """What another process on the node needs to attach: the backing file (CPU) or CUDA IPC
    handles, the layout, and the lock file."""

    device: str
    lock_path: str
    path: Optional[str] = None  # CPU: the /dev/shm file
    nbytes: int = 0
    layout: dict = field(default_factory=dict)  # name -> (offset, shape, dtype name)
    cuda_handles: dict = field(default_factory=dict)  # name -> (rebuild fn, args)
    node_id: Optional[str] = None
    owner_pid: int = 0


class SharedArena:
    """Allocates a fixed set of named tensors that another process on the node can map.

    The owner calls `SharedArena.create(device).allocate(plan)` with plan = [(name, shape,
    dtype), ...] and hands `spec()` to the other process, which calls
    `SharedArena.attach(spec).allocate(plan)` with the same plan and gets views of the same
    memory (a differing plan is refused)."""

    def __init__(self, device: torch.device, lock_path: str, path: Optional[str] = None,
                 spec: Optional[SharedSpec] = None) -> None:
        self.device = device
        self.lock = ProcessLock(lock_path)
        self.path = path
        self._spec = spec
        self.tensors: dict[str, torch.Tensor] = {}
        self._layout: dict = {}
        self._nbytes = 0

    @property
    def attached(self) -> bool:
        return self._spec is not None

    @classmethod
    def create(cls, device: torch.device | str = "cpu", tag: str = "replay") -> "SharedArena":
        d = torch.device(device)
        stem = os.path.join(shm_dir(), f"apex_bdq_{tag}_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        return cls(d, stem + ".lock", stem + ".mem" if d.type == "cpu" else None)

    @classmethod
    def attach(cls, spec: SharedSpec) -> "SharedArena":
        if spec.device == "cpu":
            if not spec.path or not os.path.exists(spec.path):
                raise FileNotFoundError(f"shared replay file {spec.path!r} is gone (was its shard actor restarted, "
                                        "or is it on another node?)")
            if os.path.getsize(spec.path) < spec.nbytes:
                raise ValueError(f"shared replay file {spec.path!r} is smaller than its layout ({spec.nbytes} bytes)")
        return cls(torch.device(spec.device), spec.lock_path, spec.path, spec)

    def allocate(self, plan: list[tuple[str, tuple, torch.dtype]]) -> dict[str, torch.Tensor]:
        names = [p[0] for p in plan]
        if len(set(names)) != len(names):
            raise ValueError(f"shared tensor names repeat: {names}")
        if self.device.type == "cuda":
            if self.attached:
                for name, shape, dtype in plan:
                    if name not in self._spec.cuda_handles:
                        raise KeyError(f"shared replay has no tensor {name!r}")
                    fn, args = self._spec.cuda_handles[name]
                    self.tensors[name] = self._check(name, fn(*args), shape, dtype)
            else:
                for name, shape, dtype in plan:
                    self.tensors[name] = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
            return dict(self.tensors)
        layout, off = {}, 0
        for name, shape, dtype in plan:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            layout[name] = (off, tuple(int(x) for x in shape), str(dtype))
            off += -(-max(n, 1) // _ALIGN) * _ALIGN
        if self.attached:
            if layout != self._spec.layout:
                raise ValueError("this side's replay layout differs from the shared one (replay configs differ): "
                                 f"{layout} vs {self._spec.layout}")
        else:
            with open(self.path, "wb") as f:
                f.truncate(off)  # sparse, zero-filled
        base = torch.from_file(self.path, shared=True, size=off, dtype=torch.uint8)
        # Huge pages where the kernel gives them to shared memory (shmem_enabled=advise or
        # within_size); otherwise a no-op. See `_memory.py`.
        from replay_server._memory import advise_hugepages
        advise_hugepages(base)
        for name, shape, dtype in plan:
            o, s_, _ = layout[name]
            n = torch.Size(s_).numel() * torch.empty((), dtype=dtype).element_size()
            self.tensors[name] = base[o:o + n].view(dtype).view(s_)
        self._layout, self._nbytes = layout, off
        return dict(self.tensors)

    @staticmethod
    def _check(name: str, t: torch.Tensor, shape, dtype) -> torch.Tensor:
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"shared tensor {name!r} is {list(t.shape)} {t.dtype}; this side expects "
                             f"{list(shape)} {dtype} (replay configs differ)")
        return t

    def spec(self, node_id: Optional[str] = None) -> SharedSpec:
        if self.attached:
            return self._spec
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor
            return SharedSpec(device=str(self.device), lock_path=self.lock.path,
                              cuda_handles={k: reduce_tensor(t) for k, t in self.tensors.items()},
                              node_id=node_id, owner_pid=os.getpid())
        return SharedSpec(device="cpu", lock_path=self.lock.path, path=self.path, nbytes=self._nbytes,
                          layout=dict(self._layout), node_id=node_id, owner_pid=os.getpid())

    def unlink(self) -> None:
        """Remove the backing and lock files (existing mappings stay valid until dropped)."""
        self.lock.close()
        for p in (self.path, self.lock.path):
            if p and os.path.exists(p):
                try:
                    os.unlink(p)
                except OSError:
                    pass


