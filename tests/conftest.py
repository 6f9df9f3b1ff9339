from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Property tests: a few hundred cases while iterating, thousands in CI (CI=1). No deadline:
# speed belongs to benchmarks, and a shared machine makes timing flaky.
settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: ipc:// socket paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kvd-t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
