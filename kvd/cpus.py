"""CPU lists as ``taskset -c`` and systemd's ``CPUAffinity=`` write them: ``0,2-3``."""

from __future__ import annotations


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
