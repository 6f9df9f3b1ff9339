"""Creating NIXL agents, and the errors NIXL raises.

NIXL is imported here and only when an agent is made, so ``kvd`` commands that do not move bytes
never load UCX.
"""

from __future__ import annotations

import logging
import os
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
