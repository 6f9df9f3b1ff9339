"""Requests a decode worker holds back from vLLM until kvd's event: pure logic, no sockets.

Every request whose READ finished is held: kvd is sent its ReadDone, and vLLM learns the request
finished receiving only when kvd's Ready arrives (or, on a Failed, that it failed, so vLLM's
``kv_load_failure_policy`` recomputes it). A held request is never released any other way while
the kvd that may be rewriting its blocks lives: releasing it would let vLLM reuse blocks kvd may
still write. When kvd restarted, every held request is sent again (kvd answers from its journal);
when kvd is gone and stays gone, they are failed: a dead kvd writes nothing, and a kvd that starts
later never rewrites a request that is not sent to it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvd.protocol import Event, Failed


@dataclass(slots=True)
class Held:
    req_id: str
    block_ids: list[int]
    remote_block_size: int
    remote_format: str
    covered_sub_blocks: int
    remote_engine_id: str
    groups: tuple[tuple[int, int], ...] = ()
    """A hybrid model's (blocks, covered_sub_blocks) per KV cache group, splitting
    ``block_ids``; empty for one group."""
    cuda_event: bytes = b""
    """The hand-off marker its ReadDone carries (on CUDA; ``kvd.cudaipc.HandOffMarkers``)."""
    remote_ranks: int = 0
    """Prefill ranks whose pieces landed interleaved in each group (``ReadDone.remote_ranks``;
    0: one rank's pages)."""
    sent_at: float = field(default_factory=time.monotonic)


def covered_sub_blocks(
    local_blocks: int, ratio: int, remote_blocks: int, covered: range | None
) -> int | None:
    """How many remote-sized sub-blocks a READ filled, counted from the request's first local
    block, as a ReadDone says it; None where a ReadDone cannot say it: a READ that filled none,
    or left the first ones unwritten.

    ``covered`` is vLLM 0.34's range of filled sub-blocks (``ReqMeta.covered_sub_blocks``: it
    pairs local and remote blocks from the last token, so a range may start past 0); without
    it, as vLLM 0.32 and 0.33 count: ``min(local_blocks * ratio, remote_blocks)``. They pair the
    sub-blocks of a decode-side prefix hit's uncached local blocks with the prefill's *last*
    blocks (``_apply_prefix_caching`` trims its list from the end): where the prompt ends inside
    a local block (``remote_blocks % ratio``), every sub-block then lands that many places
    from where the local blocks want it, bytes of the cached prefix first. No rewrite of these
    pages puts them right, so the ReadDone cannot say it: None, and the request is recomputed.
    ``KvdWorker`` reads such a request from its first uncached token instead and counts
    ``remote_blocks`` from there, which this never refuses.
    """
    if covered is None:
        if local_blocks * ratio < remote_blocks and remote_blocks % ratio:
            return None
        count = min(local_blocks * ratio, remote_blocks)
    elif covered.start == 0:
        count = covered.stop
    else:
        return None
    return count or None


@dataclass(slots=True)
class Released:
    """Requests to report to vLLM: finished receiving, and (a subset) failed."""

    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    latencies_s: list[float] = field(default_factory=list)
    """ReadDone sent to the request's release, per request answered by kvd."""
    answered_s: list[float] = field(default_factory=list)
    """ReadDone sent to kvd's answer reaching the link's thread, per request answered."""
    markers: list[bytes] = field(default_factory=list)
    """The hand-off markers the released requests carried, one entry per request."""

    def merge(self, other: Released) -> None:
        self.finished |= other.finished
        self.failed |= other.failed
        self.latencies_s += other.latencies_s
        self.answered_s += other.answered_s
        self.markers += other.markers


class Holding:
    def __init__(self) -> None:
        self._held: dict[str, Held] = {}
        self.failures: dict[str, str] = {}
        """req_id -> kvd's code, for the requests kvd answered with Failed (for the logs)."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    def hold(self, request: Held) -> None:
        self._held[request.req_id] = request

    def answer(self, events: list[Event], arrived_at: list[float] | None = None) -> Released:
        """The requests kvd's events settle; events of requests not held are ignored (a
        repeated answer after a re-send, another engine's request on the refusals topic).
        ``arrived_at``: when each event reached the link's thread (``time.monotonic()``)."""
        out = Released()
        now = time.monotonic()
        for i, event in enumerate(events):
            held = self._held.pop(event.req_id, None)
            if held is None:
                continue
            out.finished.add(held.req_id)
            out.latencies_s.append(now - held.sent_at)
            if arrived_at is not None:
                out.answered_s.append(arrived_at[i] - held.sent_at)
            if held.cuda_event:
                out.markers.append(held.cuda_event)
            if isinstance(event, Failed):
                out.failed.add(held.req_id)
                self.failures[held.req_id] = event.code
        return out

    def resend(self) -> list[Held]:
        """Every held request, for sending again (kvd restarted: it answers from its journal)."""
        return list(self._held.values())

    def give_up(self) -> Released:
        """Fail every held request: only when no kvd can be writing their blocks."""
        out = Released(finished=set(self._held), failed=set(self._held))
        out.markers = [h.cuda_event for h in self._held.values() if h.cuda_event]
        self._held.clear()
        return out
