"""Checkpoints, replay snapshots and caches are written atomically and durably (issue 26):
a unique temp file per writer, fsync of the file and its directory, the old file intact on a
failure; an optimiser state that does not load on resume is warned about and counted."""
from __future__ import annotations

import os
import threading

import pytest

from apex_bdq.config import AgentConfig, NetConfig
from apex_bdq.durable import atomic_write, atomic_write_bytes
from learner.learner import Learner


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "ck.pt"
    atomic_write_bytes(p, b"old")

    def boom(f):
        f.write(b"half of the new")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(p, boom)
    assert p.read_bytes() == b"old" and os.listdir(tmp_path) == ["ck.pt"]
    from apex_bdq.durable import _UMASK
    assert (p.stat().st_mode & 0o777) == 0o666 & ~_UMASK  # the mode open() gives, not mkstemp's 0600


def test_writes_are_fsynced_file_and_directory(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    p = tmp_path / "snap.pt"
    atomic_write_bytes(p, b"x" * 100)
    assert str(tmp_path) in synced  # the directory entry of the rename
    assert any(s.startswith(str(tmp_path / ".snap.pt.")) for s in synced)  # the temp file, before the rename


def test_two_writers_never_share_a_temp_file(tmp_path):
    p = tmp_path / "shared.bin"
    errors = []

    def writer(tag: bytes):
        try:
            for _ in range(50):
                atomic_write(p, lambda f: [f.write(tag) for _ in range(2000)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=writer, args=(t,)) for t in (b"a", b"b")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    data = p.read_bytes()
    assert data in (b"a" * 2000, b"b" * 2000)  # one writer's whole file, never a mix
    assert os.listdir(tmp_path) == ["shared.bin"]


def test_an_optimizer_state_that_does_not_load_is_warned_and_counted():
    cfg = NetConfig(macro_features=6, num_classes=2, history=4, micro_features=3, num_branches=3, sub_actions=3)
    a = Learner(cfg, AgentConfig(), seed=0)
    state = a.state_dict()
    state["opt"] = {"state": {}, "param_groups": [{"params": [0]}]}  # another layout
    b = Learner(cfg, AgentConfig(), seed=1)
    with pytest.raises(ValueError):
        b.load_state_dict(state)  # strict by default
    with pytest.warns(RuntimeWarning, match="optimiser starts afresh"):
        b.load_state_dict(state, strict_optimizer=False)
    assert b.optimizer_resets == 1
    b.load_state_dict(a.state_dict(), strict_optimizer=False)  # a matching state loads without a word
    assert b.optimizer_resets == 1
