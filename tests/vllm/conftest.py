"""What every real-vLLM test module shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvd.daemon_process import DaemonProcess


@pytest.fixture(scope="module")
def kvd() -> Iterator[DaemonProcess]:
    """A ``kvd serve`` of the module's own, on a runtime directory of its own."""
    with DaemonProcess() as daemon:
        yield daemon
