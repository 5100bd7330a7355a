"""n-step returns over S parallel shards (numpy, no Ray).

Each tick the accumulator takes (obs, action, reward) of every shard and, once n ticks are
buffered, emits for each shard the transition
    (s_t, a_t, R = r_t + g r_{t+1} + ... + g^{n-1} r_{t+n-1}, discount = g^n, s_{t+n}).
The platform never terminates; episodes end by a time limit, so `flush` emits the shorter
tails with discount g^k and bootstrap from the last observation (a truncation is not a
terminal state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class Transitions:
    """A batch of n-step transitions (numpy, host memory)."""

    macro: np.ndarray  # [M, Fm] float32, s_t
    micro: np.ndarray  # [M, K, H, Fu] float32
    action: np.ndarray  # [M, D] uint8
    reward: np.ndarray  # [M] float32, R^(n)
    discount: np.ndarray  # [M] float32, gamma^k
    next_macro: np.ndarray  # [M, Fm] float32, s_{t+k}
    next_micro: np.ndarray  # [M, K, H, Fu] float32
    q_taken: Optional[np.ndarray] = None  # [M, D] float32: Q_d(s_t, a_t) as the actor saw it, when pushed
    priority: Optional[np.ndarray] = None  # [M] float32: initial |TD| priority, when the actor computed it

    def __len__(self) -> int:
        return len(self.reward)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("macro", "micro", "action", "reward", "discount", "next_macro",
                                              "next_micro")}

    @staticmethod
    def concat(parts: list["Transitions"]) -> "Transitions":
        out = Transitions(**{k: np.concatenate([getattr(p, k) for p in parts]) for k in parts[0].as_dict()})
        for k in ("q_taken", "priority"):  # kept only when every part has it
            if all(getattr(p, k) is not None for p in parts):
                setattr(out, k, np.concatenate([getattr(p, k) for p in parts]))
        return out


class NStepAccumulator:
    def __init__(self, num_shards: int, n: int, gamma: float) -> None:
        if n < 1:
            raise ValueError(f"n-step n must be >= 1, got {n}")
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        self.S, self.n, self.gamma = num_shards, n, gamma
        self.powers = (gamma ** np.arange(n)).astype(np.float64)  # [n]
        self.reset()

    def reset(self) -> None:
        self.macro: list[np.ndarray] = []
        self.micro: list[np.ndarray] = []
        self.action: list[np.ndarray] = []
        self.reward: list[np.ndarray] = []
        self.q_taken: list[Optional[np.ndarray]] = []

    def push(self, macro: np.ndarray, micro: np.ndarray, action: np.ndarray, reward: np.ndarray,
             next_macro: np.ndarray, next_micro: np.ndarray, q_taken: Optional[np.ndarray] = None) -> Transitions | None:
        """Add one tick of all shards; return the S transitions that are now complete, if any.

        `macro`/`micro` are s_t (copied), `next_*` are s_{t+1} (used only as the bootstrap of
        the transition completed now). `q_taken` [S, D], optional: the actor's Q_d(s_t, a_t),
        carried to the transition that starts at s_t (for its initial priority)."""
        self.macro.append(np.array(macro, copy=True))
        self.micro.append(np.array(micro, copy=True))
        self.action.append(np.asarray(action, dtype=np.uint8))
        self.reward.append(np.asarray(reward, dtype=np.float64))
        self.q_taken.append(None if q_taken is None else np.asarray(q_taken, dtype=np.float32))
        if len(self.reward) < self.n:
            return None
        ret = np.tensordot(self.powers, np.stack(self.reward), axes=1)  # [S]
        out = Transitions(macro=self.macro[0], micro=self.micro[0], action=self.action[0],
                          reward=ret.astype(np.float32), discount=np.full(self.S, self.gamma ** self.n, np.float32),
                          next_macro=np.array(next_macro, copy=True), next_micro=np.array(next_micro, copy=True),
                          q_taken=self.q_taken[0])
        for buf in (self.macro, self.micro, self.action, self.reward, self.q_taken):
            buf.pop(0)
        return out

    def flush(self, last_macro: np.ndarray, last_micro: np.ndarray) -> Transitions | None:
        """Emit the k < n step tails at a time-limit end, bootstrapping from the last obs."""
        parts = []
        k_total = len(self.reward)
        for i in range(k_total):
            k = k_total - i
            ret = np.tensordot(self.powers[:k], np.stack(self.reward[i:]), axes=1)
            parts.append(Transitions(macro=self.macro[i], micro=self.micro[i], action=self.action[i],
                                     reward=ret.astype(np.float32),
                                     discount=np.full(self.S, self.gamma ** k, np.float32),
                                     next_macro=np.array(last_macro, copy=True),
                                     next_micro=np.array(last_micro, copy=True), q_taken=self.q_taken[i]))
        self.reset()
        return Transitions.concat(parts) if parts else None
