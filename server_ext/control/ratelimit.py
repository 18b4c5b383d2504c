"""A token bucket on bytes copied by swaps (pure logic).

A per-request-id refresh budget protects nothing: a caller that sends a new
id per swap gets a fresh budget each time. What must be bounded is the work
swaps put on the host link, whoever asks, so the server meters bytes copied
per second. The burst is at least one full slot-bank load, so any single
valid swap can pass when the bucket is full.
"""

from __future__ import annotations

import time
from typing import Callable


class TokenBucket:
    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic):
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be positive")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self._clock = clock
        self._tokens = float(capacity)
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now

    @property
    def available(self) -> float:
        self._refill()
        return self._tokens

    def try_take(self, amount: float) -> float:
        """Take ``amount`` tokens and return 0.0, or take none and return the seconds to wait."""
        self._refill()
        amount = min(float(amount), self.capacity)
        if amount <= self._tokens:
            self._tokens -= amount
            return 0.0
        return (amount - self._tokens) / self.rate
