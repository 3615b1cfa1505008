"""What a receiver's 413 answers taught about its body limit.

A proxy in front of a fleet's receiver with a small body limit answers 413 to every request over it.
Splitting each refused request in halves until the parts go works once; doing it again for every
snapshot sends twice as many requests as there are series. So the smallest body refused is
remembered and later requests are split *before* they are sent, and the largest body accepted tells
a 413 about size (nothing that large went before) from one that is not (it refused what it took).
The memory fades after ``memory`` seconds, so a limit raised later is found again.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY = 600.0
"""Seconds a refused size is remembered after the latest 413."""


@dataclass
class BodyLimit:
    """The smallest compressed body answered 413 and the largest accepted, in bytes."""

    memory: float = MEMORY
    refused: int | None = None
    accepted: int = 0
    refused_at: float = 0.0

    def fits(self, size: int, now: float) -> bool:
        """Whether a body of ``size`` bytes is worth sending whole: smaller than any refused lately."""
        if self.refused is not None and now - self.refused_at > self.memory:
            self.refused = None  # forgotten: the receiver's limit may have been raised meanwhile
        return self.refused is None or size < self.refused

    def was_refused(self, size: int, now: float) -> bool:
        """Record a 413 for ``size`` bytes; True when it is about size (nothing that large was accepted),
        False when the receiver refused what it took before (its limit shrank, or its 413s are not
        about size at all)."""
        about_size = size > self.accepted
        if not about_size:
            self.accepted = 0
        if self.refused is None or size < self.refused:
            self.refused = size
        self.refused_at = now
        return about_size

    def was_accepted(self, size: int) -> None:
        self.accepted = max(self.accepted, size)
        if self.refused is not None and size >= self.refused:
            self.refused = None  # the limit went up
