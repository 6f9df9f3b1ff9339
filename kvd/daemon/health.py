"""What ``/healthz`` and ``/readyz`` answer: verdicts over the daemon's state, without I/O.

Liveness (``/healthz``) fails only for what a restart mends, since that is what a failing
liveness probe (or a service manager) does about it: a device error that sticks to the CUDA
context, or a post-process job that has not completed within ``executor_watchdog_s`` (a hung
kernel). That the event loop answers at all is the rest of it. A draining kvd is alive: killing
it would cut short the drain it was asked for.

Readiness (``/readyz``) says whether a notification sent now would be taken: sockets bound and
the journal recovered (startup finished), and still accepting. It goes false at the first
SIGTERM, before anything else of the drain, and whenever kvd is not alive.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    reason: str
    """One line for the probe's body and the logs."""


def liveness(device_failure: str | None, stalled_s: float, watchdog_s: float) -> Verdict:
    """Alive unless the device failed or a job went ``stalled_s`` seconds without completing,
    past ``watchdog_s`` (0: no bound)."""
    if device_failure is not None:
        return Verdict(False, f"device failed: {device_failure}")
    if watchdog_s > 0 and stalled_s > watchdog_s:
        return Verdict(
            False,
            f"executor stalled: a post-process job has not completed for {stalled_s:.1f} s "
            f"(executor_watchdog_s = {watchdog_s:g})",
        )
    return Verdict(True, "alive")


def readiness(started: bool, accepting: bool, alive: Verdict) -> Verdict:
    """Ready once startup finished, while accepting notifications and alive."""
    if not started:
        return Verdict(False, "starting")
    if not alive.ok:
        return alive
    if not accepting:
        return Verdict(False, "draining: new notifications are answered Failed(shutting_down)")
    return Verdict(True, "ready")
