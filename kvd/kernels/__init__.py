"""Post-process kernels: a compiled CPU kernel and a Triton kernel for CUDA.

``kvd.postprocess`` plans the work (which rows move where) and dispatches here.
"""


class MemoryFault(RuntimeError):
    """The kernel touched memory that is gone (SIGBUS: a shared-memory file shrank under it).

    The kernel stopped where it was: the blocks it was rewriting are partly rewritten.
    """
