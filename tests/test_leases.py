"""When an engine is gone, on an explicit clock: connections, heartbeats, the lease."""

from __future__ import annotations

import pytest

from kvd.daemon.leases import Leases


def test_a_connection_holds_its_caches_until_it_closes_then_the_lease_runs() -> None:
    leases = Leases(30)
    leases.attached("c0", "engine-a")
    leases.attached("c1", "")
    assert leases.watched() == ["c0", "c1"] and leases.expired(1e9) == []
    assert leases.expires_in("c0", 5) is None
    assert leases.connection_closed("c0", 100)
    assert not leases.connection_closed("c0", 110), "the lease started once"
    assert leases.watched() == ["c1"]
    assert leases.expires_in("c0", 110) == 20
    assert leases.expired(129.9) == []
    assert leases.expired(130) == ["c0"]
    leases.detached("c0")
    assert leases.expired(1e9) == [] and "c0" not in leases


def test_the_engine_coming_back_renews_its_caches() -> None:
    leases = Leases(30)
    leases.attached("c0", "engine-a")
    leases.attached("c1", "engine-b")
    leases.connection_closed("c0", 100)
    assert leases.heartbeat("engine-a", 120) == ["c0"]
    assert leases.expired(140) == []
    assert leases.heartbeat("", 120) == [], "an anonymous engine cannot be told apart"
    leases.attached("c0", "engine-a")  # or it attached the cache again
    assert leases.expires_in("c0", 200) is None


def test_an_engine_that_heartbeats_must_keep_doing_so() -> None:
    leases = Leases(30)
    leases.attached("c0", "engine-a")
    leases.heartbeat("engine-a", 0)
    assert leases.watched() == [], "its connection no longer matters"
    assert not leases.connection_closed("c0", 1)
    assert leases.expires_in("c0", 10) is None, "on time"
    assert leases.expires_in("c0", 25) == 5, "late: shown"
    assert leases.expired(29) == []
    leases.heartbeat("engine-a", 29)
    assert leases.expired(58) == [] and leases.expired(59) == ["c0"]


def test_no_lease_means_caches_stay_until_detached() -> None:
    leases = Leases(0)
    leases.attached("c0", "engine-a")
    assert not leases.connection_closed("c0", 0)
    leases.heartbeat("engine-a", 0)
    assert leases.expired(1e9) == [] and leases.expires_in("c0", 1e9) is None
    with pytest.raises(ValueError, match="lease_s"):
        Leases(-1)


def test_a_cache_released_with_its_process_expires_when_the_process_is_gone() -> None:
    leases = Leases(30)
    leases.attached("c0", "engine-a", with_process=True)
    leases.attached("c1", "engine-b", with_process=True)
    leases.attached("c2", "engine-c")
    assert leases.connection_closed("c0", 100, process_gone=True)
    assert leases.expires_in("c0", 100) == 0 and leases.expired(100) == ["c0"]
    assert leases.process_gone("c0")
    # Its process alive (a client that reconnected): the lease runs as for any other cache.
    assert leases.connection_closed("c1", 100, process_gone=False)
    assert leases.expires_in("c1", 100) == 30 and not leases.process_gone("c1")
    # Not asked for: a gone process still gets the lease (its memory may outlive it).
    assert leases.connection_closed("c2", 100, process_gone=True)
    assert leases.expires_in("c2", 100) == 30
