"""The one retry loop of the project (tenacity), for the API client ``client`` builds.

Owns the waits: jittered exponential backoff from 0.8 s to 30 s, ``Retry-After`` honoured, a
slower ladder (to a minute) for reported problems, and an immediate first relist after a 410.
What is retried is decided by ``errors.decision`` (the one table), never here. The list, each
watch window and the 410 relist of ``reflector`` and every Event of ``events`` go through
``retrying``. Must not classify errors, count or hold state between calls: each call of the
returned object starts from the first step again (a success resets the backoff).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import structlog
import tenacity

from gpuguard.adapters.kube.errors import Decision, RetryAfter, decision

log = structlog.get_logger(__name__)

BACKOFF_INITIAL_SECONDS = 0.8
BACKOFF_MAX_SECONDS = 30.0
REPORTED_RETRY_SECONDS = 60.0
"""Longest wait between retries of a reported problem (403, 404, 422). RBAC that is really
missing does not fix itself in a second, so the ladder climbs to a minute (never a crash-loop,
matrix F6); but a 403 is also what a restarted API server answers while its RBAC cache is still
cold, so the ladder starts at the ordinary first step and enforcement resumes seconds after the
permission is back."""


def backoff_seconds(
    attempt: int, *, rng: random.Random | None = None, cap: float = BACKOFF_MAX_SECONDS
) -> float:
    """Wait before retry number ``attempt`` (1-based): 0.8 s doubling to ``cap`` (30 s), "equal
    jitter" (between half and all of the step) so that a fleet of nodes does not retry in
    lockstep."""
    step = min(cap, BACKOFF_INITIAL_SECONDS * 2.0 ** max(0, attempt - 1))
    jitter: float = (rng or random).random()
    return step * (0.5 + 0.5 * jitter)


def wait_seconds(error: BaseException, *, attempt: int) -> float:
    """The wait after ``attempt`` (1-based) failed with ``error``."""
    match decision(error):
        case Decision.RELIST:  # the first 410 relists at once; one right after a relist waits
            return 0.0 if attempt <= 1 else backoff_seconds(attempt - 1)
        case Decision.REPORT:
            return backoff_seconds(attempt, cap=REPORTED_RETRY_SECONDS)
        case _:
            seconds = backoff_seconds(attempt)
            if isinstance(error, RetryAfter):
                seconds = max(seconds, min(error.retry_after_seconds, BACKOFF_MAX_SECONDS))
            return seconds


def retrying(
    stop_event: threading.Event,
    *,
    what: str,
    persist: bool,
    on_retry: Callable[[BaseException], None] | None = None,
) -> tenacity.Retrying:
    """Retry what the error table says to retry, until success or ``stop_event``.

    ``persist``: a list/watch (a stream) also retries a reported problem, on the slow ladder;
    a single request (an Event) gives up on it. ``on_retry`` is told of each error before its
    wait. Sleeps wake up on ``stop_event``; the call then raises the last error.
    """
    retried = {Decision.RETRY, Decision.RELIST} | ({Decision.REPORT} if persist else set())

    def should_retry(state: tenacity.RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome is not None else None
        return exc is not None and decision(exc) in retried

    def wait(state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        return 0.0 if exc is None else wait_seconds(exc, attempt=state.attempt_number)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is None:
            return
        if on_retry is not None:
            on_retry(exc)
        if decision(exc) is Decision.RELIST:
            return  # routine; the reflector says so (kube_watch_gone)
        log.warning(
            "kube_retry",
            what=what,
            attempt=state.attempt_number,
            wait_seconds=round(state.upcoming_sleep, 2),
            error=str(exc),
        )

    return tenacity.Retrying(
        retry=should_retry,
        wait=wait,
        stop=lambda _state: stop_event.is_set(),
        sleep=lambda seconds: _sleep_unless_stopped(stop_event, seconds),
        before_sleep=before_sleep,
        reraise=True,
    )


def _sleep_unless_stopped(stop_event: threading.Event, seconds: float) -> None:
    stop_event.wait(seconds)
