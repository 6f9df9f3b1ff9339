"""kvd inside vLLM: the ``KvdConnector`` plugin (``kv_connector_module_path="kvd.vllm"``).

``KvdConnector`` needs vLLM (an optional dependency: ``pip install 'kvd[vllm]'``), imported when
the class is first looked up, so the pure parts of this package (``formats``, ``holding``,
``hooks``, ``shm``) import without it; kvd itself never imports vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvdConnector", "KvdConnectorError", "KvdWorker"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvd.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
