"""NIXL on both sides of a KV transfer: the prefill ``Exporter`` and the decode ``Reader``.

The exporter registers a prefill engine's cache and describes it over a ZMQ handshake
(``kvd.protocol.Handshake`` / ``CacheDescription``); the reader pulls a request's blocks with NIXL
READs (block mapping in ``kvd.nixl.mapping``) and sends kvd ``ReadDone`` or ``ReadFailed``.
Importing this package does not load NIXL; creating an exporter or reader does.
"""

from kvd.nixl.exporter import Exporter
from kvd.nixl.mapping import MappingError, ReadPlan, plan_read
from kvd.nixl.reader import HandshakeError, Reader, ReadResult

__all__ = [
    "Exporter",
    "HandshakeError",
    "MappingError",
    "ReadPlan",
    "ReadResult",
    "Reader",
    "plan_read",
]
