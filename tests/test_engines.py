"""Engines come and go: real engine processes attach caches to a real ``kvd serve``, are killed,
hang, restart, and operators detach their caches. Every request an engine left is answered
exactly once: Ready means rewritten, Failed(cache_detached) means untouched.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvd.client import Client, KvdError, ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Failed, Ready
from tests.daemon_helpers import collect, subscribed, wait_for
from tests.reference import expected_block, same_bytes

BLOCK_SIZE, HEADS, HEAD_DIM = 16, 4, 64

ENGINE_SCRIPT = """
import sys, time
import torch
from kvd.client import Client, ShmCache

runtime_dir, cache_id, engine_id, shm_name, num_blocks, with_process = sys.argv[1:7]
cache = ShmCache.create(
    num_layers=1, num_blocks=int(num_blocks), block_size=16, num_heads=4, head_dim=64,
    layout="NHD", name=shm_name,
)
torch.manual_seed(0)
for t in cache.tensors:
    t.copy_(torch.randn(t.shape).to(t.dtype))
client = Client(runtime_dir)
client.attach(cache_id, cache.specs, engine_id=engine_id, release_with_process=with_process == "1")
print("attached", flush=True)
for line in sys.stdin:
    word, *rest = line.split()
    if word == "send":
        client.read_done(rest[0], cache_id, [int(b) for b in rest[1:]], remote_layout="HND",
                         block_size_ratio=1)
    elif word == "heartbeat":
        client.heartbeat(engine_id)
    elif word == "reattach":  # as a restarted engine would, from a new connection
        client = Client(runtime_dir)
        client.attach(cache_id, cache.specs, engine_id=engine_id)
    elif word == "reconnect":  # the attaching connection closes; the process lives on
        client.close()
        client = Client(runtime_dir)
        client.ping()
    print("done", flush=True)
