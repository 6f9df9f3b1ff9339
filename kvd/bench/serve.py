"""``kvd bench serve``: the shape P/D is deployed in, stock vLLM's decode against kvd's, same run.

It starts ``kvd serve``, one prefill server (``vllm serve``, vLLM's NIXL connector), two decode
servers of another block size (vLLM's ``NixlConnector`` and ``KvdConnector``), and a P/D proxy
(``kvd.bench.proxy``), all over HTTP on loopback. The decode servers take turns behind the proxy,
the first one swapped each run; each is warmed up, then driven by ``vllm bench serve`` (random
prompts; sizes and concurrency are options). Greedy text completions through the proxy, one at a
time and all at once, streamed and not, are compared with the prefill server's own (a single
instance): kvd's must equal it; stock vLLM's CPU merge is wrong at differing block sizes.

Each server's processes run on one core, as on a machine of its own: the prefill's on the
first, the decodes' (which take turns) on the last (``Server``), kvd on a core apart from the
decode's (``place``), and the proxy and the load client off the decode's core (``load_cores``).
The servers run through ``kvd.bench.vllm_server`` (vLLM's own CLI; NIXL's progress thread
waiting for UCX's events unless ``--nixl-progress-thread``: see that module).
``kvd.bench.serve_report`` turns each run's figures into the table and the targets.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvd.bench.cores import read_cpu, read_stat, spawning_on
from kvd.bench.serve_report import CONNECTORS, repeated_report, run_report, table
from kvd.bench.stalls import StallWatch
from kvd.bench.vllm import free_port, pinned_daemon
from kvd.bench.vllm_engine import MAX_MODEL_LEN, make_model, make_tokenizer
from kvd.bench.vllm_server import PROGRESS_THREAD_ENV
from kvd.cpus import format_cpus
from kvd.progress import progress_bar

START_S = 900
"""The longest wait for a server to answer /health: two start at once on a busy 2-core machine."""
REQUEST_S = 600
"""The longest wait for one completion through the proxy."""
QUIET_S = 15
"""The longest wait, before a turn, for the other decode server to go quiet."""
KV_LEASE_S = 120
"""The prefill's ``kv_lease_duration``: vLLM's 30 s default frees blocks a decode on a machine
this loaded may not have read yet (the decode renews the lease while it waits for them)."""
STALE_READ = "Potentially invalid KV blocks"
"""What a prefill logs when a decode read blocks after their lease ran out."""

HELP = """\
Figures per decode connector (vllm bench serve's, over the timed requests):
  req/s, tok/s   request and output-token throughput
  TTFT           time to first token, p50 and p99 (and the longest), ms
  TPOT, ITL      time per output token and inter-token latency, p50 and p99, ms
  e2e            request latency, p50 and p99, ms
  ready          kvd's ReadDone -> Ready as the connector saw it, p50 and max, ms (kvd only):
                 the request's release, at the engine's next step after the answer
  answer         ReadDone -> kvd's answer at the connector's link thread, p50, ms (kvd only)
  at step's end  requests handed to kvd at a step's end, their READs seen landed only there
                 (kvd only): each is released a step after stock's inline merge would
  hand-off       the engine thread's time handing requests to kvd, sum and max, ms (kvd only)
  CPU time       kvd's and each server's CPU seconds in the run (every thread's: --keep's
                 report.json)
Where they run: each server's processes on one core, as on a machine of its own, the
prefill's on the first core, the decodes' (which take turns) on the last, kvd on a core
apart from the decode's (a third core if there is one, else the prefill's: --kvd-core), the
proxy and the load client off the decode's core (on a spare core if there is one).
Each turn starts once the other decode server has gone quiet (vLLM's engine keeps polling
for a second after its last request).
Targets, on the medians of the runs: throughput >= stock, TTFT p50 <= 1.05x and p99 <= 1.0x
stock's, ITL p99 <= stock's, e2e p50 <= stock's.
"""


class Server:
    """One ``vllm serve`` (its API server, engine core and worker processes)."""

    def __init__(
        self,
        work: Path,
        *,
        name: str,
        model: Path,
        args: argparse.Namespace,
        block_size: int,
        transfer: dict[str, Any],
        core: int | None = None,
    ) -> None:
        """``core``: the one core all its processes run on, its worker with one OpenMP thread
        (None: anywhere, with vLLM's own binding, a worker thread on every core)."""
        self.name = name
        self.core = core
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / f"{name}.log"
        env = {
            **os.environ,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            PROGRESS_THREAD_ENV: "busy" if args.nixl_progress_thread else "waits",
        }
        if core is not None:
            # vLLM's own binding gives each worker a team spanning every core: three such
            # teams on two cores made four requests take 48-67 s where two servers took 4 s,
            # and one thread per worker, the prefill's apart, under 2 s.
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        cmd = [
            sys.executable, "-m", "kvd.bench.vllm_server", "serve", str(model),
            "--port", str(self.port),
            "--block-size", str(block_size),
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(max(8, args.concurrency)),
            "--enforce-eager",
            "--seed", "0",
            "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
            "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip
        # A server's processes (API server, engine core, worker) all on its core, as on a
        # machine of its own: the engine core and the worker poll each other's queues in a busy
        # loop under load (vLLM's SpinCondition), and left to float, a decode's spinning engine
        # core took the prefill's core (the prefill leg took up to 1 s, 0.1 s with it apart).
        with open(self.log, "wb") as log, spawning_on(None if core is None else frozenset({core})):
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while not healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start:\n{self.tail()}")
            time.sleep(1)
        if self.core is not None:
            # vLLM's NIXL worker on CPU moves its engine thread, the one that computes with one
            # OpenMP thread, to the last core (``base_worker.py``: "reserve different cores for
            # start_load_kv()"), after OpenMP bound it: the prefill's computed on the decodes'
            # core. Back to its own; the worker's other threads stay where they were put.
            for name, pid in _process_tree(self.proc.pid):
                if name.startswith("VLLM::Worker"):
                    os.sched_setaffinity(pid, {self.core})

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM as systemd or Kubernetes stops it; its children are killed if they linger."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def thread_cpu(self) -> dict[str, float]:
        """CPU seconds so far of each thread of its processes, keyed ``process/thread``
        (names as the kernel keeps them; threads of one name summed)."""
        seconds: dict[str, float] = {}
        for name, pid in _process_tree(self.proc.pid):
            for task in Path(f"/proc/{pid}/task").glob("*/stat"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = read_stat(task)
                    key = f"{name}/{stat.name}"
                    seconds[key] = seconds.get(key, 0.0) + stat.cpu_s
        return seconds

    def wait_quiet(self, *, window_s: float = 0.5, busy_s: float = 0.05) -> tuple[float, bool]:
        """Wait until its processes used under ``busy_s`` CPU seconds in a ``window_s`` (at most
        ``QUIET_S``); the seconds waited, and whether it went quiet. vLLM's engine core and
        worker poll each other's queues for a second after their last message
        (``SpinCondition``): a decode server whose turn just ended keeps the decodes' core busy
        into the next server's turn."""
        started = time.monotonic()
        before = sum(self.thread_cpu().values())
        while time.monotonic() - started < QUIET_S:
            time.sleep(window_s)
            after = sum(self.thread_cpu().values())
            if after - before < busy_s:
                return time.monotonic() - started, True
            before = after
        return time.monotonic() - started, False

    def placement(self) -> str:
        """The CPUs its processes may run on, and where its engine thread runs."""
        return ", ".join(
            f"{name} on {format_cpus(os.sched_getaffinity(pid))}"
            for name, pid in _process_tree(self.proc.pid)
        )


def _process_tree(root: int) -> list[tuple[str, int]]:
    """(name, pid) of ``root`` and its descendants."""
    children: dict[int, list[int]] = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            children.setdefault(read_stat(path).ppid, []).append(int(path.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            out.append((Path(f"/proc/{pid}/comm").read_text().strip(), pid))
        todo.extend(children.get(pid, []))
    return out


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers its ``/health`` with 200 now."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _post(url: str, body: dict[str, Any], timeout: float = REQUEST_S) -> bytes:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return bytes(r.read())


def completion_text(base_url: str, model: Path, prompt: str, max_tokens: int, stream: bool) -> str:
    """A greedy completion's text, streamed (server-sent events, joined) or not."""
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    raw = _post(base_url + "/v1/completions", body).decode()
    if not stream:
        return str(json.loads(raw)["choices"][0]["text"])
    parts: list[str] = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            parts.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return "".join(parts)


def check_prompts(count: int, seed: int = 1) -> list[str]:
    """Text prompts of several lengths, seeded: a few hundred tokens each, some past a block."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiouy"]
    return [
        " ".join(
            "".join(rng.choices(syllables, k=rng.randint(1, 3)))
            for _ in range(rng.randint(60, 300))
        )
        for _ in range(count)
    ]


def greedy_check(
    proxy: str, single: str, model: Path, prompts: list[str], max_tokens: int
) -> dict[str, Any]:
    """Each prompt through the proxy (one at a time, then all at once; streamed and not)
    against the single instance's text. Requests that arrive together may batch differently;
    in float32 the CPU backend's greedy tokens do not depend on it (bf16's may)."""
    expected = [completion_text(single, model, p, max_tokens, False) for p in prompts]
    cases = [(p, e, s) for p, e in zip(prompts, expected, strict=True) for s in (False, True)]
    errors: list[str] = []

    def through_proxy(case: tuple[str, str, bool]) -> str | None:
        """The proxied text, or None (an error answer is not the single instance's text)."""
        try:
            return completion_text(proxy, model, case[0], max_tokens, case[2])
        except (OSError, ValueError, KeyError) as exc:  # KeyError: an error body, no choices
            errors.append(repr(exc))
            return None

    sequential = [through_proxy(c) == c[1] for c in cases]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        texts = list(pool.map(through_proxy, cases))
    concurrent_ = [t == e for t, (_, e, _) in zip(texts, cases, strict=True)]
    return {
        "equal": sum(sequential) + sum(concurrent_),
        "of": len(sequential) + len(concurrent_),
        "errors": errors,
    }


def load_run(
    work: Path,
    tag: str,
    proxy: str,
    model: Path,
    args: argparse.Namespace,
    *,
    warmups: int,
    seed: int,
    cores: frozenset[int] | None = None,
) -> dict[str, Any]:
    """One ``vllm bench serve`` through the proxy, its random prompts drawn from ``seed``, running
    on ``cores`` (None: where this process may); its result as saved (per request too)."""
    name = f"{tag}.json"
    cmd = [
        sys.executable, "-m", "kvd.vllm.cli", "bench", "serve",
        "--backend", "vllm",
        "--base-url", proxy,
        "--model", str(model),
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency),
        "--num-warmups", str(warmups),
        "--ignore-eos",
        "--temperature", "0",
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(work),
        "--result-filename", name,
        "--disable-tqdm",
    ]  # fmt: skip
    with open(work / f"{tag}.client.log", "wb") as log, spawning_on(cores):
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        tail = (work / f"{tag}.client.log").read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"vllm bench serve exited with {code}:\n" + "\n".join(tail))
    result: dict[str, Any] = json.loads((work / name).read_text())
    return result


@contextlib.contextmanager
def _proxy(
    work: Path, prefill: str, decode: str, cores: frozenset[int] | None = None
) -> Iterator[tuple[str, Path]]:
    """The P/D proxy, running on ``cores`` (None: where this process may)."""
    port = free_port()
    timings = work / "proxy-timings.jsonl"
    with open(work / "proxy.log", "wb") as log, spawning_on(cores):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvd.bench.proxy",
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--port",
                str(port),
                "--timings",
                str(timings),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start: " + (work / "proxy.log").read_text())
            time.sleep(0.2)
        yield url, timings
    finally:
        proc.terminate()
        proc.wait()


def _stats(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        stats: dict[str, Any] = json.loads(path.read_text())
        return stats
    return {}


def _settled_stats(path: Path) -> dict[str, Any]:
    """The connector's stats with the turn's last requests in: its link rewrites the file once
    the engine has been quiet for ``STATS_QUIET_S``, so this reads until two reads that far
    apart agree (a few tenths of a second after the load client exits)."""
    from kvd.vllm.link import STATS_QUIET_S

    stats = _stats(path)
    for _ in range(25):
        time.sleep(2 * STATS_QUIET_S)
        again = _stats(path)
        if again == stats:
            break
        stats = again
    return stats


def _legs(timings: Path, since: float) -> list[dict[str, Any]]:
    if not timings.exists():
        return []
    legs = [json.loads(line) for line in timings.read_text().splitlines() if line]
    return [leg for leg in legs if leg["came"] >= since]


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(
            f"kvd bench serve: vLLM is not importable ({exc}): pip install -e '.[vllm]'",
            file=sys.stderr,
        )
        return 2
    problem = check_arguments(args)
    if problem is not None:
        print(f"kvd bench serve: {problem}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.keep)
            if args.keep
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvd-bench-serve-")))
        )
        work.mkdir(parents=True, exist_ok=True)
        model = make_tokenizer(make_model(work / "model"))
        cores = sorted(os.sched_getaffinity(0))
        server_cores = place(cores, args.kvd_core)
        load = load_cores(cores, server_cores)
        # Beside three vLLM servers starting, kvd's torch import alone can take a minute.
        daemon = stack.enter_context(pinned_daemon(server_cores["kvd serve"], timeout=START_S))
        assert daemon.proc is not None
        kvd_pid = daemon.proc.pid
        stats_path = work / "kvd-connector-stats.json"
        transfers: dict[str, dict[str, Any]] = {
            "prefill": {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_S}},
            "stock": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                      "kv_load_failure_policy": "recompute"},
            "kvd": {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.vllm",
                    "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"kvd_runtime_dir": str(daemon.runtime_dir),
                                                  "kvd_stats_path": str(stats_path)}},
        }  # fmt: skip
        blocks = {"prefill": args.prefill_block, **dict.fromkeys(CONNECTORS, args.decode_block)}
        servers = {
            role: Server(
                work,
                name=role if role == "prefill" else f"decode-{role}",
                model=model,
                args=args,
                block_size=blocks[role],
                transfer=transfers[role],
                core=server_cores[role],
            )
            for role in blocks
        }
        for server in servers.values():
            stack.callback(server.kill)
        print(f"starting the prefill and two decode servers ({work})", file=sys.stderr)
        for server in servers.values():
            server.wait_ready()
        prefill = servers["prefill"]
        proxy, timings = stack.enter_context(_proxy(work, prefill.url, servers["stock"].url, load))
        placement = {n: s.placement() for n, s in servers.items()}
        placement["kvd serve"] = f"on {format_cpus(os.sched_getaffinity(kvd_pid))}"
        placement["proxy and load client"] = f"on {format_cpus(load)}"
        prompts = check_prompts(args.check_prompts)
        runs: list[dict[str, Any]] = []
        steps = args.runs * len(CONNECTORS)
        with (
            progress_bar(
                steps, "kvd bench serve", unit="run", quiet=args.json or args.no_progress
            ) as bar,
            StallWatch() as stalls,
        ):
            for index in range(args.runs):
                order = CONNECTORS if index % 2 == 0 else CONNECTORS[::-1]
                measured: dict[str, Any] = {}
                for connector in order:
                    decode = servers[connector]
                    _post(proxy + "/decode", {"url": decode.url})
                    # Warm-up on the first run only: later runs reuse warm servers.
                    warmups = args.warmups if index == 0 else 0
                    stats_before = _stats(stats_path) if connector == "kvd" else {}
                    idle = servers[next(c for c in CONNECTORS if c != connector)]
                    quiet_wait_s, quiet = idle.wait_quiet()
                    stalls.take()
                    since = time.time()
                    cpu_before = read_cpu(kvd_pid)
                    threads_before = {n: s.thread_cpu() for n, s in servers.items()}
                    result = load_run(
                        work,
                        f"run{index}-{connector}",
                        proxy,
                        model,
                        args,
                        warmups=warmups,
                        seed=prompt_seed(args, index, connector),
                        cores=load,
                    )
                    measured[connector] = {
                        "result": result,
                        "legs": _legs(timings, since),
                        "stalls": stalls.take(),
                        "quiet_wait_s": round(quiet_wait_s, 2),
                        "other_busy": not quiet,
                        "kvd_cpu_s": _cpu_seconds(cpu_before, read_cpu(kvd_pid)),
                        "threads_cpu_s": {
                            n: _used(threads_before[n], s.thread_cpu()) for n, s in servers.items()
                        },
                        "connector_before": stats_before,
                        "connector_after": _settled_stats(stats_path) if connector == "kvd" else {},
                    }
                    bar.update(1)
                runs.append(run_report(measured, order))
        checks: dict[str, Any] = {}
        if args.check_prompts:
            for connector in CONNECTORS:
                _post(proxy + "/decode", {"url": servers[connector].url})
                checks[connector] = greedy_check(
                    proxy, prefill.url, model, prompts, args.check_tokens
                )
        stale = STALE_READ in prefill.log.read_text(errors="replace")
        servers["kvd"].stop()
        released = _released_at_once(daemon.runtime_dir)
        report = repeated_report(runs, checks, placement, stale_reads=stale, released=released)
        report["work"] = str(work)
        (work / "report.json").write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(table(report, args)))
    return 0


