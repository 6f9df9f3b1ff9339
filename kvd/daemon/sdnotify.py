"""The systemd notification protocol (sd_notify), without a dependency.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET``, an AF_UNIX datagram socket (a path, or
``@name`` in the abstract namespace); each datagram holds newline-separated ``KEY=VALUE``
assignments: ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1``. With ``WatchdogSec=``
it also passes ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``, the process meant to ping). Without
``NOTIFY_SOCKET`` every call here does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def notify_address(spec: str) -> bytes | None:
    """The socket address of a ``NOTIFY_SOCKET`` value; None for schemes kvd does not speak."""
    if spec.startswith("@"):
        return b"\0" + os.fsencode(spec[1:])
    if spec.startswith("/"):
        return os.fsencode(spec)
    return None  # e.g. vsock:CID:PORT, used by VMs


class Notifier:
    """Sends notifications to the service manager; a no-op when there is none."""

    def __init__(self, address: bytes | None = None, watchdog_usec: int = 0) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._failed = False

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET``/``WATCHDOG_*`` and remove them, so that child processes
        (compilers, helpers) never talk to systemd in kvd's name."""
        env = os.environ if environ is None else environ
        values = {key: env.pop(key, "") for key in _ENV_KEYS}
        spec = values["NOTIFY_SOCKET"]
        address = notify_address(spec) if spec else None
        if spec and address is None:
            log.debug("NOTIFY_SOCKET=%r is not a unix socket; not notifying", spec)
        usec, pid = values["WATCHDOG_USEC"], values["WATCHDOG_PID"]
        # The watchdog is ours unless systemd named another process to ping it.
        ours = not pid or (pid.isdigit() and int(pid) == os.getpid())
        watchdog_usec = int(usec) if address is not None and usec.isdigit() and ours else 0
        return cls(address, watchdog_usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings: half the timeout, as sd_watchdog_enabled(3)
        advises; None when no watchdog is expected."""
        if not self.enabled or self.watchdog_usec <= 0:
            return None
        return self.watchdog_usec / 2e6

    def send(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram; True if it was sent.

        Never raises: a service manager that stopped listening must not take kvd down.
        """
        if self.address is None:
            return False
        data = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(data, self.address)
        except OSError as exc:
            # Once at warning, then quietly: a watchdog ping every few seconds would flood.
            (log.debug if self._failed else log.warning)("sd_notify failed: %s", exc)
            self._failed = True
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={_one_line(status)}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={_one_line(status)}")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={_one_line(status)}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(text: str) -> str:
    # A newline would end the assignment and start a bogus one.
    return " ".join(text.split())
