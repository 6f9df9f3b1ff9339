"""Run a command with its stdout and stderr on a pseudo-terminal, as a user at a shell would."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
import threading


def run_on_tty(args: list[str], timeout: float = 300.0, columns: int = 120) -> tuple[int, str]:
    """(exit code, everything written to the terminal, CRs kept)."""
    master, slave = pty.openpty()
    # tqdm sizes its bar to the terminal; a fresh pty is 0 columns wide.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    chunks: list[bytes] = []

    def pump() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        code = proc.wait(timeout)
        reader.join(10)
    finally:
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")
