"""How the client retries writes and stops waiting on a failing service: :class:`RetryPolicy` (ends of
conversations and message batches) and :class:`CircuitBreaker` (memory reads)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How ``conv.end()`` and the background sending of messages retry transient failures: capped
    exponential backoff with full jitter."""

    attempts: int = 4
    base_delay: float = 0.1
    max_delay: float = 2.0
    #: Seconds each attempt may take.
    attempt_timeout: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")
        if min(self.base_delay, self.max_delay) < 0 or self.attempt_timeout <= 0:
            raise ValueError("RetryPolicy delays must be >= 0 and attempt_timeout > 0")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1``; a server's ``Retry-After`` is honoured up to
        ``max_delay``."""
        jittered = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
        return max(jittered, min(retry_after or 0.0, self.max_delay))

    @property
    def worst_case(self) -> float:
        """The longest ``conv.end()`` can take before it returns a queued result."""
        return self.attempts * self.attempt_timeout + (self.attempts - 1) * self.max_delay


class CircuitBreaker:
    """Stops reads from waiting on a service that keeps failing.

    After ``failures`` transient failures in a row the circuit opens: reads answer "unavailable" at once.
    After ``reset_after`` seconds one read (the probe) is let through; its success closes the circuit, its
    failure opens it again for another ``reset_after``. A successful end of a conversation closes it too.
    """

    def __init__(self, failures: int = 5, reset_after: float = 5.0) -> None:
        if failures < 1 or reset_after < 0:
            raise ValueError("CircuitBreaker needs failures >= 1 and reset_after >= 0")
        self.failures = failures
        self.reset_after = reset_after
        self._count = 0
        self._open_until = 0.0
        self._probing = False

    def __repr__(self) -> str:
        return (
            f"<CircuitBreaker {'open' if self.is_open else 'closed'} failures={self._count}/{self.failures}>"
        )

    @property
    def is_open(self) -> bool:
        return self._count >= self.failures

    def allow(self) -> bool:
        if not self.is_open:
            return True
        if self._probing or time.monotonic() < self._open_until:
            return False
        self._probing = True  # half-open: this one read is the probe
        return True

    def success(self) -> None:
        self._count = 0
        self._probing = False

    def release(self) -> None:
        """The probe ended without a verdict (it was cancelled, or the request itself was wrong): the next
        read may probe again; the circuit stays as it was."""
        self._probing = False

    def failure(self) -> None:
        self._count += 1
        self._probing = False
        if self._count >= self.failures:
            self._open_until = time.monotonic() + self.reset_after
