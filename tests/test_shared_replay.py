"""A replay shared in place between processes on one node (replay_server/shared.py)."""

import multiprocessing as mp
import os

import pytest
import torch

from replay_server.replay import PrioritizedReplay
from replay_server.shared import SharedArena
from test_replay import FIELDS, rows  # the same fields and rows as the in-process replay tests


def _child(spec, q):
    try:
        rb = PrioritizedReplay.attach(spec, 32, FIELDS, seed=3)
        s = rb.sample(8)
        # Rows must be the ones the owner wrote (obs == step), seen through the shared mapping.
        ok = bool((s.data["obs"][:, 0] == s.data["step"].float()).all())
        # In-place priority update: slot 5 gets a huge priority, stale generation for slot 6.
        n = rb.update_priorities(torch.tensor([5, 6]), torch.tensor([int(rb.generation[5]), -7]),
                                 torch.tensor([1e6, 1e6]))
        rb.add(rows(4, start=100), torch.ones(4))  # the attached side can insert too
        q.put((ok, n, rb.size, rb.sampled))
    except Exception as e:  # surface the failure in the parent
        q.put(repr(e))


def _owner_and_child(device: str) -> None:
    """The owner writes 20 rows; a spawned process attaches, samples, updates priorities in
    place and inserts 4 rows; the owner then sees all of it."""
    arena = SharedArena.create(device, tag="test")
    try:
        rb = PrioritizedReplay(32, FIELDS, shared=arena, seed=1)
        rb.add(rows(20), torch.ones(20))
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(rb.shared_spec(), q))
        p.start()
        out = q.get(timeout=120)
        p.join(60)
        assert not isinstance(out, str), out
        ok, applied, size, sampled = out
        assert ok and applied == 1
        assert size == 24 and rb.size == 24 and rb.writes == 24  # the owner sees the child's insert
        assert sampled == 8 and rb.sampled == 8
        # The owner sees the child's priority update: slot 5 now dominates sampling.
        s = rb.sample(256)
        assert (s.indices == 5).float().mean() > 0.9
        assert float(rb.tree.get(torch.tensor([6], device=rb.device))) == pytest.approx(1.0, rel=1e-5)  # stale: ignored
    finally:
        arena.unlink()


def test_attached_process_samples_and_updates_in_place():
    _owner_and_child("cpu")


def test_attach_refuses_a_different_layout_and_a_missing_file():
    arena = SharedArena.create("cpu", tag="test")
    try:
        rb = PrioritizedReplay(32, FIELDS, shared=arena)
        spec = rb.shared_spec()
        with pytest.raises(ValueError, match="layout differs"):
            PrioritizedReplay.attach(spec, 64, FIELDS)
    finally:
        arena.unlink()
    assert not os.path.exists(spec.path)
    with pytest.raises(FileNotFoundError, match="is gone"):
        PrioritizedReplay.attach(spec, 32, FIELDS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_ipc_attach_in_another_process():
    _owner_and_child("cuda")
