"""kvd.vllm finds vLLM's classes by what they offer, and refuses a vLLM that lacks a hook.

The pure checks run without vLLM; the resolution runs against the installed vLLM (skipped when
it is not importable), and against a vLLM whose worker lacks hooks: vLLM's own classes with
those hooks taken away, in a module written here, as a newer vLLM might ship them.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from kvd.vllm.holding import covered_sub_blocks
from kvd.vllm.hooks import (
    READ,
    TESTED,
    Hook,
    VllmIncompatible,
    missing_attributes,
    missing_hooks,
    version_note,
)

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vllm() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm
            from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: F401
                KVConnectorFactory,
            )
    except Exception as exc:  # noqa: BLE001 (any failure to load vLLM means: not here)
        pytest.skip(f"vLLM is not importable: {type(exc).__name__}: {exc}")
    return vllm


def test_a_hook_is_found_by_its_name_and_the_parameters_kvd_passes() -> None:
    hooks = (
        Hook("register_kv_caches", ("kv_caches",), "attaches the KV cache to kvd there"),
        Hook("shutdown", (), "detaches from kvd there"),
    )

    class Offers:
        def register_kv_caches(self, kv_caches: dict[str, Any], extra: int = 0) -> None: ...

        def shutdown(self) -> None: ...

    class Renamed:
        def register_kv_caches(self, caches: dict[str, Any]) -> None: ...

        shutdown = None

    assert missing_hooks(Offers, hooks) == []
    assert missing_hooks(Renamed, hooks) == [
        "register_kv_caches(kv_caches) (kvd.vllm attaches the KV cache to kvd there)",
        "shutdown() (kvd.vllm detaches from kvd there)",
    ]
    assert missing_attributes(Offers(), ("shutdown", "transfer_topo")) == ["transfer_topo"]


def test_the_startup_line_says_whether_kvd_was_tested_with_this_vllm() -> None:
    assert version_note(TESTED[0]) == (
        True,
        f"vLLM {TESTED[0]}: kvd.vllm is tested with this version",
    )
    tested, line = version_note(READ[-1])
    assert not tested and "checked against this version's source but not run" in line
    tested, line = version_note("9.9.0")
    assert not tested and line.startswith("vLLM 9.9.0: kvd.vllm was neither tested with")


def test_the_installed_vllm_offers_every_hook(vllm: Any) -> None:
    from kvd.vllm import connector
    from kvd.vllm.hooks import resolve_nixl

    nixl = resolve_nixl()
    assert nixl.version == vllm.__version__
    assert (nixl.pull_connector.__name__, nixl.base_connector.__name__) == (
        "NixlPullConnector",
        "NixlBaseConnector",
    )
    assert nixl.pull_worker.__name__ == "NixlPullConnectorWorker"
    assert nixl.pull_scheduler.__name__ == "NixlPullConnectorScheduler"
    assert nixl.transfer_results.__name__ == "KVConnectorTransferResults"
    assert {"SCHEDULER", "WORKER"} <= set(nixl.connector_role.__members__)
    assert connector.KvdWorker.__mro__[1] is nixl.pull_worker
    assert issubclass(connector.KvdConnector, nixl.pull_connector)


def test_a_vllm_whose_worker_lacks_hooks_is_refused_naming_them(
    vllm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvd.vllm.hooks import nixl_classes

    # vLLM's connector module, as a newer vLLM might ship it: the worker without the
    # post-process kvd replaces, and add_remote_agent taking its metadata under another name.
    (tmp_path / "newer_vllm_nixl.py").write_text(
        textwrap.dedent(f"""
        from {NIXL} import NixlPullConnector, NixlPullConnectorScheduler
        from {NIXL} import NixlPullConnectorWorker as _Worker
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorRole,
            KVConnectorTransferResults,
        )

        class NixlPullConnectorWorker(_Worker):
            post_process_device_kv_on_receive = None

            def add_remote_agent(self, agent_metadata, remote_tp_rank=0):
                return ""

        class NixlConnector(NixlPullConnector):
            pass
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    newer = importlib.import_module("newer_vllm_nixl")
    try:
        with pytest.raises(VllmIncompatible) as refused:
            nixl_classes(newer.NixlConnector, "9.9.0")
    finally:
        sys.modules.pop("newer_vllm_nixl", None)
    message = str(refused.value)
    assert message.startswith("vLLM 9.9.0 lacks what kvd.vllm builds on (tested with 0.32.0): ")
    assert (
        "NixlPullConnectorWorker.add_remote_agent(nixl_agent_meta, remote_tp_rank, "
        "remote_tp_size) (kvd.vllm learns a prefill engine's pages and TP size there)" in message
    )
    assert (
        "NixlPullConnectorWorker.post_process_device_kv_on_receive(block_size_ratio, "
        "block_ids_list, convert) (kvd.vllm replaces it with kvd's post-process)" in message
    )
    # Everything else it offers, vLLM's own classes do: only the two hooks are named.
    assert message.count("NixlPullConnectorWorker.") == 2


