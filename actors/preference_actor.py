"""PreferenceActor: keeps trajectory segments, collects ranked pairs (synthetic oracle,
people), logs every accepted pair durably, and serves PreferenceBatches to the learner.

The plain class is the whole component (the local trainer and the feedback CLI's offline
mode use it directly); `remote_preference_class` is the thin Ray shell of a distributed run,
registered under PREFERENCE_ACTOR_NAME so the CLI and the Serve endpoint can find it.

Durability contract: `rank` returns only after the pair (and the segments it names, the
first time) are fsynced to the feedback log; on start the log is replayed, so a restart
finds every pair it ever accepted, with the segment data the learner needs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from apex_bdq.config import NetConfig, PreferenceConfig
from apex_bdq.messages import PreferenceStats
from apex_bdq.preference import (FeedbackError, FeedbackLog, PreferenceBatch, PreferencePair, Segment, pair_records,
                                 UnknownSegment, label_ceiling, oracle_label, random_pairs, replay_log,
                                 segment_summary)
from learner.learner import batch_preference_loss, ranking_accuracy

PREFERENCE_ACTOR_NAME = "apex_bdq_preference"
NAMESPACE = "apex_bdq"


class PreferenceActor:
    def __init__(self, net_cfg: NetConfig, cfg: PreferenceConfig, log_path: str, seed: int = 0,
                 heldout_every: int = 0, readonly: bool = False) -> None:
        """heldout_every > 0 keeps every k-th oracle-ranked pair out of training, to measure
        how well the head ranks pairs it never saw. readonly: open the log for reading only
        (launch.feedback list / show beside a run that writes it); ranking is then refused."""
        self.net_cfg, self.cfg = net_cfg, cfg
        self.rng = np.random.default_rng(seed)
        self.unranked: OrderedDict[str, Segment] = OrderedDict()  # bounded, oldest first
        self.ranked: dict[str, Segment] = {}  # referenced by an accepted pair: kept for good
        self.pairs: list[PreferencePair] = []
        self.heldout: list[PreferencePair] = []
        self.heldout_ids: set = set()  # segments of held-out pairs: never in a training pair
        self.keys: set = set()
        self.heldout_every = heldout_every
        self.oracle_ranked = 0
        self.refused = 0
        self.duplicates = 0
        self.net = None  # a copy for ensemble disagreement; set_weights fills it
        self.weights_version = -1
        self.log = FeedbackLog(log_path, readonly=readonly)
        meta, segs, pairs = replay_log(self.log)
        shapes = log_shapes(net_cfg)
        if meta is None and not readonly:
            self.log.append({"kind": "meta", "net": shapes})
        elif meta is not None and dict(meta["net"]) != shapes:
            self.log.close()
            raise FeedbackError(f"feedback log {log_path!r} holds segments of a network shaped {dict(meta['net'])}, "
                                f"this run's is {shapes}")
        self.ranked.update(segs)
        for p in pairs:
            if p.key() not in self.keys and p.a in self.ranked and p.b in self.ranked:
                self.keys.add(p.key())
                (self.heldout if p.heldout else self.pairs).append(p)
                if p.heldout:
                    self.heldout_ids.update((p.a, p.b))
        self.replayed_pairs = len(self.pairs) + len(self.heldout)
        self.oracle_ranked = sum(p.source == "oracle" for p in self.pairs + self.heldout)  # its budget is spent
        self.clock = time.monotonic  # pacing of the oracle (tests set their own clock)
        self._pace_start: Optional[float] = None
        self._pace_base = self.oracle_ranked

    # -- segments ---------------------------------------------------------------------------
    def _check(self, s: Segment) -> None:
        c = self.net_cfg
        s.check(c.macro_features, (c.num_classes, c.history, c.micro_features), c.num_branches, c.sub_actions)

    def add_segments(self, segments: list[Segment]) -> list[str]:
        """Keep segments for ranking; returns their ids. A malformed one raises FeedbackError
        naming it, and none of the batch is kept."""
        for s in segments:
            self._check(s)
        for s in segments:
            if s.id in self.ranked or s.id in self.unranked:
                continue
            self.unranked[s.id] = s
        while len(self.unranked) > self.cfg.store_segments:
            self.unranked.popitem(last=False)
        return [s.id for s in segments]

    def submit(self, segments: list[Segment]) -> int:
        """What a rollout worker calls: keep the segments, then let the oracle rank its
        share of pairs. Returns the pairs ranked."""
        self.add_segments(segments)
        n = self.oracle_step() if self.cfg.oracle_pairs > 0 else 0
        if n:
            from apex_bdq import metrics as M
            M.record(M.FEEDBACK_PAIRS, len(self.pairs), "preference", 0)
        return n

    def segment(self, sid: str) -> Segment:
        s = self.unranked.get(sid) or self.ranked.get(sid)
        if s is None:
            raise UnknownSegment(f"unknown segment id {sid!r} (it was never added, or it was dropped from the "
                                 f"store of {self.cfg.store_segments} unranked segments)")
        return s

    def list_segments(self, limit: int = 50, unranked_only: bool = False) -> list[dict]:
        """Newest first, unranked before ranked."""
        out = [dict(segment_summary(s), ranked=False) for s in reversed(self.unranked.values())]
        if not unranked_only:
            out += [dict(segment_summary(s), ranked=True) for s in self.ranked.values()]
        return out[:limit]

    # -- feedback ---------------------------------------------------------------------------
    def rank(self, a: str, b: str, label: float = 1.0, source: str = "human", heldout: bool = False) -> str:
        """Accept "a is preferred to b" (label 1.0; 0.0 = b preferred, 0.5 = tie). Returns
        'accepted' once durable, or 'duplicate' when the two were already ranked. Unknown ids
        and malformed pairs raise FeedbackError / UnknownSegment with the reason."""
        return self._rank_all([(a, b, label, heldout)], source)[0]

    def _rank_all(self, items: list[tuple], source: str) -> list[str]:
        """Rank (a, b, label, heldout) items with one fsynced append for all the accepted ones
        (segments first, then their pair): durable before any of them counts."""
        out, accepted, new_ids = [], [], set()
        for a, b, label, heldout in items:
            pair = PreferencePair(a=a, b=b, label=float(label) if isinstance(label, (int, float)) else label,
                                  source=str(source), time=time.time(), heldout=bool(heldout))
            try:
                pair.check()
                sa, sb = self.segment(a), self.segment(b)
            except FeedbackError:
                self.refused += 1
                raise
            if pair.key() in self.keys or any(pair.key() == p.key() for p, _ in accepted):
                self.duplicates += 1
                out.append("duplicate")
                continue
            new = [s for s in (sa, sb) if s.id not in self.ranked and s.id not in new_ids]
            new_ids.update(s.id for s in new)
            accepted.append((pair, new))
            out.append("accepted")
        if accepted:
            self.log.append(*(r for pair, new in accepted for r in pair_records(pair, new)))
        for pair, new in accepted:
            for s in new:
                self.ranked[s.id] = s
                self.unranked.pop(s.id, None)
            self.keys.add(pair.key())
            (self.heldout if pair.heldout else self.pairs).append(pair)
            if pair.heldout:
                self.heldout_ids.update((pair.a, pair.b))
        return out

    def rank_many(self, pairs: list[dict], segments: Optional[list[Segment]] = None,
                  source: str = "human") -> list[str]:
        """Several rankings at once (what Serve's /v1/feedback calls): inline `segments` are
        kept first, then every pair {a, b, label} is checked before any is accepted, so a bad
        pair (named by its index) refuses the whole request and nothing half-lands. Returns
        'accepted' / 'duplicate' per pair, each accepted one durable in the log."""
        segments = segments or []
        for s in segments:
            self._check(s)
        inline = {s.id for s in segments}
        for i, p in enumerate(pairs):
            try:
                PreferencePair(a=p["a"], b=p["b"], label=float(p.get("label", 1.0)), source=source).check()
                for sid in (p["a"], p["b"]):
                    if sid not in inline:
                        self.segment(sid)
            except FeedbackError as e:
                self.refused += 1
                raise type(e)(f"pairs[{i}]: {e}") from None
        if segments:  # only once every pair is known good: a refused request stores nothing
            self.add_segments(segments)
        # one fsynced append for the whole request: its cost does not grow with an fsync per pair,
        # so a full request (serving.MAX_PAIRS) holds this actor, which rollout actors also call, briefly
        return self._rank_all([(p["a"], p["b"], float(p.get("label", 1.0)), False) for p in pairs], source)

    def oracle_allowance(self) -> int:
        """Pairs the oracle may still rank now: its budget (`pref.oracle_pairs`), paced like a
        labeller at `pref.oracle_pairs_per_min` after a first `pref.min_pairs` (so the head
        sees the segments of the policy as it changes, not only of the first minute)."""
        left = self.cfg.oracle_pairs - self.oracle_ranked
        rate = self.cfg.oracle_pairs_per_min
        if rate <= 0 or left <= 0:
            return max(left, 0)
        now = self.clock()
        if self._pace_start is None:
            self._pace_start = now
        paced = self._pace_base + self.cfg.min_pairs + int(rate * (now - self._pace_start) / 60.0)
        return max(0, min(left, paced - self.oracle_ranked))

    def oracle_step(self, k: Optional[int] = None) -> int:
        """Let the synthetic oracle rank up to k pairs (within its budget and pace,
        `oracle_allowance`); the pairs asked about are the most disputed by the ensemble, or
        random without one (held-out pairs: at random). A segment may be in several pairs; at
        least one side of a query is not ranked yet."""
        k = min(self.cfg.oracle_every if k is None else k, self.oracle_allowance())
        done = tries = 0
        while done < k and self.oracle_ranked < self.cfg.oracle_pairs and self.unranked and tries < 4 * k:
            tries += 1
            held = self.heldout_every > 0 and (self.oracle_ranked + 1) % self.heldout_every == 0
            q = self._query(fresh_only=held, disputed=not held)
            if q is None:
                break
            a, b = self.segment(q[0]), self.segment(q[1])
            label = oracle_label(a, b, self.cfg.oracle_weights, self.cfg.oracle_error_rate, self.rng,
                                 tie_margin=self.cfg.oracle_tie_margin)
            if self.rank(a.id, b.id, label, source="oracle", heldout=held) == "accepted":
                self.oracle_ranked += 1
                done += 1
        return done

    def _query(self, fresh_only: bool = False, disputed: bool = True) -> Optional[tuple[str, str]]:
        """fresh_only: both sides unranked (a held-out pair: its segments are in no
        training pair, then or later). disputed: the most disputed candidate when an ensemble
        is on; a held-out pair is drawn at random instead (a test set follows the data, not the
        query rule: pairs the ensemble disputes most are the hardest to rank)."""
        new = list(self.unranked)
        pool = new if fresh_only else new + [i for i in self.ranked if i not in self.heldout_ids]
        if len(pool) < 2:
            return None
        cand = []
        for _ in range(self.cfg.query_candidates):
            a = new[int(self.rng.integers(len(new)))]
            b = pool[int(self.rng.integers(len(pool)))]
            if a != b and PreferencePair(a, b).key() not in self.keys:
                cand.append((a, b))
        if not cand:
            return None
        if not disputed or self.net is None or self.net_cfg.preference_ensemble < 2 or len(cand) == 1:
            return cand[0]
        batch = PreferenceBatch.from_pairs([PreferencePair(a, b) for a, b in cand], {**self.ranked, **self.unranked})
        with torch.no_grad():
            _, ex = batch_preference_loss(self.net.utilities, batch, next(self.net.parameters()).device)
        return cand[int(ex["disagreement"].argmax())]

    # -- learner side -----------------------------------------------------------------------
    def set_weights(self, state_dict: dict, version: int) -> None:
        """The current network (tensors or numpy arrays), for ensemble disagreement."""
        if self.net is None:
            from apex_bdq.networks import BDQNetwork
            self.net = BDQNetwork(self.net_cfg).requires_grad_(False)
        self.net.load_state_dict({k: torch.as_tensor(v) for k, v in state_dict.items()})
        self.weights_version = version

    def sample(self, batch_pairs: Optional[int] = None) -> Optional[PreferenceBatch]:
        """A batch of ranked training pairs (uniform), or None before `min_pairs` exist."""
        if len(self.pairs) < self.cfg.min_pairs:
            return None
        k = batch_pairs or self.cfg.batch_pairs
        idx = self.rng.integers(0, len(self.pairs), size=k)
        return PreferenceBatch.from_pairs([self.pairs[i] for i in idx], self.ranked)

    def rule_label(self, a: Segment, b: Segment, rng: np.random.Generator) -> float:
        """The oracle's rule without its random answers: what a perfect labeller would say."""
        return oracle_label(a, b, self.cfg.oracle_weights, 0.0, rng, tie_margin=self.cfg.oracle_tie_margin)

    def _heldout_with_rule(self) -> tuple[list[PreferencePair], list[float]]:
        """Held-out pairs whose segments are known, and the rule's label of each."""
        rng = np.random.default_rng(0)  # not self.rng: measuring changes no later query
        ps = [p for p in self.heldout if p.a in self.ranked and p.b in self.ranked]
        return ps, [self.rule_label(self.ranked[p.a], self.ranked[p.b], rng) for p in ps]

    def heldout_accuracy(self, net, noise_free: bool = False) -> float:
        """Share of held-out strict pairs the ensemble-mean head ranks as labelled, or with
        `noise_free`, as the oracle's rule ranks them without its random answers (the labels
        a perfect labeller would give; ties left out)."""
        ps, rule = self._heldout_with_rule()
        if noise_free:
            ps = [dataclasses.replace(p, label=r) for p, r in zip(ps, rule)]
        return ranking_accuracy(net.utilities, ps, self.ranked, next(net.parameters()).device)

    def heldout_label_ceiling(self) -> float:
        """What a perfect ranker scores on the held-out strict labels given (`label_ceiling`):
        random answers cap `heldout_accuracy` there, whatever the head learns."""
        ps, rule = self._heldout_with_rule()
        return label_ceiling([p.label for p in ps], rule)

    def eval_pair_accuracy(self, net, pairs: Optional[int] = None, seed: int = 0) -> dict:
        """How well the head ranks random pairs it never saw, precisely: `pairs` (default
        `pref.eval_pairs`) random pairs of unranked segments (in no training pair) are labelled
        here by the oracle -- with its random answers, and by its rule without them -- for
        this measurement only: they are not logged, not trained on and not counted as feedback.
        Returns accuracy against the labels given (`accuracy`), against the rule
        (`accuracy_noise_free`), what a perfect ranker scores against the labels given
        (`label_ceiling`) and the strict pairs each figure is over. The in-run held-out pairs
        (`heldout_accuracy`) are ~80, so that figure moves by +-0.04 from run to run."""
        n = self.cfg.eval_pairs if pairs is None else int(pairs)
        ids = [i for i in self.unranked if i not in self.heldout_ids]
        rng = np.random.default_rng(seed)  # not self.rng: measuring changes no later query
        drawn = random_pairs(ids, n, rng) if n >= 1 else []
        given, rule = [], []
        for p in drawn:
            a, b = self.unranked[p.a], self.unranked[p.b]
            given.append(dataclasses.replace(p, label=oracle_label(
                a, b, self.cfg.oracle_weights, self.cfg.oracle_error_rate, rng, tie_margin=self.cfg.oracle_tie_margin)))
            rule.append(dataclasses.replace(p, label=self.rule_label(a, b, rng)))
        dev = next(net.parameters()).device
        return {"pairs": len(drawn),
                "accuracy": ranking_accuracy(net.utilities, given, self.unranked, dev),
                "accuracy_noise_free": ranking_accuracy(net.utilities, rule, self.unranked, dev),
                "label_ceiling": label_ceiling([p.label for p in given], [p.label for p in rule]),
                "strict_labels": sum(p.label != 0.5 for p in given), "strict_rule": sum(p.label != 0.5 for p in rule)}

    def pair_keys(self) -> list[tuple[str, str]]:
        """Every accepted pair (training and held out), as its order-free key."""
        return [p.key() for p in self.pairs + self.heldout]

    def where(self) -> dict:
        """The node and process this actor runs in (restarts land wherever Ray places them)."""
        import ray
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def stats(self) -> PreferenceStats:
        return PreferenceStats(pairs=len(self.pairs), heldout_pairs=len(self.heldout), oracle_ranked=self.oracle_ranked,
                               unranked_segments=len(self.unranked), ranked_segments=len(self.ranked),
                               refused=self.refused, duplicates=self.duplicates, replayed_pairs=self.replayed_pairs,
                               log_path=self.log.path, pid=os.getpid(), log_corrupt_records=self.log.corrupt_records,
                               log_torn_bytes=self.log.torn_bytes, log_orphan_pairs=self.log.orphan_pairs)

    def close(self) -> None:
        self.log.close()


def log_shapes(net_cfg: NetConfig) -> dict:
    """What a feedback log's segments must match: observation and action shapes."""
    return {k: int(getattr(net_cfg, k)) for k in NetConfig.SHAPE_FIELDS}


def remote_preference_class(max_restarts: int = -1):
    """The Ray actor class (lazily, so the core stays importable without Ray). A restarted
    actor replays its feedback log: accepted pairs survive the crash."""
    import ray
    return ray.remote(max_restarts=max_restarts, max_task_retries=0)(PreferenceActor)
