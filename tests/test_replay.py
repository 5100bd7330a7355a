"""Prioritized replay and its sum tree, on every available device."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from replay_server.replay import FieldSpec, PrioritizedReplay, ReplayError
from replay_server.sum_tree import SumTree

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="no CUDA device"))]
FIELDS = {"obs": FieldSpec((3,), torch.float32), "action": FieldSpec((2,), torch.uint8),
          "step": FieldSpec((), torch.int64)}


def rows(m: int, start: int = 0) -> dict:
    i = torch.arange(start, start + m)
    return {"obs": i[:, None].float().repeat(1, 3), "action": (i[:, None] % 5).to(torch.uint8).repeat(1, 2),
            "step": i}


def assert_tree_consistent(tree: SumTree) -> None:
    F = tree.fanout
    for below, above in zip(tree.levels[:-1], tree.levels[1:]):
        sums = below.view(-1, F).sum(1)
        torch.testing.assert_close(above[: sums.numel()], sums, rtol=1e-12, atol=1e-9)
        assert (above[sums.numel():] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_frequencies_follow_p_alpha(device):
    rb = PrioritizedReplay(64, FIELDS, device=device, alpha=0.6, seed=1)
    g = torch.Generator().manual_seed(0)
    pri = torch.rand(64, generator=g) * 3 + 0.05
    rb.add(rows(64), pri)
    counts = torch.zeros(64)
    draws = 0
    for _ in range(200):
        s = rb.sample(1000)
        counts += torch.bincount(s.indices.cpu(), minlength=64).float()
        draws += 1000
    expected = (pri + rb.eps) ** 0.6
    expected = expected / expected.sum() * draws
    chi2, p = stats.chisquare(counts.numpy(), expected.numpy())
    assert p > 1e-3, (chi2, p)
    # And a non-trivial spread: the most likely slot is drawn far more than the least.
    assert counts.max() > 2 * counts.min()


@pytest.mark.parametrize("device", DEVICES)
def test_ring_wraps_and_stamps_generations(device):
    rb = PrioritizedReplay(10, FIELDS, device=device, seed=0)
    for start in range(0, 25, 7):
        rb.add(rows(min(7, 25 - start), start), torch.ones(min(7, 25 - start)))
    assert rb.size == 10 and rb.next_slot == 25 % 10 and rb.writes == 25
    # Slot j holds the newest write that landed on it: 15..24 in ring order.
    steps = rb.storage["step"].cpu()
    assert sorted(steps.tolist()) == list(range(15, 25))
    assert all(int(steps[i]) % 10 == i for i in range(10))
    torch.testing.assert_close(rb.generation.cpu(), steps)
    # A batch larger than the ring keeps its newest rows.
    rb.add(rows(23, 100), torch.ones(23))
    assert sorted(rb.storage["step"].cpu().tolist()) == list(range(113, 123))


@pytest.mark.parametrize("device", DEVICES)
def test_stale_priority_updates_are_ignored(device):
    rb = PrioritizedReplay(8, FIELDS, device=device, seed=0)
    rb.add(rows(8), torch.ones(8))
    s = rb.sample(6)
    before = rb.tree.leaves.clone()
    rb.add(rows(8, 8), torch.ones(8))  # overwrite every slot
    assert rb.update_priorities(s.indices, s.generations, torch.full((6,), 50.0)) == 0
    torch.testing.assert_close(rb.tree.leaves, before)
    s2 = rb.sample(6)
    assert rb.update_priorities(s2.indices, s2.generations, torch.full((6,), 50.0)) == 6
    assert float(rb.tree.get(s2.indices[:1])) == pytest.approx((50.0 + rb.eps) ** 0.6)
    # Mixed: only the fresh half applies.
    gens = s2.generations.clone()
    gens[:3] -= 1
    assert rb.update_priorities(s2.indices, gens, torch.ones(6)) == len(set(s2.indices[3:].tolist()))


@pytest.mark.parametrize("device", DEVICES)
def test_importance_weights_and_beta_annealing(device):
    rb = PrioritizedReplay(16, FIELDS, device=device, beta0=0.4, beta_steps=10, seed=3)
    rb.add(rows(16), torch.arange(1, 17).float())
    s = rb.sample(32)
    p = s.probabilities
    w = (16 * p) ** -0.4
    torch.testing.assert_close(s.weights, (w / w.max()).float())
    assert float(s.weights.max()) == 1.0
    for _ in range(20):
        rb.sample(4)
    assert rb.beta == 1.0
    torch.testing.assert_close(p, rb.tree.get(s.indices) / rb.tree.total)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_priority_is_never_sampled_and_data_round_trips(device):
    rb = PrioritizedReplay(32, FIELDS, device=device, alpha=1.0, eps=0.0, seed=0)
    pri = torch.zeros(32)
    pri[[3, 17, 30]] = torch.tensor([1.0, 2.0, 5.0])
    rb.add(rows(32), pri)
    s = rb.sample(4000)
    assert set(s.indices.cpu().tolist()) == {3, 17, 30}
    assert s.data["action"].dtype == torch.uint8 and s.data["step"].dtype == torch.int64
    torch.testing.assert_close(s.data["step"], s.indices)
    torch.testing.assert_close(s.data["obs"][:, 0], s.indices.float())
    torch.testing.assert_close(s.data["action"][:, 1], (s.indices % 5).to(torch.uint8))


def test_state_dict_round_trip_and_mismatch():
    rb = PrioritizedReplay(20, FIELDS, seed=5)
    rb.add(rows(13), torch.rand(13) + 0.1)
    state = rb.state_dict()
    a = rb.sample(8)
    rb2 = PrioritizedReplay(20, FIELDS, seed=99)
    rb2.load_state_dict(state)
    b = rb2.sample(8)
    torch.testing.assert_close(a.indices, b.indices)
    torch.testing.assert_close(a.data["obs"], b.data["obs"])
    assert rb2.size == 13 and rb2.next_slot == 13
    with pytest.raises(ReplayError, match="capacity 20 .* this replay has capacity 21"):
        PrioritizedReplay(21, FIELDS).load_state_dict(state)
    with pytest.raises(ReplayError, match="fields"):
        PrioritizedReplay(20, {"obs": FieldSpec((4,), torch.float32)}).load_state_dict(state)


def test_bad_input_is_refused_with_the_reason():
    rb = PrioritizedReplay(8, FIELDS, seed=0)
    with pytest.raises(ReplayError, match="empty replay"):
        rb.sample(4)
    with pytest.raises(ReplayError, match=r"field 'obs' must be \[M, 3\]"):
        rb.add({**rows(2), "obs": torch.zeros(2, 4)})
    with pytest.raises(ReplayError, match=r"missing \['step'\]"):
        rb.add({k: v for k, v in rows(2).items() if k != "step"})
    with pytest.raises(ReplayError, match="NaN or infinite"):
        rb.add({**rows(2), "obs": torch.tensor([[0.0, float("nan"), 1.0]] * 2)})
    with pytest.raises(ReplayError, match="finite and >= 0, got nan"):
        rb.add(rows(2), torch.tensor([1.0, float("nan")]))
    with pytest.raises(ReplayError, match="finite and >= 0, got -1"):
        rb.add(rows(2), torch.tensor([1.0, -1.0]))
    with pytest.raises(ReplayError, match="field 'action' must be torch.uint8, got torch.int64"):
        rb.add({**rows(2), "action": torch.tensor([[300, -1], [0, 0]])})
    assert rb.size == 0  # nothing half-written
    rb.add(rows(4), torch.ones(4))
    s = rb.sample(2)
    with pytest.raises(ReplayError, match=r"indices must be in \[0, 8\)"):
        rb.update_priorities(torch.tensor([0, 9]), torch.tensor([0, 0]), torch.ones(2))
    with pytest.raises(ReplayError, match="equal 1-D shapes"):
        rb.update_priorities(s.indices, s.generations, torch.ones(3))


@pytest.mark.parametrize("use_cpp", [True, False])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_sum_tree_invariants_under_random_operations(use_cpp, data):
    cap = data.draw(st.integers(1, 300))
    fan = data.draw(st.sampled_from([2, 4, 16, 32]))
    tree = SumTree(cap, fanout=fan, use_cpp=use_cpp)
    ref = np.zeros(cap)
    for _ in range(data.draw(st.integers(1, 6))):
        if data.draw(st.booleans()):
            m = data.draw(st.integers(1, min(40, cap)))
            idx = data.draw(st.lists(st.integers(0, cap - 1), min_size=m, max_size=m, unique=True))
            vals = data.draw(st.lists(st.floats(0, 100, allow_nan=False), min_size=m, max_size=m))
            tree.update(torch.tensor(idx), torch.tensor(vals, dtype=torch.float64))
            ref[idx] = vals
        else:
            start = data.draw(st.integers(0, cap - 1))
            m = data.draw(st.integers(1, cap - start))
            vals = data.draw(st.lists(st.floats(0, 100, allow_nan=False), min_size=m, max_size=m))
            tree.update_range(start, torch.tensor(vals, dtype=torch.float64))
            ref[start:start + m] = vals
        assert_tree_consistent(tree)
        np.testing.assert_allclose(tree.leaves.numpy(), ref)
        assert float(tree.total) == pytest.approx(ref.sum(), rel=1e-12, abs=1e-9)
        if ref.sum() > 0:
            masses = data.draw(st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=20))
            u = torch.tensor(masses, dtype=torch.float64) * tree.total
            got = tree.find(u).numpy()
            cum = np.cumsum(ref)
            want = np.minimum(np.searchsorted(cum, u.numpy(), side="right"), cap - 1)
            # The exact leaf, or (float rounding at a boundary) the leaf with mass next to it.
            for g_, w_, uu in zip(got, want, u.numpy()):
                assert 0 <= g_ < cap and ref[g_] > 0
                lo = cum[g_] - ref[g_]
                assert g_ == w_ or min(abs(lo - uu), abs(cum[g_] - uu)) < 1e-9 * max(1.0, ref.sum())


def test_cpp_kernels_agree_with_the_tensor_path():
    g = torch.Generator().manual_seed(0)
    a, b = SumTree(5000, use_cpp=True), SumTree(5000, use_cpp=False)
    v = torch.rand(5000, generator=g, dtype=torch.float64)
    v[::7] = 0
    for t in (a, b):
        t.set_all(v)
    idx = torch.randint(0, 5000, (700,), generator=g)
    new = torch.rand(700, generator=g, dtype=torch.float64)
    for t in (a, b):
        t.update(idx.unique(), new[: idx.unique().numel()])
    for x, y in zip(a.levels, b.levels):
        torch.testing.assert_close(x, y)
    u = torch.rand(1000, generator=g, dtype=torch.float64) * a.total
    torch.testing.assert_close(a.find(u), b.find(u))
    from replay_server._cpu_kernels import kernels
    assert kernels() is not None, "the C++ kernels should build here (g++ and ninja are present)"


def test_all_zero_priorities_refuse_to_sample():
    rb = PrioritizedReplay(4, FIELDS, eps=0.0, seed=0)
    rb.add(rows(4), torch.zeros(4))
    with pytest.raises(ReplayError, match="every priority in the replay is zero"):
        rb.sample(2)
    with pytest.raises(ValueError, match="equal 1-D idx and values"):
        rb.tree.update(torch.tensor([0, 1]), torch.ones(3, dtype=torch.float64))


def test_cpp_sample_and_update_equal_the_tensor_path():
    """On CPU, sample and priority update run as one C++ call each; the tensor-operation path
    (what CUDA runs) is the reference: same draws, weights, data and tree."""
    fields = {**FIELDS, "flag": FieldSpec((2,), torch.bool), "small": FieldSpec((3,), torch.int16),
              "signed": FieldSpec((), torch.int8)}

    def batch(m, start):
        b = rows(m, start)
        i = torch.arange(start, start + m)
        b.update(flag=torch.stack([i % 2 == 0, i % 3 == 0], 1), small=(i[:, None] * torch.tensor([1, -2, 3])).short(),
                 signed=(i % 200 - 100).to(torch.int8))
        return b

    g = torch.Generator().manual_seed(7)
    fast, ref = (PrioritizedReplay(300, fields, seed=11, use_cpp=c) for c in (True, False))
    assert fast.tree._kernels() is not None and ref.tree._kernels() is None
    for start in range(0, 420, 60):  # wraps the ring
        pri = torch.rand(60, generator=g) * 4
        pri[::9] = 0
        for rb in (fast, ref):
            rb.add(batch(60, start), pri)
    for _ in range(5):
        a, b = fast.sample(257), ref.sample(257)
        assert torch.equal(a.indices, b.indices) and torch.equal(a.generations, b.generations)
        torch.testing.assert_close(a.probabilities, b.probabilities, rtol=1e-12, atol=0)
        torch.testing.assert_close(a.weights, b.weights, rtol=1e-6, atol=0)
        assert list(a.data) == list(b.data) == list(fields)
        for k in fields:
            assert a.data[k].dtype == b.data[k].dtype and torch.equal(a.data[k], b.data[k]), k
        new = torch.rand(257, generator=g) * 3
        stale = torch.zeros(257, dtype=torch.bool)
        stale[::5] = True  # as if these slots had been overwritten since
        gens = torch.where(stale, a.generations - 1, a.generations)
        assert fast.update_priorities(a.indices, gens, new) == ref.update_priorities(b.indices, gens, new.double())
        for x, y in zip(fast.tree.levels, ref.tree.levels):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
        assert float(fast._max_p) == float(ref._max_p)
    assert fast.sampled == ref.sampled == 5 * 257
    # Priorities of another dtype (here float16 and int64) are converted, as the tensor path does.
    for pr in (torch.full((257,), 2.5, dtype=torch.float16), torch.full((257,), 3, dtype=torch.int64)):
        s_ = fast.sample(257)
        assert fast.update_priorities(s_.indices, s_.generations, pr) == 257
        torch.testing.assert_close(fast.tree.leaves[s_.indices], torch.full((257,), (float(pr[0]) + fast.eps) ** 0.6,
                                                                            dtype=torch.float64))
    # Bad input through the C++ path: refused with the reason, nothing written.
    before = [t.clone() for t in fast.tree.levels]
    with pytest.raises(ReplayError, match=r"indices must be in \[0, 300\), got 0\.\.300"):
        fast.update_priorities(torch.tensor([0, 300]), torch.tensor([0, 0]), torch.ones(2))
    with pytest.raises(ReplayError, match="finite and >= 0, got nan"):
        fast.update_priorities(a.indices[:2], a.generations[:2], torch.tensor([1.0, float("nan")]))
    with pytest.raises(ReplayError, match="finite and >= 0, got -2"):
        fast.update_priorities(a.indices[:2], a.generations[:2], torch.tensor([-2.0, 1.0]))
    assert all(torch.equal(x, y) for x, y in zip(before, fast.tree.levels))


def test_large_cpu_replay_memory_asks_for_huge_pages():
    from replay_server import _memory
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this system")
    t = _memory.zeros((4 << 20,), torch.float32, torch.device("cpu"))  # 16 MiB
    assert t.dtype == torch.float32 and t.shape == (4 << 20,) and not t.any()
    assert _memory.advise_hugepages(torch.empty(1000)) is False  # too small to bother
    # The kernel accepts the request unless huge pages are switched off.
    assert _memory.advise_hugepages(torch.empty(4 << 20)) is ("[never]" not in mode)


def test_a_dead_processs_extension_build_lock_does_not_hang_later_loads(tmp_path, monkeypatch):
    """torch's JIT loader waits forever on a lock file a killed process left in the build
    directory (every replay sample of a later run hung); an old lock is removed, a fresh one
    (a build going on now) is left to its owner."""
    import os
    import time
    from replay_server import _cpu_kernels
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / "some_ext"
    build.mkdir()
    lock = build / "lock"
    lock.write_text("")
    _cpu_kernels._clear_stale_build_lock("some_ext")
    assert lock.exists()  # fresh: another process is building
    old = time.time() - _cpu_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    _cpu_kernels._clear_stale_build_lock("some_ext")
    assert not lock.exists()
    _cpu_kernels._clear_stale_build_lock("some_ext")  # no lock: nothing to do


@pytest.mark.parametrize("wide", [0, 3000], ids=["narrow-rows", "wide-rows"])
def test_cpp_insert_writes_what_the_tensor_path_writes_and_refuses_nan_writing_nothing(wide):
    """The one-pass C++ insert (CPU) against the per-field tensor copies: same packed rows,
    generations and tree through ring wraps, a batch larger than the ring, bool / int8 /
    int16 / uint8 / float32 fields; a NaN anywhere in a float field (also in rows a too-large
    batch drops) is refused naming the field and row, with nothing written. Wide rows: the
    kernel streams 2 rows at a time, so blocks wrap around the ring's end mid-block."""
    from replay_server._cpu_kernels import kernels
    if kernels() is None:
        pytest.skip("C++ kernels unavailable")
    fields = {"obs": FieldSpec((3,), torch.float32), "a": FieldSpec((2,), torch.uint8), "b": FieldSpec((), torch.bool),
              "c": FieldSpec((2, 2), torch.int16), "d": FieldSpec((), torch.int8), "r": FieldSpec((), torch.float32),
              "step": FieldSpec((), torch.int64)}
    if wide:
        fields["wide"] = FieldSpec((wide,), torch.float32)
    g = torch.Generator().manual_seed(3)

    def batch(m):
        return {**({"wide": torch.randn(m, wide, generator=g)} if wide else {}), "obs": torch.randn(m, 3, generator=g), "a": torch.randint(0, 255, (m, 2), generator=g, dtype=torch.uint8),
                "b": torch.rand(m, generator=g) > 0.5, "c": torch.randint(-300, 300, (m, 2, 2), generator=g,
                                                                          dtype=torch.int16),
                "d": torch.randint(-100, 100, (m,), generator=g, dtype=torch.int8), "r": torch.randn(m, generator=g),
                "step": torch.arange(m)}

    fast = PrioritizedReplay(50, fields, seed=0)
    slow = PrioritizedReplay(50, fields, seed=0)
    slow._insert_kernel = lambda: None
    assert fast._insert_kernel() is not None
    for m in (7, 30, 23, 64, 5):  # wraps, then a batch larger than the ring
        b = batch(m)
        pr = torch.rand(m, generator=g) + 0.1
        assert all(torch.equal(x, y) for x, y in zip(fast.add(b, pr), slow.add(b, pr)))
        assert torch.equal(fast.packed, slow.packed) and torch.equal(fast.generation, slow.generation)
        assert torch.equal(fast.tree.levels[0], slow.tree.levels[0])
    before = fast.packed.clone(), fast.generation.clone(), fast.writes
    for field, row in (("obs", 3), ("r", 0)):
        bad = batch(60)
        bad[field][row] = float("nan") if field == "r" else torch.tensor([0.0, float("inf"), 1.0])
        with pytest.raises(ReplayError, match=rf"field '{field}' has NaN or infinite values \(row {row}\)"):
            fast.add(bad)  # row 3 / 0 lies in the part a 60-row batch drops from a 50-slot ring
    assert torch.equal(fast.packed, before[0]) and torch.equal(fast.generation, before[1]) and fast.writes == before[2]


def test_bench_replay_prints_its_floors(capsys):
    """`launch.bench replay` at small size: every rate measured, the floors beside them."""
    import os

    from launch.bench import bench_replay
    cpus = os.sched_getaffinity(0)
    try:
        res = bench_replay(repeats=1, seconds=0.05, capacity=8192, batch=64, chunk=1024, peers=False)
    finally:
        os.sched_setaffinity(0, cpus)  # the bench pins itself to one core
    for key in ("ours_steps_per_s", "ours_insert_per_s", "memcpy_insert_per_s", "gather_floor_steps_per_s",
                "ours_no_hugepages_steps_per_s"):
        assert np.isfinite(res[key]) and res[key] > 0, key
    assert res["bytes_per_transition"] > 2000  # platform v2's rows
    out = capsys.readouterr().out
    assert "floor" in out and "gather + scatter" in out
