"""Preference alignment: the Bradley-Terry head and loss, the durable feedback log, the
preference actor, preference-steered exploration, and the local trainer with feedback."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.preference_actor import PreferenceActor
from apex_bdq.config import AgentConfig, ConfigError, NetConfig, PreferenceConfig, SimConfig
from apex_bdq.losses import preference_loss, segment_scores
from apex_bdq.networks import BDQNetwork
from apex_bdq.preference import (FeedbackError, FeedbackLog, PreferenceBatch, PreferencePair, Segment,
                                 UnknownSegment, load_log, oracle_label)
from learner.learner import Explorer, Learner, batch_preference_loss

ROOT = Path(__file__).resolve().parents[1]

NET = NetConfig.for_sim(SimConfig(), macro_hidden=32, micro_channels=8, z_dim=32, head_hidden=32,
                        preference_ensemble=3, preference_hidden=16)
T = 4


def make_segment(rng, overload=None, capacity_action=None, sid=None) -> Segment:
    """A segment whose overload follows its capacity action when one is given (the head can
    then learn the ranking from what the segment contains)."""
    macro = rng.normal(size=(T, NET.macro_features)).astype(np.float32)
    micro = rng.normal(size=(T, NET.num_classes, NET.history, NET.micro_features)).astype(np.float32)
    action = rng.integers(0, NET.sub_actions, size=(T, NET.num_branches))
    if capacity_action is not None:
        action[:, 0] = capacity_action
        overload = (NET.sub_actions - 1 - capacity_action) / (NET.sub_actions - 1)
    ov = float(rng.random() if overload is None else overload)
    return Segment(id=sid or Segment.new_id(), macro=macro, micro=micro, action=action,
                   metrics={"overload": ov, "unfairness": 0.0, "slo_violation": 0.0},
                   series={"load": rng.random(30).astype(np.float32), "capacity": np.full(30, 5, np.float32),
                           "p99_ms": rng.random(30).astype(np.float32) * 100},
                   source="test", version=1)


def pref_actor(tmp_path, name="fb.log", **kw) -> PreferenceActor:
    cfg = PreferenceConfig(**{"enabled": True, "min_pairs": 2, "batch_pairs": 8, **kw})
    return PreferenceActor(NET, cfg, str(tmp_path / name), seed=0)


# -- loss and head -----------------------------------------------------------------------
def test_bradley_terry_loss_matches_a_hand_computed_case():
    sa = torch.tensor([[2.0, 0.0]])  # [E=1, P=2]
    sb = torch.tensor([[1.0, 0.0]])
    label = torch.tensor([1.0, 0.5])
    loss, ex = preference_loss(sa, sb, label)
    # pair 0: -log sigmoid(1); pair 1 (tie, equal scores): -log sigmoid(0) = log 2
    want = (np.log1p(np.exp(-1.0)) + np.log(2.0)) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert ex["accuracy"].item() == 1.0  # only the strict pair counts
    u = torch.arange(2 * 1 * 2 * 2 * 3, dtype=torch.float32).reshape(2, 1, 2, 2, 3)  # [E, P, T, D, n]
    acts = torch.tensor([[[0, 2], [1, 1]]])
    # member 0: t0: 0 + 5, t1: 7 + 10 -> 22; member 1 adds 12 to each of 4 terms -> 70
    assert segment_scores(u, acts).tolist() == [[22.0], [70.0]]
    with pytest.raises(ValueError, match="scores must be"):
        preference_loss(sa, sb[:, :1], label)


def test_preference_only_step_leaves_value_and_advantage_heads_unchanged():
    rng = np.random.default_rng(0)
    learner = Learner(NET, AgentConfig(lr=1e-2), pref_beta=1.0)
    actor_segs = [make_segment(rng) for _ in range(8)]
    from apex_bdq.preference import PreferenceBatch
    batch = PreferenceBatch.from_pairs([PreferencePair(actor_segs[i].id, actor_segs[i + 1].id) for i in range(0, 8, 2)],
                                       {s.id: s for s in actor_segs})
    before = {k: v.clone() for k, v in learner.net.state_dict().items()}
    out = learner.step(None, batch)
    after = learner.net.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert not any(k.startswith("head.") for k in changed), sorted(changed)
    assert any(k.startswith("pref.") for k in changed)
    assert any(k.startswith(("macro.", "micro.", "fuse.")) for k in changed)  # it shapes the representation
    assert np.isfinite(out.pref_loss) and out.priorities is None


def _probe_td(learner, data, weights):
    from learner.learner import batch_td_loss
    with torch.no_grad():
        loss, _ = batch_td_loss(learner.net, learner.net, learner.target, data, weights, learner.cfg)
    return float(loss)


def test_feedback_does_not_break_the_critic_on_a_probe_set():
    """Stated bound (README): 60 updates of TD + beta x preference (beta 0.5, the default)
    leave the TD loss on a fixed probe set within 5 % of 60 updates of TD alone (measured:
    0.985-1.003x over three seeds)."""
    rng = np.random.default_rng(1)
    B = 256
    data = {"macro": torch.randn(B, NET.macro_features), "micro": torch.randn(B, NET.num_classes, NET.history,
                                                                                NET.micro_features),
            "action": torch.randint(0, NET.sub_actions, (B, NET.num_branches)),
            "reward": torch.randn(B), "discount": torch.full((B,), 0.9),
            "next_macro": torch.randn(B, NET.macro_features),
            "next_micro": torch.randn(B, NET.num_classes, NET.history, NET.micro_features)}
    w = torch.ones(B)
    probe = {k: v[: B // 2] for k, v in data.items()}
    train = {k: v[B // 2:] for k, v in data.items()}
    segs = [make_segment(rng, capacity_action=int(rng.integers(0, NET.sub_actions))) for _ in range(64)]
    from apex_bdq.preference import PreferenceBatch
    pairs = [PreferencePair(a.id, b.id, 1.0 if a.metrics["overload"] < b.metrics["overload"] else 0.0)
             for a, b in zip(segs[::2], segs[1::2])]
    batch = PreferenceBatch.from_pairs(pairs, {s.id: s for s in segs})
    base = Learner(NET, AgentConfig(lr=3e-4, target_update=10_000), seed=0, pref_beta=0.5)
    from apex_bdq.messages import SampledBatch
    sampled = SampledBatch(indices=None, generations=None, weights=w[: B // 2], **train)
    for _ in range(30):
        base.step(sampled)
    td_only, with_pref = copy.deepcopy(base), copy.deepcopy(base)
    for _ in range(60):
        td_only.step(sampled)
        with_pref.step(sampled, batch)
    a, b = _probe_td(td_only, probe, w[: B // 2]), _probe_td(with_pref, probe, w[: B // 2])
    assert b <= 1.05 * a, (a, b)


def test_head_learns_to_rank_held_out_oracle_pairs():
    rng = np.random.default_rng(2)
    learner = Learner(NET, AgentConfig(lr=3e-3), seed=0, pref_beta=1.0)
    segs = [make_segment(rng, capacity_action=int(rng.integers(0, NET.sub_actions))) for _ in range(400)]
    by_id = {s.id: s for s in segs}
    from apex_bdq.preference import PreferenceBatch

    def pairs(lo, hi):
        out = []
        for a, b in zip(segs[lo:hi:2], segs[lo + 1:hi:2]):
            lab = oracle_label(a, b, (1.0, 1.0, 1.0), 0.0, rng)
            if lab != 0.5:
                out.append(PreferencePair(a.id, b.id, lab))
        return out
    train, held = pairs(0, 300), pairs(300, 400)
    for step in range(150):
        idx = rng.integers(0, len(train), size=32)
        learner.step(None, PreferenceBatch.from_pairs([train[i] for i in idx], by_id))
    _, ex = batch_preference_loss(learner.net.utilities, PreferenceBatch.from_pairs(held, by_id), learner.device)
    assert ex["accuracy"].item() >= 0.9


def test_noise_free_held_out_accuracy_ignores_the_labellers_mistakes(tmp_path):
    """Held-out pairs all labelled the wrong way round: the accuracy against the labels
    and the one against the oracle's own rule add up to 1 (ties excluded from both)."""
    rng = np.random.default_rng(4)
    pa = pref_actor(tmp_path)
    segs = [make_segment(rng, overload=float(i) / 42) for i in range(42)]  # 21 pairs: an accuracy is never 1/2
    pa.add_segments(segs)
    for a, b in zip(segs[0::2], segs[1::2]):  # a has the lower overload: the rule prefers a
        pa.rank(a.id, b.id, 0.0, source="human", heldout=True)  # a labeller who got them all wrong
    net = Learner(NET, AgentConfig(), seed=0, pref_beta=1.0).net
    given, true = pa.heldout_accuracy(net), pa.heldout_accuracy(net, noise_free=True)
    assert 0.0 <= given <= 1.0 and given + true == pytest.approx(1.0)
    assert pa.heldout_label_ceiling() == 0.0  # the rule disagrees with every label given
    c, d = make_segment(rng, overload=0.5), make_segment(rng, overload=0.5)  # a tie under the rule
    e, f = make_segment(rng, overload=0.0), make_segment(rng, overload=0.9)
    pa.add_segments([c, d, e, f])
    pa.rank(c.id, d.id, 1.0, source="human", heldout=True)
    pa.rank(e.id, f.id, 1.0, source="human", heldout=True)  # right
    assert pa.heldout_label_ceiling() == pytest.approx((0.5 + 1.0) / 23)
    pa.close()


