"""Kernels that execute page-format plans (``kvd.layout.planner``) over landed blocks, in place.

``CachePostProcess`` is the one interface: it holds a cache's regions and picks the kernel, the
compiled C one on the CPU (``cpu``), Triton on CUDA (``gpu``), or plain torch ops where neither
is available. All of them execute the same plans.
"""

from kvd.kernels.cpu import MemoryFault
from kvd.kernels.postprocess import (
    Backend,
    CachePostProcess,
    RegionView,
    Request,
    region_views,
)

__all__ = [
    "Backend",
    "CachePostProcess",
    "MemoryFault",
    "RegionView",
    "Request",
    "region_views",
]
