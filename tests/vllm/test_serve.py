"""The README's CPU recipe, run as written: ``kvd serve``, a prefill and a decode OpenAI server
(``python -m kvd.vllm.cli serve``), the P/D proxy, then its ``curl``; text completions through
the proxy, streamed and not, one at a time and all at once, equal a single instance's greedy
text. A stock decode server of the same block size, behind the same proxy, decodes other text
(vLLM 0.32's CPU block merge is wrong): recorded, as ``test_pd.py`` records it offline.

The recipe's ports (8000, 8100, 8200, 5600, 5601) must be free. ``XDG_RUNTIME_DIR`` points at a
scratch directory, so ``kvd serve`` and the connector meet in a runtime directory of the test's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

import psutil

from kvd.bench.serve import Server, check_prompts, completion_text, greedy_check, healthy
from kvd.bench.vllm_engine import make_model, make_tokenizer
from kvd.client import Client

pytestmark = pytest.mark.slow

README = Path(__file__).parents[2] / "README.md"
PORTS = (8000, 8100, 8200, 5600, 5601)
PROXY, PREFILL = "http://127.0.0.1:8000", "http://127.0.0.1:8100"
START_S = 900
PATH = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
"""This interpreter's ``python`` and ``kvd`` first, as in the virtualenv the README installs."""

NO_COMPILE = {"TORCHDYNAMO_DISABLE": "1", "VLLM_USE_AOT_COMPILE": "0"}
"""vLLM without torch.compile: dynamo off, and vLLM's AOT compile off (it refuses to run with
dynamo off otherwise)."""


