"""pyzmq at the level kvd's hot paths need it: the compiled socket calls, and the scheduling
policy of the context's I/O threads."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import zmq

from kvd.cpus import refused_on_a_thread

log = logging.getLogger(__name__)

NOBLOCK = int(zmq.NOBLOCK)
POLLIN = int(zmq.POLLIN)
EVENTS = int(zmq.EVENTS)
# pyzmq's Python-level Socket methods cost more than the ZMQ calls they wrap (and wrap flags in
# enums); the hot paths call the compiled base class directly.
_BaseSocket: Any = next((c for c in zmq.Socket.__mro__[1:] if "send" in vars(c)), zmq.Socket)
raw_recv: Callable[..., bytes] = _BaseSocket.recv
raw_send: Callable[..., None] = _BaseSocket.send
raw_get: Callable[..., Any] = _BaseSocket.get


def yield_io_threads(ctx: zmq.Context[zmq.Socket[bytes]]) -> bool:
    """Make ``ctx``'s I/O threads SCHED_BATCH: a thread woken by a send or a receive waits for
    the event loop to block instead of preempting it on a CPU they share, then moves every
    message queued meanwhile. Before the context's first socket (its threads start there).

    False, with a warning, where this process may not take that policy (a seccomp filter):
    libzmq aborts the process when its thread cannot, so it is tried on a thread of ours first.
    """
    refused = refused_on_a_thread(
        lambda: os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    )
    if refused is not None:
        log.warning(
            "dedicated_cpus: cannot make ZMQ's I/O threads SCHED_BATCH (%s); they keep the "
            "default policy",
            refused.strerror,
        )
        return False
    ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return True
