"""Exponential backoff, the one copy: the sinks, the health actions and the NVML session's
re-initialisation all wait through :class:`Backoff`.

It lives below every layer (it imports nothing of gpumon) so a collector may take it as well as a
sink: with ``jitter=NO_JITTER`` it doubles exactly, as the NVML session does for a driver that is
away (a single host retrying a local library needs no spreading out).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["NO_JITTER", "Backoff"]

NO_JITTER = (1.0, 1.0)
"""The ``jitter`` range of a backoff that waits exactly its nominal delay."""


@dataclass
class Backoff:
    """Exponential backoff with jitter, honouring the server's Retry-After, capped at ``maximum``.

    Each failure doubles the previous delay (before jitter), starting from ``initial`` or the
    failure's ``floor`` (a configuration fault a person has to fix waits longer), whichever is
    longer, up to ``maximum``; success starts over. Jitter matters: a fleet of hosts that lost the
    same endpoint must not retry in step.
    """

    initial: float
    maximum: float
    failures: int = 0
    not_before: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    jitter: tuple[float, float] = (0.5, 1.0)
    """The delay is the nominal one times a uniform draw from this range (:data:`NO_JITTER`: none)."""
    retry_after_max: float | None = None
    """The longest Retry-After honoured; None: ``maximum``."""
    retry_after_exact: bool = False
    """True: a Retry-After is the delay, shorter than the backoff's or not; False: it only lengthens it.
    Either way a Retry-After of 0 (or none) leaves the backoff's delay."""
    nominal: float = 0.0
    """The latest delay before jitter (0 after a success): the next failure doubles it."""

    def failed(self, now: float, retry_after: float | None = None, floor: float | None = None) -> float:
        """Record a failure at monotonic ``now``; return the delay before the next try."""
        base = self.initial if floor is None else max(self.initial, floor)
        self.nominal = self._next_nominal(base)
        low, high = self.jitter
        delay = self.nominal * (low + (high - low) * self.rng.random())
        if retry_after:
            longest = self.maximum if self.retry_after_max is None else self.retry_after_max
            honoured = min(retry_after, longest)
            delay = honoured if self.retry_after_exact else max(delay, honoured)
        self.failures += 1
        self.not_before = now + delay
        return delay

    def next_delay(self) -> float:
        """The nominal delay (before jitter, without a floor) the next failure would get; records
        nothing. For a wait that is not a failure of its own, as the NVML session's after a driver
        went away under a working session."""
        return self._next_nominal(self.initial)

    def _next_nominal(self, base: float) -> float:
        return min(self.maximum, max(base, self.nominal * 2))

    def succeeded(self) -> None:
        self.failures = 0
        self.not_before = 0.0
        self.nominal = 0.0
