"""How long the machine kept a ready thread off its core while a benchmark ran.

A timing means something only if the machine ran the timed threads when they were ready. On a
shared VM that is not a given: on the 2-core VM kvd is developed on, under ``kvd bench vllm``'s
load run (three vLLM processes and kvd), a thread pinned to one core, asking to sleep 10 ms,
woke up to 35 s late, on either core, and the guest kernel logged "BUG: workqueue lockup ...
stuck for 51s" meanwhile. A step that took seconds in such a window measures the machine.

``StallWatch`` runs one thread per core this process may use, each pinned to its core and
sleeping ``interval_s`` in a loop, and keeps each core's worst lateness: a core that ran its
threads wakes its sleeper within a scheduler tick or two.
"""

from __future__ import annotations

import os
import threading
import time

SUSPECT_S = 1.0
"""Lateness past which a run's timings are reported as the machine's, not the code's."""


class StallWatch:
    """Per core, the worst lateness of a sleeper pinned there, since the last ``take``."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self._cores = sorted(os.sched_getaffinity(0))
        self._worst = dict.fromkeys(self._cores, 0.0)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._sleep_on, args=(core,), name=f"stall-watch-{core}")
            for core in self._cores
        ]

    def __enter__(self) -> StallWatch:
        for thread in self._threads:
            thread.daemon = True
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def take(self) -> dict[str, float]:
        """Each core's worst lateness in seconds (keys are core numbers as text, for JSON);
        starts over."""
        worst, self._worst = self._worst, dict.fromkeys(self._cores, 0.0)
        return {str(core): round(late, 4) for core, late in worst.items()}

    def _sleep_on(self, core: int) -> None:
        os.sched_setaffinity(0, {core})  # 0: this thread only (Linux)
        while True:
            asked = time.monotonic()
            if self._stop.wait(self.interval_s):
                return
            late = time.monotonic() - asked - self.interval_s
            self._worst[core] = max(self._worst[core], late)


def verdict(worst_s: dict[str, float]) -> str | None:
    """A warning when some core kept a ready thread waiting past ``SUSPECT_S``, else None."""
    if not worst_s:
        return None
    core, late = max(worst_s.items(), key=lambda item: item[1])
    if late <= SUSPECT_S:
        return None
    return (
        f"the machine kept a ready thread off core {core} for {late:.1f} s during this run: "
        "steps timed in such a window measure the machine, not the connectors"
    )
