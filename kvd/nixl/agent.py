"""Creating NIXL agents, and the errors NIXL raises.

NIXL is imported here and only when an agent is made, so ``kvd`` commands that do not move bytes
never load UCX.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

DEFAULT_BACKEND = "UCX"


class NixlUnavailable(RuntimeError):
    """The nixl package (or its UCX backend) cannot be loaded here."""


def nixl_api() -> Any:
    """The ``nixl._api`` module, with NIXL's own INFO chatter (printed to stdout) turned down."""
    try:
        from nixl import _api
    except ImportError as e:
        raise NixlUnavailable(f"cannot import nixl ({e}); pip install nixl") from e
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


def nixl_errors() -> tuple[type[BaseException], ...]:
    """Every exception class the NIXL bindings raise (they share no base class)."""
    bindings = nixl_api().nixlBind
    return tuple(
        obj
        for name in dir(bindings)
        if name.startswith("nixl")
        and isinstance(obj := getattr(bindings, name), type)
        and issubclass(obj, Exception)
    )


PROGRESS_WAIT_US = 10_000
"""How long NIXL's progress thread waits for UCX's events before it polls anyway, in us."""


@contextlib.contextmanager
def progress_thread_waits(wait_us: int = PROGRESS_WAIT_US) -> Iterator[None]:
    """While it lasts, NIXL agents made with a progress thread get one that waits for UCX's
    events, up to ``wait_us`` at a time, instead of polling with no pause.

    NIXL's Python API sets the thread's delay to 0 (``pthrDelay``), so from its first transfer
    the thread keeps a core busy, idle or not. With no thread at all, a process stops serving
    the READs of its memory when it stops calling NIXL: over UCX on one host a READ completes
    only once the target progresses its worker, so a prefill whose engine has gone idle
    holds a decode's READ until its next request (``tests/test_nixl_progress.py``). A thread
    that waits on the worker's events serves a READ of 64 KiB over loopback in about 0.1 ms
    (measured) for well under 1% of a core when idle.
    """
    restore = make_progress_threads_wait(wait_us)
    try:
        yield
    finally:
        restore()


def make_progress_threads_wait(wait_us: int = PROGRESS_WAIT_US) -> Callable[[], None]:
    """``progress_thread_waits`` for the rest of the process; returns what undoes it."""
    api = nixl_api()
    bindings = api.nixlBind

    def agent(name: str, config: Any) -> Any:
        if config.useProgThread:
            config.pthrDelay = wait_us
        return bindings.nixlAgent(name, config)

    # nixl_agent builds its config and then calls nixlBind.nixlAgent: that call is the one
    # place to set the delay, as the Python API has no option for it.
    api.nixlBind = _Bindings(bindings, agent)

    def restore() -> None:
        api.nixlBind = bindings

    return restore


class _Bindings:
    """NIXL's bindings module with ``nixlAgent`` replaced."""

    def __init__(self, bindings: Any, agent: Any) -> None:
        self._bindings = bindings
        self.nixlAgent = agent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)


def make_agent(name: str, backend: str = DEFAULT_BACKEND) -> Any:
    """A NIXL agent with one backend and without NIXL's progress thread.

    That thread polls with no pause and takes a whole core; ``Reader.poll`` and ``Exporter.poll``
    progress the agent instead, as often as their owners call them.
    """
    api = nixl_api()
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[backend])
    agent = api.nixl_agent(name, config)
    if backend not in agent.backends:
        raise NixlUnavailable(f"NIXL backend {backend!r} could not be created")
    return agent


def mem_type(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def device_id(tensor: torch.Tensor) -> int:
    return (tensor.device.index or 0) if tensor.is_cuda else 0


def registration(tensors: list[torch.Tensor]) -> list[tuple[int, int, int, str]]:
    """NIXL registration rows (addr, nbytes, device id, "") for contiguous tensors."""
    rows = []
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"tensors[{i}]: must be contiguous")
        rows.append((t.data_ptr(), t.numel() * t.element_size(), device_id(t), ""))
    return rows
