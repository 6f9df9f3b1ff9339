"""Kernels that execute page-format plans (``kvd.layout.planner``) over landed blocks, in place.

``postprocess.CachePostProcess`` is the one interface: it holds a cache's regions and picks the
kernel, the compiled C one on the CPU (``cpu``), Triton on CUDA (``gpu``), or plain torch ops
where neither is available. All of them execute the same plans. This package imports nothing
itself: ``faults`` is all the daemon's loop needs, and ``kvd serve`` reaches READY before torch,
numpy and Triton load (on the first Attach, or just after READY, off the loop).
"""
