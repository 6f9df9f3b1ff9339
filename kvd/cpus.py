"""CPU lists as ``taskset -c`` and systemd's ``CPUAffinity=`` write them: ``0,2-3``; and
trying what libzmq would do to its own threads on a thread of ours first."""

from __future__ import annotations

import threading
from collections.abc import Callable


class CpuListError(ValueError):
    """Text that is not a CPU list; the message quotes it."""


def parse_cpus(text: str) -> frozenset[int]:
    """``1``, ``2-3``, ``0,2-3`` -> the CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise CpuListError(f"{text!r} is not a CPU list such as 1, 2-3 or 0,2-3") from None
        if not 0 <= first <= last:
            raise CpuListError(f"{part.strip()!r} is not a CPU range")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int] | list[int]) -> str:
    """``parse_cpus``' form: ``0,2-3``; empty for no CPUs."""
    if not cpus:
        return ""
    ordered, parts = sorted(cpus), []
    start = prev = ordered[0]
    for cpu in [*ordered[1:], -1]:
        if cpu != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cpu
        prev = cpu
    return ",".join(parts)


def refused_on_a_thread(action: Callable[[], None]) -> OSError | None:
    """Run ``action`` on a new thread of this process; the ``OSError`` it raised, else None.

    libzmq sets the scheduling policy and the CPUs of its I/O threads itself, and aborts the
    process when the kernel refuses (a cpuset without those CPUs, a seccomp filter): try the same
    call here first, where a refusal is only an error.
    """
    refused: list[OSError] = []

    def attempt() -> None:
        try:
            action()
        except OSError as exc:
            refused.append(exc)

    trial = threading.Thread(target=attempt, name="kvd-trial")
    trial.start()
    trial.join()
    return refused[0] if refused else None