def test_the_sub_blocks_a_read_covered_are_counted_as_each_vllm_counts_them() -> None:
    # vLLM 0.32 and 0.33: from the first local block, min(local * ratio, remote).
    assert covered_sub_blocks(2, 4, 5, None) == 5
    assert covered_sub_blocks(3, 2, 6, None) == 6
    # After a decode-side prefix hit they pair the uncached local blocks with the prefill's last
    # blocks: aligned where the prompt fills its last local block (8 of 8 remote blocks, one
    # local block cached)...
    assert covered_sub_blocks(1, 4, 8, None) == 4
    # ...but a 9-block prompt whose first local block is cached puts remote blocks 1-8, not 4-8,
    # into local blocks 1 and 2: off by 3 sub-blocks, recomputed rather than rewritten.
    assert covered_sub_blocks(2, 4, 9, None) is None
    assert covered_sub_blocks(1, 2, 5, None) is None
    # vLLM 0.34 pairs from the last token: a decode-side prefix hit leaves local blocks for
    # tokens 64-191 of a 160-token prompt (block 64, remote 32), so 3 of their 4 sub-blocks
    # land, paired with the last 3 of the 5 remote blocks; min() would say 4.
    assert covered_sub_blocks(2, 2, 5, range(0, 3)) == 3
    # A READ that left the first sub-blocks unwritten, or wrote none, cannot be described to
    # kvd: the request is recomputed.
    assert covered_sub_blocks(2, 2, 5, range(1, 4)) is None
    assert covered_sub_blocks(2, 2, 5, range(0, 0)) is None
    assert covered_sub_blocks(1, 2, 0, None) is None


SOURCES = [Path(p) for p in os.environ.get("KVD_VLLM_SOURCES", "").split(os.pathsep) if p]


@pytest.mark.skipif(not SOURCES, reason="KVD_VLLM_SOURCES names no unpacked vLLM wheels")
@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_kvd_vllm_loads_against_another_vllms_source(source: Path) -> None:
    """``KVD_VLLM_SOURCES=/tmp/vllm-src/0.33.0:/tmp/vllm-src/0.34.0`` (wheels unzipped, e.g.
    ``pip download --no-deps vllm==0.34.0``): their Python imports here without their compiled
    parts, enough to resolve vLLM's classes and build kvd's on them."""
    program = (
        "import vllm, kvd.vllm.connector as c; "
        "print(vllm.__version__, vllm.__file__, c.KvdWorker.__mro__[1].__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(source), str(ROOT)])},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    version, path, worker_base = done.stdout.split()[-3:]
    assert path.startswith(str(source)) and worker_base == "NixlPullConnectorWorker"
    assert f"vLLM {version}: kvd.vllm" in done.stderr  # the startup line
