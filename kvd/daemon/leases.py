"""When a cache's engine is gone: pure logic over connections and heartbeats, on the caller's
clock (seconds).

An engine holds its caches while the control connection that attached them is open. When kvd
finds that connection closed, the caches have ``lease_s`` left: the engine may come back within
it (a Heartbeat naming its engine id, or an Attach that replaces the cache), else they expire.
An engine that has sent a Heartbeat holds its caches by heartbeats instead, whatever its
connection: each renews them for ``lease_s``. A cache attached ``with_process`` (its memory dies
with the attaching process) expires as soon as its connection closed and that process is gone:
no engine comes back to memory that no longer exists. ``lease_s`` 0 turns all this off: caches
stay until detached.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    engine_id: str
    heartbeats: bool = False
    """The engine sent a Heartbeat: from then on only heartbeats hold its caches."""
    with_process: bool = False
    """The cache's memory dies with the attaching process (Attach.release_with_process)."""
    expires_s: float | None = None
    """When the cache expires; None while its engine's connection holds it."""
    process_gone: bool = False
    """It expired at once: attached ``with_process``, and that process is gone."""


class Leases:
    def __init__(self, lease_s: float) -> None:
        if lease_s < 0:
            raise ValueError(f"lease_s must be >= 0, got {lease_s}")
        self.lease_s = lease_s
        self._leases: dict[str, Lease] = {}

    def __contains__(self, cache_id: str) -> bool:
        return cache_id in self._leases

    def attached(self, cache_id: str, engine_id: str, *, with_process: bool = False) -> None:
        """A cache was attached (or replaced): its connection holds it."""
        self._leases[cache_id] = Lease(engine_id, with_process=with_process)

    def detached(self, cache_id: str) -> None:
        self._leases.pop(cache_id, None)

    def heartbeat(self, engine_id: str, now_s: float) -> list[str]:
        """Engine ``engine_id`` is alive: renews its caches; returns their ids."""
        renewed = []
        for cache_id, lease in self._leases.items():
            if engine_id and lease.engine_id == engine_id:
                lease.heartbeats = True
                lease.expires_s = now_s + self.lease_s
                renewed.append(cache_id)
        return renewed

    def connection_closed(self, cache_id: str, now_s: float, *, process_gone: bool = False) -> bool:
        """The connection that holds ``cache_id`` closed (``process_gone``: and the process
        that made it no longer exists); True when this starts its lease, which has no time
        left for a cache attached ``with_process`` whose process is gone."""
        lease = self._leases.get(cache_id)
        if lease is None or lease.expires_s is not None or not self.lease_s:
            return False
        if lease.with_process and process_gone:
            lease.expires_s = now_s
            lease.process_gone = True
            return True
        if lease.heartbeats:
            return False
        lease.expires_s = now_s + self.lease_s
        return True

    def process_gone(self, cache_id: str) -> bool:
        """Whether ``cache_id`` expired at once because its attaching process is gone."""
        lease = self._leases.get(cache_id)
        return lease is not None and lease.process_gone

    def watched(self) -> list[str]:
        """Caches held by their connection: the ones whose connection is worth checking."""
        return [c for c, lease in self._leases.items() if lease.expires_s is None]

    def expired(self, now_s: float) -> list[str]:
        """Caches whose lease ran out (each reported until ``detached``)."""
        if not self.lease_s:
            return []
        return [
            c
            for c, lease in self._leases.items()
            if lease.expires_s is not None and now_s >= lease.expires_s
        ]

    def expires_in(self, cache_id: str, now_s: float) -> float | None:
        """Seconds left to ``cache_id`` (None while its engine holds it)."""
        lease = self._leases.get(cache_id)
        if lease is None or lease.expires_s is None or not self.lease_s:
            return None
        if not lease.heartbeats:
            return max(0.0, lease.expires_s - now_s)
        # A heartbeating engine holds its caches; the time left shows once it is late (its
        # heartbeats are due every third of the lease).
        left = lease.expires_s - now_s
        return None if left >= self.lease_s / 2 else max(0.0, left)
