"""Helpers for tests that run a real ``kvd serve`` process and talk to it over real sockets."""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvd.client import Client, Delivery, Subscription
from kvd.protocol import Event


def collect(sub: Subscription, count: int, timeout: float = 30.0) -> list[Delivery]:
    """The next ``count`` deliveries, polling until a deadline (never a fixed sleep)."""
    out: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"got {len(out)} of {count} events within {timeout}s: {out}")
        delivery = sub.poll(min(remaining, 0.5))
        if delivery is not None:
            out.append(delivery)
    return out


def by_req(deliveries: Iterable[Delivery]) -> dict[str, Event]:
    events: dict[str, Event] = {}
    for d in deliveries:
        assert d.event.req_id not in events, f"two events for {d.event.req_id}"
        events[d.event.req_id] = d.event
    return events


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def subscribed(client: Client, topics: list[str]) -> Subscription:
    """A subscription that is known to be connected: replays from 1, so nothing is missed."""
    return client.subscribe(topics, from_seq=1)
