"""A scheduler-side subscriber that never loses track of a request, even when events are lost.

    python examples/subscriber.py [RUNTIME_DIR] [--requests N]

RUNTIME_DIR is the running kvd's (default: $KVD_RUNTIME_DIR, else where ``kvd serve`` puts
it). The subscriber waits for the Ready or Failed event of each request it knows about. When
kvd says some events are gone (``EventsLost``: the subscriber resumed from a seq kvd no longer
holds, fell behind its replay buffer, or kvd restarted), it asks ``request_status`` about every
request it is still waiting for: ``ready`` and ``failed`` are final answers; a request still in
flight gets its event later; ``unknown`` means kvd never saw it or has forgotten it, and the
engine must treat its blocks as lost (read them again or recompute).

To show that, the script plays a scheduler that was away: it sends N notifications first (the
engine's part), waits until kvd has answered them, then subscribes from seq 1, as a scheduler
resuming from the last seq it processed. With kvd's default replay buffer everything is
replayed; with a small one (``kvd serve --replay-buffer 4``) most events are gone and the
script finds out about them from ``request_status``. It exits 0 when every request is
accounted for, 1 when one is unknown to kvd.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvd.client import Client, EventsLost
from kvd.protocol import Ready
from kvd.shm import ShmCache


def wait_for(kvd: Client, cache_id: str, waiting: set[str]) -> dict[str, str]:
    """Each request's outcome ("ready", "failed: code", "unknown"), from events or status."""
    outcomes: dict[str, str] = {}
    ask_kvd = False  # events were lost: ask about what is still missing once the rest arrived
    with kvd.subscribe([cache_id], from_seq=1) as events:
        deadline = time.monotonic() + 30
        while waiting and time.monotonic() < deadline:
            try:
                # The events that survived are queued before EventsLost: take them first.
                delivery = events.poll(0.0 if ask_kvd else 1.0)
            except EventsLost as lost:
                print(f"events lost: {lost}")
                ask_kvd = True
                continue
            if delivery is None and ask_kvd:
                print(f"asking kvd about the {len(waiting)} requests still waited for")
                for req_id in sorted(waiting):
                    status = kvd.request_status(req_id)
                    if status.state in ("ready", "failed", "unknown"):
                        outcome = status.state + (f": {status.code}" if status.code else "")
                        outcomes[req_id] = f"{outcome} (request_status)"
                        waiting.discard(req_id)
                    # else still in flight (accepted/batched/launched/done): its event will come
                ask_kvd = False
            if delivery is None or delivery.event.req_id not in waiting:
                continue  # no event yet, or another client's request on this cache
            event = delivery.event
            outcomes[event.req_id] = (
                "ready" if isinstance(event, Ready) else f"failed: {event.code}"
            ) + f" (event seq {delivery.seq})"
            waiting.discard(event.req_id)
    for req_id in waiting:
        outcomes[req_id] = "no answer within 30 s"
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runtime_dir", nargs="?", help="kvd's runtime dir")
    parser.add_argument("--requests", type=int, default=20, help="notifications to send")
    args = parser.parse_args()

    cache_id = f"scheduler-{os.getpid()}"
    cache = ShmCache.create(num_layers=1, num_blocks=64, block_size=16, num_heads=2, head_dim=64)
    with cache, Client(args.runtime_dir) as kvd:
        kvd.attach(cache_id, cache.specs)
        try:
            # The engine's part: one HND -> NHD rewrite of two blocks per request.
            req_ids = [f"req-{i}" for i in range(args.requests)]
            for i, req_id in enumerate(req_ids):
                blocks = [(2 * i) % 64, (2 * i + 1) % 64]
                kvd.read_done(req_id, cache_id, blocks, remote_layout="HND", block_size_ratio=1)
                # Blocks are reused round the cache: wait for kvd's answer before naming them
                # again (a Status can overtake the ReadDone: "unknown" means not read yet).
                while kvd.request_status(req_id, cache_id).state not in ("ready", "failed"):
                    time.sleep(0.001)

            outcomes = wait_for(kvd, cache_id, set(req_ids))
        finally:
            kvd.detach(cache_id)
    for req_id in req_ids:
        print(f"{req_id}: {outcomes[req_id]}")
    answered = sum(not o.startswith(("unknown", "no answer")) for o in outcomes.values())
    print(f"{answered} of {len(req_ids)} requests accounted for")
    return 0 if answered == len(req_ids) else 1


if __name__ == "__main__":
    sys.exit(main())