def section(name: str) -> str:
    """The fenced block between the README's ``--8<-- [start:name]`` and ``[end:name]``."""
    text = README.read_text()
    body = text.split(f"--8<-- [start:{name}] -->", 1)[1].split(f"--8<-- [end:{name}]", 1)[0]
    return body.split("```sh\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(make_model(tmp_path_factory.mktemp("serve") / "tiny-llama"))


@pytest.fixture(scope="module")
def stock(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A stock decode server of the recipe's block size, started before the recipe's servers
    move any KV: from its first transfer, NIXL's progress thread polls a core in the recipe's
    stock prefill, and a server starting beside it waits for CPU."""
    # NIXL's progress thread waiting for UCX's events, as ``kvd bench serve`` runs stock:
    # NIXL's own keeps one of the two cores busy from the first transfer and every completion
    # here took tens of seconds. Its worker may hang in execute_model (seen with the thread on
    # and off, after decode-side prefix hits; py-spy: the worker's main thread running native
    # code, no Python frame): its engine then dies at vLLM's execute-model timeout, 60 s here
    # rather than 300, and its error answers count as other text. On one core with one OpenMP
    # thread: with vLLM's own binding its team spans both cores beside the recipe's servers'
    # teams, and one stock completion took over ten minutes (a CI run of 2026-12-07).
    args = argparse.Namespace(nixl_progress_thread=False, concurrency=4, prefix_caching=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "60")
        for name, value in NO_COMPILE.items():  # as the recipe's servers below
            env.setenv(name, value)
        server = Server(
            tmp_path_factory.mktemp("stock"),
            name="decode-stock",
            model=model,
            args=args,
            block_size=64,
            transfer={
                "kv_connector": "NixlConnector",
                "kv_role": "kv_consumer",
                "kv_load_failure_policy": "recompute",
            },
            core=max(os.sched_getaffinity(0)),
        )
    try:
        # Up before the recipe's servers start: three vLLM servers starting at once on two
        # cores took minutes longer than one after the other.
        server.wait_ready()
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def recipe(model: Path, stock: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The recipe's processes, started by the README's block itself; their runtime dir."""
    for port in PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port}, which the README's recipe uses, is taken")
    runtime = tmp_path_factory.mktemp("xdg")
    log = runtime / "recipe.log"
    script = section("vllm-recipe-cpu").replace("MODEL", shlex.quote(str(model))) + "wait\n"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", script],
            stdout=out,
            stderr=subprocess.STDOUT,
            # The commands as written, in the test's environment: NO_COMPILE spares each server
            # two and a half minutes of torch.compile on two cores (the text is the same eager).
            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PATH": PATH, **NO_COMPILE},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_S
        for url in (PREFILL, "http://127.0.0.1:8200", PROXY):
            while not healthy(url):
                tail = log.read_text(errors="replace")[-4000:]
                assert proc.poll() is None, f"the recipe exited:\n{tail}"
                # A server that died leaves the recipe's shell waiting on the others.
                assert "initialization failed" not in tail, f"a server of the recipe died:\n{tail}"
                assert time.monotonic() < deadline, f"{url} did not start:\n{tail}"
                time.sleep(1)
        yield runtime / "kvd" / "0"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_readmes_request_is_answered(recipe: Path, model: Path) -> None:
    command = section("vllm-recipe-request").replace("MODEL", str(model))
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["usage"]["completion_tokens"] == 16
    expected = completion_text(PREFILL, model, "Hello", 16, stream=False)
    assert answer["choices"][0]["text"] == expected


def test_kvd_decodes_the_single_instances_text(recipe: Path, model: Path) -> None:
    with Client(recipe) as kvd:
        assert [c.cache_id for c in kvd.status().caches], "the decode attached no cache to kvd"
    check = greedy_check(PROXY, PREFILL, model, check_prompts(3), max_tokens=16)
    assert check["equal"] == check["of"] and not check["errors"], check
    # Each prompt is sent four times: after the first, the decode's prefix cache holds all but
    # its last blocks, and kvd reads the rest from the prefill's blocks of the same tokens
    # (KvdWorker._cached_prefix) instead of having vLLM recompute them.
    log = (recipe.parent.parent / "recipe.log").read_text(errors="replace")
    assert "is recomputed" not in log, [line for line in log.splitlines() if "recomputed" in line]


def test_a_stock_decode_decodes_other_text(recipe: Path, model: Path, stock: Server) -> None:
    """The same block sizes with vLLM's own decode: its CPU merge scrambles K and V."""

    def switch(url: str) -> None:
        request = urllib.request.Request(
            PROXY + "/decode",
            data=json.dumps({"url": url}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=30).close()

    switch(stock.url)
    try:  # one prompt, four ways: a stock completion takes long here, one mismatch shows it
        check = greedy_check(PROXY, PREFILL, model, check_prompts(1), max_tokens=16)
    finally:
        switch("http://127.0.0.1:8200")
    assert check["equal"] < check["of"], "stock vLLM's CPU merge decoded the single text"


def test_last_a_decode_server_stopped_with_sigterm_releases_its_kvd_cache(recipe: Path) -> None:
    """Last in this module: it stops the recipe's decode server. ``vllm serve`` SIGKILLs its
    worker on SIGTERM, so the connector's detach never runs; kvd sees the worker gone and
    releases the cache within a second, not after ``engine_lease_s`` (30 s).

    How long vLLM takes to stop is its own (over 20 s on a starved CI machine): kvd's part
    starts when the server's processes, the worker that holds the cache among them, are gone."""
    with Client(recipe) as kvd:
        assert kvd.status().caches, "the decode attached no cache to kvd"
        server = psutil.Process(_listening(8200))
        processes = [server, *server.children(recursive=True)]
        server.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(processes, timeout=START_S)
        assert not alive, f"vllm serve still runs {START_S} s after SIGTERM: {alive}"
        deadline = time.monotonic() + 5  # the lease is 30 s
        while kvd.status().caches:
            assert time.monotonic() < deadline, kvd.status().caches
            time.sleep(0.2)


def _listening(port: int) -> int:
    """The process that listens on ``port`` (the eldest of those holding the socket: a server's
    children may inherit it)."""
    inodes = {
        fields[9]
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if (fields := line.split())[1].endswith(f":{port:04X}") and fields[3] == "0A"
    }
    holders = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            links = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
            if any(f"socket:[{inode}]" in links for inode in inodes):
                holders.add(int(proc.name))
    parents = {
        pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        for pid in holders
    }
    eldest = [pid for pid, parent in parents.items() if parent not in holders]
    assert len(eldest) == 1, f"port {port}: listening processes {sorted(holders)}"
    return eldest[0]
