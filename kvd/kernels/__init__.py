"""Post-process kernels: a compiled CPU kernel and a Triton kernel for CUDA.

``kvd.postprocess`` plans the work (which rows move where) and dispatches here.
"""
