"""kvd inside vLLM: the ``KvdConnector`` plugin (``kv_connector_module_path="kvd.vllm"``).

Importing this package imports vLLM (an optional dependency: ``pip install 'kvd[vllm]'``); kvd
itself never does.
"""

from kvd.vllm.connector import KvdConnector, KvdConnectorError, KvdWorker

__all__ = ["KvdConnector", "KvdConnectorError", "KvdWorker"]
