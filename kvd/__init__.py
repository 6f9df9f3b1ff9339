"""kvd: a sidecar daemon that post-processes NIXL-received KV-cache blocks for P/D serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvd")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
