"""A Reverb-style rate limiter: a minimum size before sampling, and an optional ratio of
sampled to inserted transitions held within an error buffer (Cassirer et al. 2021, "Reverb",
`SampleToInsertRatio`).

With `samples_per_insert = r`, let diff = inserted * r - sampled. A chunk may be inserted
while diff <= min_size r + error_buffer, a batch sampled while diff >= min_size r -
error_buffer and the replay holds at least min_size (each check before the operation, so
one chunk or batch may overshoot and neither side can deadlock the other). So the
learner cannot run ahead of the actors by more than the buffer, nor the actors ahead of the
learner; `samples_per_insert=None` turns the ratio off (Ape-X's free-running mode), keeping
only the minimum size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RateLimiter:
    min_size: int = 1
    samples_per_insert: Optional[float] = None
    error_buffer: float = 0.0

    def __post_init__(self) -> None:
        if self.min_size < 1:
            raise ValueError(f"rate limiter min_size must be >= 1, got {self.min_size}")
        if self.samples_per_insert is not None:
            if not self.samples_per_insert > 0:
                raise ValueError(f"samples_per_insert must be > 0 or None, got {self.samples_per_insert}")
            if self.error_buffer < 0:
                raise ValueError(f"error_buffer must be >= 0, got {self.error_buffer}")

    def can_insert(self, inserted: int, sampled: int, m: int) -> bool:
        r = self.samples_per_insert
        if r is None:
            return True
        return inserted * r - sampled <= self.min_size * r + self.error_buffer

    def can_sample(self, size: int, inserted: int, sampled: int, b: int) -> bool:
        if size < self.min_size:
            return False
        r = self.samples_per_insert
        if r is None:
            return True
        return inserted * r - sampled >= self.min_size * r - self.error_buffer
