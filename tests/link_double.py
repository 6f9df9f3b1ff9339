"""A stand-in for ``kvd.vllm.link.KvdLink`` where a test drives ``KvdWorker``'s step itself:
the link's thread and sockets are what those tests leave out."""

from __future__ import annotations

import collections


class StepLink:
    """What ``KvdWorker``'s step uses of ``kvd.vllm.link.KvdLink``: a send that always goes,
    the inbox of kvd's answers, the step count and the state."""

    def __init__(self) -> None:
        from kvd.vllm.link import State

        self.sent: list[bytes] = []
        self.inbox: collections.deque[tuple[object, int, float]] = collections.deque()
        self.steps = 0
        self.state = State.UP

    def send(self, frame: bytes) -> bool:
        self.sent.append(frame)
        return True
