"""A NIXL target that goes idle: ``python -m tests.nixl_idle_target waits|none DIR``.

Registers 64 KiB of known floats, writes its agent metadata and the buffer's address to DIR,
then makes no NIXL call until it is killed: its agent progresses only through a progress thread
(``waits``: kvd's, waiting for UCX's events) or not at all (``none``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch

from kvd.nixl.agent import make_agent, nixl_api, progress_thread_waits

WORDS = 1 << 14


def main() -> None:
    mode, directory = sys.argv[1], Path(sys.argv[2])
    if mode == "waits":
        with progress_thread_waits():
            api = nixl_api()
            agent = api.nixl_agent("target", api.nixl_agent_config(backends=["UCX"]))
    else:
        agent = make_agent("target")
    buffer = torch.arange(WORDS, dtype=torch.float32)
    agent.register_memory([(buffer.data_ptr(), WORDS * 4, 0, "")], "DRAM")
    (directory / "address").write_text(str(buffer.data_ptr()))
    (directory / "metadata.tmp").write_bytes(agent.get_agent_metadata())
    os.rename(directory / "metadata.tmp", directory / "metadata")
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(60)


if __name__ == "__main__":
    main()