time.sleep(3600)
"""


class Engine:
    """An engine process: its own shared-memory cache (``/dev/shm/<shm_name>``), attached to
    kvd as ``cache_id`` by ``engine_id``; it sends what it is told on stdin."""

    def __init__(
        self,
        script: Path,
        daemon: DaemonProcess,
        shm_name: str,
        *,
        cache_id: str = "e0",
        engine_id: str = "engine-a",
        num_blocks: int = 64,
        release_with_process: bool = False,
    ) -> None:
        self.shm_name = shm_name
        self.num_blocks = num_blocks
        args = [str(daemon.runtime_dir), cache_id, engine_id, shm_name, str(num_blocks)]
        args.append("1" if release_with_process else "0")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == "attached"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def tell(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        assert self._line() == "done"

    def send(self, req_id: str, blocks: list[int]) -> None:
        self.tell(f"send {req_id} {' '.join(map(str, blocks))}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def original(self) -> torch.Tensor:
        torch.manual_seed(0)
        return torch.randn(2, self.num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM).to(torch.bfloat16)

    def now(self) -> torch.Tensor:
        nbytes = 2 * self.num_blocks * BLOCK_SIZE * HEADS * HEAD_DIM * 2
        mapped = torch.from_file(
            f"/dev/shm/{self.shm_name}", shared=False, size=nbytes, dtype=torch.uint8
        )
        return mapped.view(torch.bfloat16).view(2, self.num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)

    def check(self, blocks: list[int], *, rewritten: bool) -> None:
        was, now = self.original(), self.now()
        for kv in range(2):
            for b in blocks:
                want = (
                    expected_block(
                        was[kv, b],
                        kv_parts=1,
                        block_size=BLOCK_SIZE,
                        heads=HEADS,
                        ratio=1,
                        remote_layout="HND",
                        local_layout="NHD",
                    )
                    if rewritten
                    else was[kv, b]
                )
                assert same_bytes(now[kv, b], want), (kv, b, rewritten)

    def close(self) -> None:
        self.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        Path(f"/dev/shm/{self.shm_name}").unlink(missing_ok=True)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "engine.py"
    path.write_text(ENGINE_SCRIPT)
    return path


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()


def shm_name(tag: str) -> str:
    return f"kvd-engine-test-{tag}-{time.monotonic_ns()}"


def caches(client: Client) -> dict[str, tuple[str, int]]:
    return {c.cache_id: (c.engine_id, c.num_blocks) for c in client.status().caches}


def send_three(engine: Engine) -> dict[str, list[int]]:
    """One full batch (launched at once) and two requests that wait in a 1 s window."""
    sent = {"full": list(range(16)), "wait-1": [20], "wait-2": [21, 22]}
    for req_id, blocks in sent.items():
        engine.send(req_id, blocks)
    return sent


def accepted(client: Client, sent: dict[str, list[int]]) -> bool:
    """Whether kvd has every request (an engine killed earlier could take queued ones along)."""
    return all(client.request_status(r, "e0").state != "unknown" for r in sent)


def check_answers(engine: Engine, events: dict[str, object], sent: dict[str, list[int]]) -> None:
    assert set(events) == set(sent)
    for req_id, event in events.items():
        if isinstance(event, Ready):
            engine.check(sent[req_id], rewritten=True)
        else:
            assert isinstance(event, Failed) and event.code == "cache_detached", event
            assert event.invalid_block_ids == sent[req_id]
            engine.check(sent[req_id], rewritten=False)


WINDOWED = ("--batch-window-us", "1000000", "--max-batch-blocks", "16")


def test_a_killed_engines_cache_is_detached_after_the_lease(
    script: Path, engines: list[Engine], short_tmp: Path
) -> None:
    with (
        DaemonProcess(*WINDOWED, "--engine-lease-s", "0.3", runtime_dir=short_tmp) as d,
        d.client() as client,
    ):
        engine = Engine(script, d, shm_name("killed"))
        engines.append(engine)
        sub = subscribed(client, ["e0"])
        sent = send_three(engine)
        wait_for(lambda: accepted(client, sent), timeout=30)
        engine.kill()
        wait_for(lambda: "e0" not in caches(client), timeout=60)
        events = {d.event.req_id: d.event for d in collect(sub, 3)}
        check_answers(engine, events, sent)
        assert isinstance(events["full"], Ready), "launched at once, so it finished"
        status = subprocess.run(
            [sys.executable, "-m", "kvd", "status", "--runtime-dir", str(d.runtime_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert "no caches attached" in status.stdout
        assert client.status().counters["leases_expired"] == 1
        assert sub.poll(0.5) is None, "one event per request"


def test_a_cache_released_with_its_process_is_detached_once_the_process_is_killed(
    script: Path, engines: list[Engine], short_tmp: Path
) -> None:
    # As ``vllm serve`` on SIGTERM: the worker is SIGKILLed, its /dev/shm cache goes with it.
    with (
        DaemonProcess(*WINDOWED, "--engine-lease-s", "600", runtime_dir=short_tmp) as d,
        d.client() as client,
    ):
        engine = Engine(script, d, shm_name("with-process"), release_with_process=True)
        engines.append(engine)
        sub = subscribed(client, ["e0"])
        sent = send_three(engine)
        wait_for(lambda: accepted(client, sent), timeout=30)
        engine.kill()
        wait_for(lambda: "e0" not in caches(client), timeout=60)  # far below the 600 s lease
        events = {d.event.req_id: d.event for d in collect(sub, 3)}
        check_answers(engine, events, sent)
        assert isinstance(events["full"], Ready), "launched at once, so it finished"
        assert "pid" in events["wait-1"].message and "is gone" in events["wait-1"].message
        assert client.status().counters["leases_expired"] == 1
        assert sub.poll(0.5) is None, "one event per request"


def test_a_process_alive_keeps_the_lease_when_its_connection_closes(
    script: Path, engines: list[Engine], short_tmp: Path
) -> None:
    with (
        DaemonProcess("--engine-lease-s", "600", runtime_dir=short_tmp) as d,
        d.client() as client,
    ):
        engine = Engine(script, d, shm_name("reconnect"), release_with_process=True)
        engines.append(engine)
        engine.tell("reconnect")

        def lease_started() -> bool:
            (cache,) = client.status().caches
            return cache.expires_in_s is not None

        wait_for(lease_started, timeout=30)
        (cache,) = client.status().caches
        assert cache.expires_in_s is not None and cache.expires_in_s > 500, cache


def test_a_restarted_engine_replaces_its_cache_without_waiting_for_the_lease(
    script: Path, engines: list[Engine], short_tmp: Path
) -> None:
    with (
        DaemonProcess(*WINDOWED, "--engine-lease-s", "600", runtime_dir=short_tmp) as d,
        d.client() as client,
    ):
        first = Engine(script, d, shm_name("first"))
        engines.append(first)
        sub = subscribed(client, ["e0"])
        sent = send_three(first)
        wait_for(lambda: accepted(client, sent), timeout=30)
        first.kill()

        def noticed() -> bool:
            (cache,) = client.status().caches
            return cache.expires_in_s is not None

        wait_for(noticed, timeout=30)
        assert (
            "gone, detached in"
            in subprocess.run(
                [sys.executable, "-m", "kvd", "status", "--runtime-dir", str(d.runtime_dir)],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
        )

        second = Engine(script, d, shm_name("second"), num_blocks=32)
        engines.append(second)
        assert caches(client) == {"e0": ("engine-a", 32)}
        events = {d.event.req_id: d.event for d in collect(sub, 3)}
        check_answers(first, events, sent)

        second.send("after", [3])
        (after,) = collect(sub, 1, timeout=30)
        assert isinstance(after.event, Ready) and after.event.req_id == "after"
        second.check([3], rewritten=True)

        with (
            ShmCache.create(
                num_layers=1, num_blocks=4, block_size=16, num_heads=1, head_dim=8
            ) as other,
            pytest.raises(KvdError, match=r"cache_exists: .*by engine 'engine-a'"),
        ):
            client.attach("e0", other.specs, engine_id="engine-b")
        assert caches(client) == {"e0": ("engine-a", 32)}


def test_an_attach_again_answers_the_old_attachs_requests_first(
    script: Path, engines: list[Engine], short_tmp: Path
) -> None:
    with DaemonProcess(*WINDOWED, runtime_dir=short_tmp) as d, d.client() as client:
        engine = Engine(script, d, shm_name("again"))
        engines.append(engine)
        sub = subscribed(client, ["e0"])
        sent = send_three(engine)
        wait_for(lambda: accepted(client, sent), timeout=30)
        engine.tell("reattach")  # within the 1 s window of wait-1 and wait-2
        events = {d.event.req_id: d.event for d in collect(sub, 3)}
        check_answers(engine, events, sent)
        assert isinstance(events["wait-1"], Failed) and isinstance(events["wait-2"], Failed)
        assert "attached cache 'e0' again" in events["wait-1"].message
        assert caches(client) == {"e0": ("engine-a", 64)}
        engine.send("after", [30])
        (after,) = collect(sub, 1, timeout=30)
        assert isinstance(after.event, Ready)


def test_an_engine_that_stops_heartbeating_loses_its_cache(
    script: Path, engines: list[Engine], short_tmp: Path
) -> None:
    with (
        DaemonProcess("--engine-lease-s", "1", runtime_dir=short_tmp) as d,
        d.client() as client,
    ):
        engine = Engine(script, d, shm_name("hung"))
        engines.append(engine)
        engine.tell("heartbeat")
        lease = client.heartbeat("engine-a")  # from another connection: the engine's all the same
        assert (lease.lease_s, lease.cache_ids) == (1.0, ["e0"])
        engine.proc.send_signal(signal.SIGSTOP)  # hung: its connection stays open
        try:
            wait_for(lambda: "e0" not in caches(client), timeout=60)
        finally:
            engine.proc.send_signal(signal.SIGCONT)
        assert client.heartbeat("engine-a").cache_ids == []


def test_an_operator_detaches_a_busy_cache_answering_its_requests_first(
    script: Path, engines: list[Engine], short_tmp: Path
) -> None:
    with DaemonProcess(*WINDOWED, runtime_dir=short_tmp) as d, d.client() as operator:
        engine = Engine(script, d, shm_name("operator"))
        engines.append(engine)
        sub = subscribed(operator, ["e0"])
        sent = send_three(engine)
        wait_for(lambda: accepted(operator, sent), timeout=30)
        # Within the 1 s window of wait-1 and wait-2 (kvd detach --force does the same).
        with pytest.raises(KvdError, match="not_owner"):
            operator.detach("e0")
        with pytest.raises(KvdError, match=r"cache_busy: .* or with force"):
            operator.detach("e0", engine_id="engine-a")
        operator.detach("e0", force=True)
        assert caches(operator) == {}
        events = {d.event.req_id: d.event for d in collect(sub, 3)}
        check_answers(engine, events, sent)
        assert isinstance(events["full"], Ready)
        assert isinstance(events["wait-1"], Failed) and isinstance(events["wait-2"], Failed)
        assert "was detached before these requests were started" in events["wait-1"].message


def test_kvd_detach(script: Path, engines: list[Engine], short_tmp: Path) -> None:
    with DaemonProcess(runtime_dir=short_tmp) as d, d.client() as client:
        engines.append(Engine(script, d, shm_name("cli")))
        kvd = [sys.executable, "-m", "kvd"]
        rt = ["--runtime-dir", str(d.runtime_dir)]
        stranger = subprocess.run(
            [*kvd, "detach", "e0", *rt], capture_output=True, text=True, timeout=60, check=False
        )
        assert stranger.returncode == 1
        assert stranger.stderr.startswith("kvd detach: not_owner: cache_id: 'e0' was attached")
        forced = subprocess.run(
            [*kvd, "detach", "e0", "--force", *rt],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (forced.returncode, forced.stdout) == (0, "detached e0\n"), forced.stderr
        assert caches(client) == {}
        gone = subprocess.run(
            [*kvd, "detach", "e0", "--force", *rt],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert gone.returncode == 1 and "unknown_cache" in gone.stderr
        assert "Traceback" not in gone.stderr