# -- oracle ------------------------------------------------------------------------------
def test_oracle_prefers_the_safer_segment_and_errs_at_its_rate():
    rng = np.random.default_rng(3)
    good, bad = make_segment(rng, overload=0.0), make_segment(rng, overload=0.5)
    assert oracle_label(good, bad, (1, 1, 1), 0.0, rng) == 1.0
    assert oracle_label(bad, good, (1, 1, 1), 0.0, rng) == 0.0
    assert oracle_label(good, good, (1, 1, 1), 0.0, rng) == 0.5
    wrong = sum(oracle_label(good, bad, (1, 1, 1), 0.4, rng) == 0.0 for _ in range(4000)) / 4000
    assert wrong == pytest.approx(0.2, abs=0.03)  # half of the 40 % random answers are wrong


# -- durable log -------------------------------------------------------------------------
def test_log_survives_restart_and_skips_a_torn_last_record(tmp_path):
    rng = np.random.default_rng(4)
    actor = pref_actor(tmp_path)
    segs = [make_segment(rng) for _ in range(6)]
    actor.add_segments(segs)
    assert actor.rank(segs[0].id, segs[1].id) == "accepted"
    assert actor.rank(segs[2].id, segs[3].id, 0.0) == "accepted"
    assert actor.rank(segs[1].id, segs[0].id) == "duplicate"  # the same two, either order
    actor.close()
    path = str(tmp_path / "fb.log")
    size = os.path.getsize(path)
    with open(path, "ab") as f:  # a crash half-way through appending the next record
        f.write(_record_bytes({"kind": "pair", "a": "x", "b": "y", "label": 1.0})[:-5])
    with pytest.warns(RuntimeWarning, match="torn record .* cut off"):
        again = pref_actor(tmp_path)
    assert os.path.getsize(path) == size  # the torn tail is cut off
    assert [(p.a, p.b, p.label) for p in again.pairs] == [(segs[0].id, segs[1].id, 1.0),
                                                         (segs[2].id, segs[3].id, 0.0)]
    np.testing.assert_array_equal(again.segment(segs[2].id).micro, segs[2].micro)  # data to train on
    again.add_segments(segs[4:])
    assert again.rank(segs[4].id, segs[5].id) == "accepted"
    again.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # clean now
        meta, got_segs, pairs = load_log(path)
    assert meta["net"]["num_branches"] == NET.num_branches
    assert len(pairs) == 3 and len(got_segs) == 6


