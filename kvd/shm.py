"""KV caches in POSIX shared memory, for CPU daemons, tests and demos.

One file under ``/dev/shm`` holds every layer's tensor back to back (page-aligned); the specs it
produces are what ``Client.attach`` sends, so kvd maps the same bytes the engine writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets

import torch

from kvd.dtypes import torch_dtype
from kvd.protocol import SHM_DIR as SHM_DIR  # noqa: PLC0414 (kvd.vllm.shm imports it here)
from kvd.protocol import DTypeName, KVArrangement, Layout, ShmRef, TensorSpec

_ALIGN = 4096
_MADV_POPULATE_WRITE = 23  # Linux 5.14+

log = logging.getLogger(__name__)


def populate(tensor: torch.Tensor) -> bool:
    """Fill in this process's page tables for a shared mapping now, without touching its bytes;
    False where the kernel cannot (before Linux 5.14).

    A mapping's page tables are per process: without this, the first touch of each page pays a
    page fault in every process that maps it, however warm the others' are: kvd in the first
    post-process of a block, a vLLM decode worker in the first forward that reads it (about 460
    faults for a 900-token arrival in ``kvd bench vllm --mode load``).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
        log.debug("madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def reserve(fd: int, size: int) -> None:
    """Make the file behind ``fd`` ``size`` bytes long, every page of it allocated now.

    kvd refuses a sparse segment (its writes would allocate RAM the engine never reserved), and
    a full /dev/shm fails here (ENOSPC) instead of with SIGBUS at some later write.
    """
    os.posix_fallocate(fd, 0, size)


def physical_shape(
    kv_arrangement: KVArrangement,
    layout: Layout,
    *,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
) -> list[int]:
    """The physical shape of one tensor (see ``kvd.protocol.KVArrangement``)."""
    if layout == "NHD":
        block = [block_size, num_heads, head_dim]
    else:
        block = [num_heads, block_size, head_dim]
    return {
        "split": [2, num_blocks, *block],
        "blocks_first": [num_blocks, 2, *block],
        "single": [num_blocks, *block],
        "mla": [num_blocks, block_size, head_dim],
    }[kv_arrangement]


class ShmCache:
    """``num_layers`` cache tensors in ``/dev/shm/<name>``; ``tensors[i]`` matches ``specs[i]``."""

    def __init__(self, name: str, tensors: list[torch.Tensor], specs: list[TensorSpec]) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.tensors = tensors
        self.specs = specs

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: DTypeName = "bfloat16",
        layout: Layout = "NHD",
        kv_arrangement: KVArrangement = "split",
        name: str | None = None,
    ) -> ShmCache:
        """Create and map a zero-filled cache, its memory allocated (``reserve``); fails if
        ``name`` already exists."""
        name = name or f"kvd-cache-{os.getpid()}-{secrets.token_hex(4)}"
        shape = physical_shape(
            kv_arrangement,
            layout,
            num_blocks=num_blocks,
            block_size=block_size,
            num_heads=num_heads,
            head_dim=head_dim,
        )
        dtype_ = torch_dtype(dtype)
        nbytes = dtype_.itemsize
        for d in shape:
            nbytes *= d
        stride = -(-nbytes // _ALIGN) * _ALIGN
        total = stride * num_layers
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            reserve(fd, total)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mapped = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        tensors, specs = [], []
        for layer in range(num_layers):
            offset = layer * stride
            tensors.append(mapped[offset : offset + nbytes].view(dtype_).view(shape))
            specs.append(
                TensorSpec(
                    name=f"layer.{layer}",
                    shape=list(shape),
                    dtype=dtype,
                    layout=layout,
                    kv_arrangement=kv_arrangement,
                    block_size=block_size,
                    memory=ShmRef(name=name, offset=offset),
                )
            )
        return cls(name, tensors, specs)

    def close(self) -> None:
        """Remove the shared-memory name; existing mappings (kvd's too) stay valid."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> ShmCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