def place(cores: list[int], kvd_core: str) -> dict[str, int]:
    """Each server's core, as on machines of their own: the prefill's on the first core, the
    decodes' (which take turns) on the last, and ``kvd serve`` on a core apart from the decode's
    as deployed (docs/deployment.md): a third core where there is one, else the prefill's, where
    it costs the prefill what it uses (``kvd_cpu_s``). ``kvd_core="decode"``: on the decode's, to
    measure what sharing it costs."""
    decode = cores[-1]
    apart = cores[1] if len(cores) >= 3 else cores[0]
    daemon = decode if kvd_core == "decode" else apart
    return {"prefill": cores[0], **dict.fromkeys(CONNECTORS, decode), "kvd serve": daemon}


def load_cores(cores: list[int], servers: dict[str, int]) -> frozenset[int]:
    """Where the proxy and the load client run: off the decode's core always, as they are off the
    decode's machine where P/D is deployed; on cores no server uses where there are any, else on
    the other servers'. Left to float, the kernel's load balancer moved them onto the decode's
    core more in kvd's turns (kvd's work moves off that core) than in stock's, and the decode
    computed its steps slower for it, not for anything of kvd's (docs/benchmarks.md)."""
    decode = servers[CONNECTORS[0]]
    spare = frozenset(cores) - set(servers.values())
    return spare or frozenset(cores) - {decode} or frozenset(cores)