def _record_bytes(rec: dict) -> bytes:
    """One record as FeedbackLog frames it (a torn write is a prefix of this)."""
    import msgpack
    import struct
    import zlib
    payload = msgpack.packb(rec, use_bin_type=True)
    head = b"\xa5FB\x5a" + struct.pack("<II", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def _ten_record_log(path: str) -> list[int]:
    """A log of 10 pair records; returns the offset where each record starts."""
    log = FeedbackLog(path)
    starts = []
    for i in range(10):
        starts.append(os.path.getsize(path))
        log.append({"kind": "pair", "a": f"a{i}", "b": f"b{i}", "label": 1.0})
    log.close()
    return starts


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("field", ["magic", "length", "crc", "payload"])
def test_a_corrupt_record_is_skipped_and_every_intact_one_after_it_kept(tmp_path, where, field):
    path = str(tmp_path / "x.log")
    starts = _ten_record_log(path)
    size = os.path.getsize(path)
    k = {"first": 0, "middle": 4, "last": 9}[where]
    raw = bytearray(open(path, "rb").read())
    raw[starts[k] + {"magic": 1, "length": 5, "crc": 13, "payload": 19}[field]] ^= 0x5A  # one flipped byte
    open(path, "wb").write(bytes(raw))
    with pytest.warns(RuntimeWarning, match=r"1 corrupt record\(s\).*9 intact records kept"):
        reader = FeedbackLog(path, readonly=True)
    assert [r["a"] for r in reader.records()] == [f"a{i}" for i in range(10) if i != k]
    assert reader.corrupt_records == 1 and reader.torn_bytes == 0
    with pytest.warns(RuntimeWarning, match="corrupt"):
        log = FeedbackLog(path)  # a writer keeps the corrupt bytes (nothing intact is cut) and appends after
    assert os.path.getsize(path) == size
    log.append({"kind": "pair", "a": "new", "b": "n", "label": 1.0})
    log.close()
    with pytest.warns(RuntimeWarning):
        assert [r["a"] for r in FeedbackLog(path, readonly=True).records()][-2:] == ["a9" if k != 9 else "a8", "new"]


def test_only_a_torn_tail_is_cut_and_only_by_a_writer(tmp_path):
    path = str(tmp_path / "x.log")
    _ten_record_log(path)
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(_record_bytes({"kind": "pair", "a": "torn", "b": "t", "label": 1.0})[:9])
    with pytest.warns(RuntimeWarning, match="torn record .* left in place"):
        reader = FeedbackLog(path, readonly=True)
    assert len(list(reader.records())) == 10 and os.path.getsize(path) == size + 9
    with pytest.raises(FeedbackError, match="read-only"):
        reader.append({"kind": "pair"})
    with pytest.warns(RuntimeWarning, match="cut off"):
        FeedbackLog(path).close()
    assert os.path.getsize(path) == size


def test_a_reader_beside_a_live_writer_and_a_second_writer(tmp_path):
    path = str(tmp_path / "x.log")
    writer = FeedbackLog(path)
    writer.append({"kind": "pair", "a": "a0", "b": "b0", "label": 1.0})
    t0 = time.monotonic()
    with pytest.raises(FeedbackError, match="open for writing by another process"):
        FeedbackLog(path, lock_wait_s=0.5)  # one writer at a time (the lock is per open file: same process too)
    assert time.monotonic() - t0 >= 0.5  # it waited for the lock before refusing
    size = os.path.getsize(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r["a"] for r in FeedbackLog(path, readonly=True).records()] == ["a0"]
    assert os.path.getsize(path) == size  # reading wrote nothing
    writer.append({"kind": "pair", "a": "a1", "b": "b1", "label": 1.0})
    assert [r["a"] for r in FeedbackLog(path, readonly=True).records()] == ["a0", "a1"]
    writer.close()
    FeedbackLog(path).close()  # the lock went with the writer
    # from another process too
    import subprocess
    import sys
    holder = subprocess.Popen([sys.executable, "-c", "import sys,time; sys.path.insert(0, %r); "
                               "from apex_bdq.preference import FeedbackLog; l = FeedbackLog(%r); "
                               "print('locked', flush=True); time.sleep(30)" % (str(ROOT), path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FeedbackError, match="open for writing"):
            FeedbackLog(path, lock_wait_s=0.3)
    finally:
        holder.kill()
        holder.wait()
    FeedbackLog(path).close()


def test_not_a_feedback_log_is_refused(tmp_path):
    p = tmp_path / "old.log"
    p.write_bytes(b"\x10\x00\x00\x00" + b"\x00" * 20)
    for ro in (True, False):
        with pytest.raises(FeedbackError, match="not a feedback log"):
            FeedbackLog(str(p), readonly=ro)


def test_pairs_without_their_segments_are_counted_and_warned(tmp_path):
    rng = np.random.default_rng(8)
    actor = pref_actor(tmp_path)
    segs = [make_segment(rng) for _ in range(4)]
    actor.add_segments(segs)
    actor.rank(segs[0].id, segs[1].id)
    actor.rank(segs[2].id, segs[3].id)
    actor.close()
    path = str(tmp_path / "fb.log")
    raw = bytearray(open(path, "rb").read())
    i = raw.find(segs[2].id.encode())  # inside the first segment record of the second pair
    raw[i] ^= 0x01
    open(path, "wb").write(bytes(raw))
    with pytest.warns(RuntimeWarning, match="1 pair.* left out"):
        again = pref_actor(tmp_path)
    st = again.stats()
    assert st.log_corrupt_records == 1 and st.log_orphan_pairs == 1 and st.replayed_pairs == 1
    again.close()


def test_bad_feedback_is_refused_with_the_reason(tmp_path):
    rng = np.random.default_rng(5)
    actor = pref_actor(tmp_path)
    a, b = make_segment(rng), make_segment(rng)
    actor.add_segments([a, b])
    with pytest.raises(UnknownSegment, match="unknown segment id 'nope'"):
        actor.rank(a.id, "nope")
    with pytest.raises(FeedbackError, match="two different segments"):
        actor.rank(a.id, a.id)
    with pytest.raises(FeedbackError, match="label must be"):
        actor.rank(a.id, b.id, 0.7)
    nan = make_segment(rng)
    nan.macro[1, 2] = np.nan
    with pytest.raises(FeedbackError, match="macro holds NaN"):
        actor.add_segments([make_segment(rng), nan])
    short = make_segment(rng)
    short.action = short.action[:, :2]
    with pytest.raises(FeedbackError, match=rf"action must be integers \[T=4, D={NET.num_branches}\]"):
        actor.add_segments([short])
    assert len(actor.unranked) == 2  # a refused batch adds nothing
    assert actor.refused == 3 and actor.pairs == []
    actor.close()
    other = dataclasses.replace(NET, num_branches=6)
    with pytest.raises(FeedbackError, match="network shaped"):
        PreferenceActor(other, PreferenceConfig(enabled=True), str(tmp_path / "fb.log"))


def test_store_is_bounded_and_ranked_segments_stay(tmp_path):
    rng = np.random.default_rng(6)
    actor = pref_actor(tmp_path, store_segments=5)
    first = [make_segment(rng) for _ in range(2)]
    actor.add_segments(first)
    actor.rank(first[0].id, first[1].id)
    actor.add_segments([make_segment(rng) for _ in range(20)])
    assert len(actor.unranked) == 5
    assert actor.segment(first[0].id).id == first[0].id  # ranked: kept
    batch = actor.sample()
    assert batch is None  # min_pairs=2 not reached
    actor.close()


def test_oracle_queries_the_most_disputed_pair_and_serves_batches(tmp_path):
    rng = np.random.default_rng(7)
    actor = pref_actor(tmp_path, oracle_pairs=6, oracle_every=10, query_candidates=16, oracle_pairs_per_min=0)
    actor.add_segments([make_segment(rng) for _ in range(30)])
    actor.set_weights(BDQNetwork(NET).state_dict(), version=3)
    assert actor.oracle_step() == 6  # the budget caps it
    assert actor.oracle_step() == 0
    st = actor.stats()
    assert st.pairs == 6 and st.oracle_ranked == 6
    b = actor.sample(5)
    assert b.macro_a.shape == (5, T, NET.macro_features) and b.action_b.shape == (5, T, NET.num_branches)
    actor.close()


def test_oracle_is_paced_like_a_labeller(tmp_path):
    """min_pairs at once, then at most oracle_pairs_per_min per minute of the run, within the
    budget; a restarted actor's replayed pairs do not count against the new run's pace."""
    rng = np.random.default_rng(13)
    pa = pref_actor(tmp_path, oracle_pairs=50, oracle_every=100, oracle_pairs_per_min=30, min_pairs=4)
    now = [100.0]
    pa.clock = lambda: now[0]
    pa.add_segments([make_segment(rng) for _ in range(200)])
    assert pa.oracle_step() == 4 and pa.oracle_step() == 0  # the first min_pairs, then wait
    now[0] += 30.0
    assert pa.oracle_allowance() == 15 and pa.oracle_step() == 15  # 30 / min for half a minute
    now[0] += 600.0
    assert pa.oracle_step() == 31 and pa.oracle_allowance() == 0  # the budget caps the pace
    pa.close()
    again = pref_actor(tmp_path, oracle_pairs=60, oracle_every=100, oracle_pairs_per_min=30, min_pairs=4)
    again.clock = lambda: 0.0
    assert again.oracle_ranked == 50 and again.oracle_allowance() == 4
    again.close()
    with pytest.raises(ConfigError, match="oracle_pairs_per_min"):
        PreferenceConfig(oracle_pairs_per_min=float("nan"))
    unpaced = pref_actor(tmp_path, name="unpaced.log", oracle_pairs=50, oracle_every=100, oracle_pairs_per_min=0)
    unpaced.add_segments([make_segment(rng) for _ in range(200)])
    assert unpaced.oracle_step() == 50
    unpaced.close()


def test_held_out_queries_are_drawn_at_random_training_queries_by_disagreement(tmp_path):
    """With an ensemble, training pairs are the most disputed of their candidates; held-out
    pairs (the test set) are random ones, so they are on average much less disputed."""
    rng = np.random.default_rng(11)
    pa = PreferenceActor(NET, PreferenceConfig(enabled=True, oracle_pairs=80, oracle_every=80, query_candidates=16,
                                               oracle_pairs_per_min=0),
                         str(tmp_path / "q.log"), seed=0, heldout_every=2)
    pa.add_segments([make_segment(rng) for _ in range(400)])
    torch.manual_seed(3)
    pa.set_weights(BDQNetwork(NET).state_dict(), version=1)
    assert pa.oracle_step() == 80
    assert len(pa.heldout) == 40 and len(pa.pairs) == 40

    def disagreement(pairs):
        b = PreferenceBatch.from_pairs(pairs, pa.ranked)
        with torch.no_grad():
            return float(batch_preference_loss(pa.net.utilities, b, torch.device("cpu"))[1]["disagreement"].mean())
    assert disagreement(pa.pairs) > 1.5 * disagreement(pa.heldout)
    pa.close()


def test_eval_pairs_measure_the_head_on_fresh_segments_without_touching_feedback(tmp_path):
    rng = np.random.default_rng(12)
    learner = Learner(NET, AgentConfig(lr=3e-3), seed=0, pref_beta=1.0)
    train = [make_segment(rng, capacity_action=int(rng.integers(0, NET.sub_actions))) for _ in range(300)]
    by_id = {s.id: s for s in train}
    pairs = [PreferencePair(a.id, b.id, oracle_label(a, b, (1, 1, 1), 0.0, rng))
             for a, b in zip(train[0::2], train[1::2])]
    pairs = [p for p in pairs if p.label != 0.5]
    for _ in range(150):
        idx = rng.integers(0, len(pairs), size=32)
        learner.step(None, PreferenceBatch.from_pairs([pairs[i] for i in idx], by_id))
    fresh = [make_segment(rng, capacity_action=int(rng.integers(0, NET.sub_actions))) for _ in range(60)]
    clean = pref_actor(tmp_path, name="clean.log", oracle_error_rate=0.0)
    noisy = pref_actor(tmp_path, name="noisy.log", oracle_error_rate=1.0)  # every answer at random
    for pa in (clean, noisy):
        pa.add_segments(fresh)
        pa.rank(fresh[0].id, fresh[1].id)  # ranked segments are left out of the measurement
    size, state = os.path.getsize(clean.log.path), clean.rng.bit_generator.state
    ev = clean.eval_pair_accuracy(learner.net, pairs=300)
    assert ev["pairs"] == 300 and ev["strict_labels"] == ev["strict_rule"] > 100
    assert ev["accuracy"] == ev["accuracy_noise_free"] >= 0.9 and ev["label_ceiling"] == 1.0
    # measuring is not feedback: nothing logged, no pair kept, the query stream unchanged
    assert os.path.getsize(clean.log.path) == size and len(clean.pairs) == 1
    assert clean.rng.bit_generator.state == state
    untrained = Learner(NET, AgentConfig(), seed=1, pref_beta=1.0).net
    assert clean.eval_pair_accuracy(untrained, pairs=300)["accuracy_noise_free"] < 0.8
    evn = noisy.eval_pair_accuracy(learner.net, pairs=300)
    assert evn["accuracy_noise_free"] == ev["accuracy_noise_free"]  # same pairs, same rule
    assert abs(evn["accuracy"] - 0.5) < 0.12 and abs(evn["label_ceiling"] - 0.5) < 0.12
    small = pref_actor(tmp_path, name="small.log")
    small.add_segments(fresh[:3])
    assert small.eval_pair_accuracy(learner.net, pairs=50)["pairs"] == 3  # every pair of 3 segments, once
    assert small.eval_pair_accuracy(learner.net, pairs=0)["pairs"] == 0
    for pa in (clean, noisy, small):
        pa.close()


# -- exploration -------------------------------------------------------------------------
class _FixedUtilities(torch.nn.Module):
    """A stand-in network whose Q prefers sub-action 0 and whose utilities prefer n-1."""

    def __init__(self, S, D, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.pref = True
        self.shape = (S, D, n)

    def forward(self, macro, micro):
        q = torch.zeros(self.shape)
        q[..., 0] = 1.0
        return q

    def q_and_utilities(self, macro, micro):
        u = torch.zeros(self.shape)
        u[..., -1] = 5.0
        return self.forward(macro, micro), u


def test_exploration_draws_from_the_preference_softmax():
    S, D, n = 64, 4, 5
    net = _FixedUtilities(S, D, n)
    macro, micro = np.zeros((S, 1), np.float32), np.zeros((S, 1), np.float32)
    eps = np.ones(S)  # always explore
    soft = Explorer(S, D, eps, np.random.default_rng(0), softmax_temperature=1.0)
    uni = Explorer(S, D, eps, np.random.default_rng(0))
    a_soft = np.concatenate([soft.act(net, macro, micro)[0].ravel() for _ in range(20)])
    a_uni = np.concatenate([uni.act(net, macro, micro)[0].ravel() for _ in range(20)])
    p = np.exp(5.0) / (np.exp(5.0) + n - 1)  # softmax mass on the preferred sub-action
    assert (a_soft == n - 1).mean() == pytest.approx(p, abs=0.02)
    assert (a_uni == n - 1).mean() == pytest.approx(1 / n, abs=0.02)
    greedy = Explorer(S, D, np.zeros(S), np.random.default_rng(0), softmax_temperature=1.0)
    assert (greedy.act(net, macro, micro)[0] == 0).all()  # greedy choices are the critic's


# -- the local trainer with feedback -----------------------------------------------------
@pytest.mark.slow
def test_local_trainer_with_oracle_feedback(tmp_path):
    from apex_bdq.local_runner import LocalTrainer
    from apex_bdq.presets import PRESETS
    from apex_bdq.config import apply_overrides
    cfg = apply_overrides(PRESETS["smoke"], ["pref.enabled=true", "pref.segment_decisions=4", "pref.min_pairs=4",
                                             "pref.batch_pairs=4", "pref.oracle_pairs=40", "pref.shaping=0.1",
                                             "pref.warmup_updates=5", "pref.update_every=1", "max_env_ticks=400",
                                             "pref.oracle_pairs_per_min=6000", "minutes=2"])  # max_env_ticks ends it
    assert cfg.net.preference_ensemble == 3
    log = str(tmp_path / "run.log")
    tr = LocalTrainer(cfg, feedback_log=log, heldout_every=5)
    head0 = {k: v.clone() for k, v in tr.learner.net.state_dict().items() if k.startswith("pref.")}
    res = tr.run(progress=False)
    st = res["preference"]
    assert st["pairs"] + st["heldout_pairs"] == st["oracle_ranked"] > 10
    assert st["eval_pairs"] > 0 and 0.0 <= st["eval_pair_accuracy_noise_free"] <= 1.0  # the end-of-run measurement
    assert 0.0 <= res["exploration_overload_rate"] <= 1.0
    assert res["exploration_breach_rate_after_warmup"] is not None  # counted from update pref.warmup_updates
    head1 = tr.learner.net.state_dict()
    assert any(not torch.equal(head0[k], head1[k]) for k in head0)  # the learner trained the head
    assert tr.pref_active and tr.rollout.shaping == 0.1 and tr.rollout.explorer.temperature == cfg.pref.temperature
    tr.pref.close()
    _, segs, pairs = load_log(log)
    assert len(pairs) == st["oracle_ranked"] and all(p.a in segs and p.b in segs for p in pairs)


def test_feedback_cli_on_a_log_without_a_cluster(tmp_path, capsys):
    from launch import feedback
    rng = np.random.default_rng(8)
    actor = pref_actor(tmp_path)
    segs = [make_segment(rng, sid=f"s{i}") for i in range(3)]
    actor.add_segments(segs)
    actor.rank("s0", "s1")
    actor.close()
    log = str(tmp_path / "fb.log")
    assert feedback.main(["--log", log, "list"]) == 0
    out = capsys.readouterr().out
    assert "s0" in out and "s1" in out and "s2" not in out  # only ranked segments live in the log
    assert feedback.main(["--log", log, "show", "s1", "--out", str(tmp_path / "s1.png")]) == 0
    assert (tmp_path / "s1.png").stat().st_size > 1000
    capsys.readouterr()
    assert feedback.main(["--log", log, "rank", "s1", "s0", "--tie"]) == 0
    assert capsys.readouterr().out.startswith("duplicate")
    assert feedback.main(["--log", log, "rank", "s0", "s9"]) == 2
    assert "unknown segment id 's9'" in capsys.readouterr().err
    assert feedback.main(["--log", str(tmp_path / "missing.log"), "list"]) == 2
    _, _, pairs = load_log(log)
    assert [(p.a, p.b) for p in pairs] == [("s0", "s1")]  # the tie on the same two was a duplicate


@pytest.mark.slow
def test_preference_fit_benchmark_on_a_log(tmp_path):
    """`launch.bench preference-fit` fits a head on a log's training pairs and ranks its
    held-out segments; a checkpoint of another network shape is refused."""
    import json

    from launch import bench
    from launch.bench_preference_fit import bench_preference_fit
    rng = np.random.default_rng(21)
    pa = PreferenceActor(NET, PreferenceConfig(enabled=True, oracle_pairs=120, oracle_every=120, oracle_error_rate=0.0,
                                               oracle_pairs_per_min=0),
                         str(tmp_path / "fit.log"), seed=0, heldout_every=4)
    pa.add_segments([make_segment(rng, capacity_action=int(rng.integers(0, NET.sub_actions))) for _ in range(300)])
    assert pa.oracle_step() == 120
    pa.close()
    res = bench_preference_fit(str(tmp_path / "fit.log"), steps=120, lr=3e-3, random_count=400, evals=2)
    assert res["log_training_pairs"] == 90 and res["heldout_pairs_strict"] > 10 and res["random_pairs"] > 200
    first, last = res["curve"]
    assert last["step"] == 120 and last["random_accuracy_noise_free"] >= 0.9
    assert last["heldout_accuracy"] == last["heldout_accuracy_noise_free"]  # the oracle made no random answers
    dense = bench_preference_fit(str(tmp_path / "fit.log"), steps=20, dense=500, random_count=50, evals=1)
    assert dense["training_pairs"] == 500 and dense["dense"] == 500
    other = NetConfig.for_sim(SimConfig(history=4), preference_ensemble=3)  # another observation shape
    from apex_bdq.checkpoint import config_to_dict, save_checkpoint
    from apex_bdq.presets import PRESETS
    smoke = PRESETS["smoke"]
    save_checkpoint(tmp_path / "other.pt",
                    config_to_dict(dataclasses.replace(smoke, sim=smoke.sim.replace(history=4), net=other)),
                    Learner(other, AgentConfig(), seed=0).state_dict(), {})
    with pytest.raises(SystemExit, match="history"):
        bench_preference_fit(str(tmp_path / "fit.log"), str(tmp_path / "other.pt"), steps=1)
    out = tmp_path / "fit.json"
    assert bench.main(["preference-fit", "--log", str(tmp_path / "fit.log"), "--steps", "4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["final"]["step"] == 4


def test_a_format_1_log_is_read_and_converted_losing_nothing(tmp_path):
    import struct
    import zlib

    import msgpack
    path = tmp_path / "old.log"
    recs = [{"kind": "meta", "net": {"x": 1}}] + [{"kind": "pair", "a": f"a{i}", "b": f"b{i}", "label": 1.0}
                                                  for i in range(5)]
    data = b""
    for r in recs:  # format 1: <length, CRC-32> + payload, no magics
        p = msgpack.packb(r, use_bin_type=True)
        data += struct.pack("<II", len(p), zlib.crc32(p)) + p
    path.write_bytes(data)
    assert list(FeedbackLog(str(path), readonly=True).records()) == recs  # read in place, untouched
    assert path.read_bytes() == data
    with pytest.warns(RuntimeWarning, match="format 1 converted"):
        log = FeedbackLog(str(path))
    log.append({"kind": "pair", "a": "new", "b": "n", "label": 0.5})
    log.close()
    assert (tmp_path / "old.log.v1").read_bytes() == data  # the original kept
    assert [r.get("a") for r in FeedbackLog(str(path), readonly=True).records()] == [None] + [
        f"a{i}" for i in range(5)] + ["new"]


def test_a_damaged_file_magic_loses_no_record(tmp_path):
    path = str(tmp_path / "x.log")
    _ten_record_log(path)
    raw = bytearray(open(path, "rb").read())
    raw[2] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    with pytest.warns(RuntimeWarning, match="file magic is damaged"):
        assert len(list(FeedbackLog(path, readonly=True).records())) == 10


def test_a_writer_waits_for_the_lock_of_a_writer_that_is_going(tmp_path):
    """A restarted preference actor may start while its predecessor's process still exits."""
    import threading
    path = str(tmp_path / "x.log")
    old = FeedbackLog(path)
    threading.Timer(0.3, old.close).start()
    new = FeedbackLog(path, lock_wait_s=10.0)  # gets it once the old one lets go
    new.append({"kind": "pair", "a": "a", "b": "b", "label": 1.0})
    new.close()
    assert [r["a"] for r in FeedbackLog(path, readonly=True).records()] == ["a"]
