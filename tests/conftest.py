from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: ipc:// socket paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kvd-t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