def prompt_seed(args: argparse.Namespace, index: int, connector: str) -> int:
    """The seed of run ``index``'s prompts for ``connector``'s decode server: ``--seed`` for
    repeated prompts; with distinct prompts, one seed per run and server, so that no request
    finds its prompt in the prefill's or the decode's prefix cache."""
    if args.prompts == "repeated":
        return int(args.seed)
    return int(args.seed) + 1 + index * len(CONNECTORS) + CONNECTORS.index(connector)


def _cpu_seconds(before: Any, after: Any) -> float:
    from kvd.bench.cores import cpu_seconds

    return round(cpu_seconds(before, after), 3)


def _used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each thread used between two ``Server.thread_cpu`` readings, busiest first
    (threads that ended in between are not counted)."""
    used = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in used.items() if v > 0), key=lambda kv: -kv[1]))


def _released_at_once(runtime_dir: Path) -> bool:
    """Whether kvd holds no cache once the kvd decode server stopped (polled for a few seconds:
    the detach is one round trip; the engine lease would take 30 s)."""
    from kvd.client import Client

    deadline = time.monotonic() + 10
    with Client(runtime_dir) as client:
        while time.monotonic() < deadline:
            if not client.status().caches:
                return True
            time.sleep(0.2)
    return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="runs of both decode servers, the first swapped each run (default 1)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=24,
        help="timed requests per decode server and run (default 24)",
    )
    parser.add_argument("--input-len", type=int, default=600, help="prompt tokens (default 600)")
    parser.add_argument("--output-len", type=int, default=48, help="output tokens (default 48)")
    parser.add_argument(
        "--concurrency", type=int, default=4, help="requests in flight at once (default 4)"
    )
    parser.add_argument(
        "--warmups",
        type=int,
        default=8,
        help="warm-up requests per decode server before its first run (default 8)",
    )
    parser.add_argument(
        "--prefill-block", type=int, default=32, help="prefill block size (default 32)"
    )
    parser.add_argument(
        "--decode-block", type=int, default=64, help="decode block size (default 64)"
    )
    parser.add_argument(
        "--check-prompts",
        type=int,
        default=4,
        help="text prompts compared with the single instance, each 4 ways (default 4; 0: none)",
    )
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=16,
        help="greedy tokens per compared prompt (default 16)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the random dataset's seed (default 0)")
    parser.add_argument(
        "--prompts",
        choices=("repeated", "distinct"),
        default="repeated",
        help="repeated: the same seeded prompts in every run (after the first, each request "
        "finds all but its last blocks in both servers' prefix caches); distinct: new prompts "
        "for every run and decode server (each request's whole prompt is prefilled and read). "
        "Default repeated",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="servers without vLLM's prefix cache (on by default, as in vLLM)",
    )
    parser.add_argument(
        "--nixl-progress-thread",
        action="store_true",
        help="NIXL's progress thread as vLLM starts it (it polls with no pause: a core each) "
        "in the stock servers, instead of one that waits for UCX's events; kvd's decode "
        "follows its kvd_nixl_progress_thread (on CPU: one that waits)",
    )
    parser.add_argument(
        "--kvd-core",
        choices=("apart", "decode"),
        default="apart",
        help="where kvd serve runs: apart, on a core apart from the decode's as deployed (a "
        "third core if the machine has one, else the prefill's); decode, on the decode's core, "
        "to measure what sharing it costs. Default apart",
    )
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep its logs and results")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")  # fmt: skip


def check_arguments(args: argparse.Namespace) -> str | None:
    for name in ("runs", "num_prompts", "input_len", "output_len", "concurrency",
                 "prefill_block", "decode_block", "check_tokens"):  # fmt: skip
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')}: must be at least 1, not {getattr(args, name)}"
    for name in ("warmups", "check_prompts"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')}: must be 0 or more, not {getattr(args, name)}"
    if args.input_len + args.output_len > MAX_MODEL_LEN:
        return f"--input-len + --output-len: at most {MAX_MODEL_LEN} (the model's length)"
    return None
