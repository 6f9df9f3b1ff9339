"""The KV cache of a CPU decode worker in a ``/dev/shm`` file, so kvd can map the same bytes.

vLLM 0.32 allocates a worker's whole KV cache as one ``torch.zeros(n, dtype=torch.int8)``
(``allocate_kv_cache``) inside the context the connector's ``get_mem_pool_context`` returns, and
makes every layer's view of it. ``ShmAllocation`` is that context: it turns exactly that call
into a mapping of a fresh file, so every view, NIXL's registration included, lives on shared
memory with no copy. The file is reserved with ``posix_fallocate`` (``kvd.shm.reserve``: a full
/dev/shm fails at start, not with SIGBUS later, and kvd refuses a sparse file), its pages are
faulted in ahead as ``torch.zeros`` would have, it is created 0660 (kvd's group may map it;
``group`` sets it) and removed when the worker shuts down. A worker that was killed cannot
remove its file: the next one started by the same user removes the files of workers that no
longer exist.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvd.shm import SHM_DIR, populate, reserve

log = logging.getLogger("vllm.kvd")

_PAGE = os.sysconf("SC_PAGE_SIZE")


class ShmAllocation(TorchFunctionMode):
    """Redirects the one KV-cache allocation of a vLLM CPU worker to a /dev/shm file."""

    def __init__(self, prefix: str, group: int | None = None) -> None:
        super().__init__()
        reap(prefix)
        self.name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.group = group
        self.nbytes = 0
        self.tensor: torch.Tensor | None = None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.tensor is None and _is_kv_allocation(func, args, kwargs):
            self.tensor = self._allocate(int(args[0]))
            return self.tensor
        return func(*args, **kwargs)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // _PAGE) * _PAGE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o660)
        try:
            os.fchmod(fd, 0o660)  # whatever the umask: kvd reaches it through the group
            if self.group is not None:
                os.fchown(fd, -1, self.group)
            reserve(fd, size)
        except OSError:
            os.close(fd)
            self.close()
            raise
        os.close(fd)
        self.nbytes = nbytes
        mapped = torch.from_file(self.path, shared=True, size=size, dtype=torch.int8)
        # vLLM's torch.zeros would have faulted in every page; without that, the forward that
        # first reads a block kvd wrote pays its page faults (kvd.shm.populate).
        if not populate(mapped):
            log.warning(
                "could not fault in the KV cache's pages ahead (madvise MADV_POPULATE_WRITE, "
                "Linux 5.14+): the first step that reads each block kvd wrote pays page faults"
            )
        log.info("KV cache in %s (%.1f MiB) for kvd", self.path, size / 2**20)
        return mapped[:nbytes]

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of ``tensor``'s first element in the file; it must live there."""
        if self.tensor is None:
            raise RuntimeError("the KV cache was not allocated through kvd's /dev/shm context")
        base = self.tensor.data_ptr()
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not base <= start <= end <= base + self.nbytes:
            raise RuntimeError(
                "a KV-cache tensor lives outside the /dev/shm file kvd maps (vLLM allocated it "
                "elsewhere: this vLLM version is not supported by kvd.vllm)"
            )
        return start - base

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def reap(prefix: str) -> list[str]:
    """Remove the files ``prefix-<pid>-*`` of this user whose worker process is gone."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-[0-9a-f]+$")
    removed = []
    for entry in os.scandir(SHM_DIR):
        match = pattern.match(entry.name)
        if not match:
            continue
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
        except FileNotFoundError:
            continue  # another worker reaped it first (a TP decode's ranks reap at once)
        if owner != os.geteuid():
            continue
        try:
            os.kill(int(match[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            removed.append(entry.name)
            log.info("removed %s, left by a worker that no longer exists", entry.path)
        except PermissionError:
            pass  # alive, another user's
    return removed


def _is_kv_allocation(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``torch.zeros(n, dtype=torch.int8[, device=cpu])``: vLLM's KV buffer, nothing else."""
    return (
        func is torch.zeros
        and len(args) == 1
        and isinstance(args[0], int)
        and kwargs.get("dtype") is torch.int8
        and torch.device(kwargs.get("device") or "cpu").type == "cpu"
    )
