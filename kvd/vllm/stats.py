"""What the hand-off costs the engine and how long kvd takes: a bounded summary.

The engine's thread only appends one tuple per step that handed off or released something (a
deque append, no lock); the link's thread folds them into the summary and writes it out. The
summary keeps counts, sums and maxima of the whole run and the latest ``WINDOW`` samples of
each figure for percentiles, so it never grows with the run.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvd.vllm.holding import Released

WINDOW = 10_000
"""Samples kept per figure for percentiles."""


class _Figure:
    """Count, sum and maximum of everything seen; the latest ``WINDOW`` values."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.recent: deque[float] = deque(maxlen=WINDOW)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.max = max(self.max, value)
        self.recent.append(value)

    def report(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "sum_s": self.total,
            "max_s": self.max,
            "recent_s": list(self.recent),
        }


class HandoffStats:
    def __init__(self) -> None:
        self._steps: deque[tuple[float, int, Released | None, list[int] | None, bool, bool]] = (
            deque()
        )
        self.requests = 0
        self.early = 0
        """Requests handed off before a step's forward or during it (their READs seen landed
        there), so that kvd may answer before the step's end."""
        self.during_forward = 0
        """Of those, requests handed off during the forward, at an attention layer (CPU)."""
        self.failed = 0
        self.reads_before_forward = 0
        """Requests whose READs were posted before a step's forward (queued there instead when
        their prefill's handshake is not done). The engine's thread alone counts them."""
        self.handoff = _Figure()
        self.ready_latency = _Figure()
        self.answer_latency = _Figure()
        """ReadDone sent -> kvd's answer at the link's thread: kvd's time and the sockets', not
        the wait for the engine's next step."""
        self.steps_to_release: dict[int, int] = {}
        """Engine steps from kvd's answer to the request's release -> requests (1: the next)."""
        self.version = 0

    def step(
        self,
        seconds: float,
        handed_off: int,
        released: Released | None = None,
        waits: list[int] | None = None,
        *,
        early: bool = False,
        during_forward: bool = False,
    ) -> None:
        """The engine's thread: one step's cost (``seconds``, when it handed something off),
        requests handed off (``early``: before the step's forward or, ``during_forward``, in
        it), those it released (kvd's answers) and the steps each of kvd's answers waited.
        Their lists become the summary's: pass new ones."""
        self._steps.append((seconds, handed_off, released, waits, early, during_forward))

    def absorb(self) -> int:
        """The link's thread: fold in the steps recorded so far; returns a version that moves
        when something was folded in."""
        while self._steps:
            seconds, handed_off, released, waits, early, during = self._steps.popleft()
            if handed_off:
                self.handoff.add(seconds)
            self.requests += handed_off
            if early:
                self.early += handed_off
            if during:
                self.during_forward += handed_off
            if released is not None:
                self.failed += len(released.failed)
                for latency in released.latencies_s:
                    self.ready_latency.add(latency)
                for latency in released.answered_s:
                    self.answer_latency.add(latency)
            for wait in waits or ():
                self.steps_to_release[wait] = self.steps_to_release.get(wait, 0) + 1
            self.version += 1
        return self.version

    def report(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "early": self.early,
            "during_forward": self.during_forward,
            "failed": self.failed,
            "reads_before_forward": self.reads_before_forward,
            "handoff": self.handoff.report(),
            "ready_latency": self.ready_latency.report(),
            "answer_latency": self.answer_latency.report(),
            "steps_to_release": {str(k): v for k, v in sorted(self.steps_to_release.items())},
        }
