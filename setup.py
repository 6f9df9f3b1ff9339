"""Builds kvd's optional CPU kernel; everything else is configured in pyproject.toml.

The extension is plain C (no torch or numpy headers), so any machine with a C compiler builds it.
Without one the install still succeeds and kvd falls back to a slower torch path (logged).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvd.kernels._runs",
            sources=["kvd/kernels/_runs.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
            libraries=["pthread"],
            optional=True,
        )
    ]
)
