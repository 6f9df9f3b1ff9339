"""``kvd bench chaos``: exactly once under random SIGKILLs, checked byte for byte.

Each cycle, an engine in this process streams requests into a shared-memory cache attached to
a ``kvd serve`` child, while a second thread (the monkey) SIGKILLs that kvd at a random point,
sometimes right after a big request is seen ``launched``, sometimes again while the new one
starts, and starts a new kvd on the same runtime directory. The engine only follows the
engine contract (``Engine``): it is never told of a kill, it notices one as kvd's clients
would. A cycle ends when every request has a final answer: Ready, verified byte for byte, or
given up after a Failed that says its blocks are undefined.

What the READs land is deterministic, derived from (req_id, generation) and the seed, and what
the blocks must hold after the post-process is stated here from DESIGN.md, independently of
kvd's planner (``landed``): a block corrupted by a permutation applied twice, to the wrong
blocks or not at all, cannot verify.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from kvd.client import Client, EventsLost, KvdError, KvdTimeout, KvdUnavailable, ReplayError
from kvd.daemon_process import DaemonError, DaemonProcess
from kvd.progress import progress_bar
from kvd.protocol import Event, Ready, Reason
from kvd.shm import ShmCache
from kvd.tables import format_table

CACHE_ID = "chaos"

# One block is 1 MiB: 4 layers, K and V, 64 tokens x 8 heads x 128 bf16. A big request's
# rewrite takes tens of milliseconds, long enough for a kill to land in the middle of it.
LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 64, 8, 128
ROW_BYTES = HEAD_DIM * 2
NUM_BLOCKS = 256
MAX_BLOCKS = 16
"""Blocks of an ordinary request (1 to this many)."""
BIG_BLOCKS = 128
RATIOS = (2, 4)
CONCURRENCY = 8
"""Requests waiting for their event at most (each ordinary one holds its blocks)."""
SEND_GAP_S = 0.004
"""Mean pause between two new requests."""
KILL_WITHIN_S = 0.5
"""A timed kill lands this long after the cycle starts, at most."""

CLIENT_TIMEOUT_S = 2.0
ANSWER_TIMEOUT_S = 3.0
"""No event for a request this long after its ReadDone: send it again (same generation)."""
RETRY_S = 0.2
"""Delay before re-sending after a Failed that touched nothing, or a failed re-attach."""
SETTLE_S = 3.0
"""At a cycle's end, how long to wait for the answers of late repeats."""
STALL_S = 120.0
"""A cycle fails when no request got its final answer (and no kvd started) for this long."""
START_TIMEOUT_S = 120.0
"""How long a kvd may take to start (a busy machine makes importing torch slow)."""
GIVE_UP = 0.25
"""Chance that the engine recomputes instead of reading again after a Failed(interrupted)."""
MAX_GENERATIONS = 3
KVD_DOWN = (KvdTimeout, KvdUnavailable)
"""What a client call raises while kvd is killed or starting again: wait and retry."""

UNDEFINED = frozenset({Reason.INTERRUPTED, Reason.TRANSFORM_FAILED, Reason.GENERATION_IN_FLIGHT})
"""Failed codes after which the blocks' contents are undefined (read again or recompute)."""
RECORDED = frozenset({"ready", Reason.INTERRUPTED, Reason.TRANSFORM_FAILED})
"""Answers kvd records for a (req_id, generation): every later answer must say the same."""

Duplicate = Literal["", "at_once", "later"]
DUPLICATES: list[Duplicate] = ["", "at_once", "later"]
KillMode = Literal["launched", "timed"]


# -- what lands and what must result ------------------------------------------------------------


def landed(expected: torch.Tensor, ratio: int) -> torch.Tensor:
    """What the NIXL READ puts in local NHD pages whose post-processed content is ``expected``.

    ``expected`` is ``(..., block_size, heads, row)``: token t of head h at ``[t, h]``. The READ
    lands ``ratio`` remote HND pages back to back in each local page: sub-page s holds local
    tokens ``s * sub + t'`` (``sub = block_size // ratio``), heads outermost (DESIGN.md).
    """
    *outer, tokens, heads, row = expected.shape
    sub = tokens // ratio
    pages = expected.reshape(*outer, ratio, sub, heads, row).transpose(-3, -2)
    return pages.contiguous().view(expected.shape)


class Content:
    """Deterministic page bytes: slices of one random pool, at an offset hashed from
    (req_id, generation), so any party can recompute what a request's READ landed."""

    def __init__(self, seed: int, max_blocks: int) -> None:
        self.page_shape = (BLOCK_SIZE, HEADS, ROW_BYTES)
        self.page_bytes = BLOCK_SIZE * HEADS * ROW_BYTES
        size = LAYERS * 2 * max_blocks * self.page_bytes + (8 << 20)
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.empty(size // 8, dtype=torch.int64).random_(generator=g).view(torch.uint8)

    def expected(self, req_id: str, generation: int, blocks: int) -> torch.Tensor:
        """``(layers, 2, blocks, *page)`` uint8: each page after the post-process (a view)."""
        need = LAYERS * 2 * blocks * self.page_bytes
        offset = zlib.crc32(f"{req_id}/{generation}".encode()) % (len(self.pool) - need + 1)
        return self.pool[offset : offset + need].view(LAYERS, 2, blocks, *self.page_shape)


# -- the plan of a cycle ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestPlan:
    blocks: int
    ratio: int
    duplicate: Duplicate = ""
    """at_once: sent twice back to back; later: sent again after its blocks went to others."""


@dataclass(frozen=True)
class KillPlan:
    mode: KillMode
    delay_s: float = 0.0
    """timed: seconds after the cycle starts."""
    target: int = -1
    """launched: the index of the request whose launch triggers the kill."""
    startup_kill_s: float | None = None
    """When set, the first kvd started after the kill is killed this long after it spawned."""


@dataclass(frozen=True)
class CyclePlan:
    requests: list[RequestPlan]
    kill: KillPlan


def plan_cycle(rng: random.Random, cycle: int, requests: int) -> CyclePlan:
    """Random lengths and ratios, a few deliberate repeats, one kill; cycle 0 always kills
    right after a big request is seen launched (so a run of any length sees one)."""
    plans = []
    for _ in range(requests):
        dup = rng.choices(DUPLICATES, [0.7, 0.15, 0.15])[0]
        plans.append(RequestPlan(rng.randint(1, MAX_BLOCKS), rng.choice(RATIOS), dup))
    mode: KillMode = "launched" if cycle == 0 or rng.random() < 0.5 else "timed"
    target = -1
    if mode == "launched" or rng.random() < 0.5:
        target = rng.randrange(max(1, requests // 2))
        plans[target] = RequestPlan(BIG_BLOCKS, rng.choice(RATIOS), plans[target].duplicate)
    startup = rng.uniform(0.0, 2.5) if cycle and rng.random() < 0.15 else None
    delay = rng.uniform(0.0, KILL_WITHIN_S)
    return CyclePlan(plans, KillPlan(mode, delay, target if mode == "launched" else -1, startup))


# -- the figures --------------------------------------------------------------------------------


@dataclass
class Tally:
    seed: int
    cycles: int = 0
    """Cycles survived: every request got its final answer."""
    requests: int = 0
    blocks_verified: int = 0
    """Blocks of Ready requests that held exactly the expected bytes."""
    blocks_invalid: int = 0
    """Blocks of requests given up (recomputed) after a Failed that left them undefined."""
    blocks_corrupt: int = 0
    """Blocks of Ready requests whose bytes were wrong, at their Ready or later."""
    unanswered: int = 0
    contradictions: int = 0
    """Two different recorded answers for one (req_id, generation)."""
    repeats_sent: int = 0
    """ReadDones sent twice on purpose."""
    resends: int = 0
    """ReadDones sent again by the contract (restart, timeout, a Failed that touched nothing)."""
    interrupted: int = 0
    """(req_id, generation) answered Failed(interrupted)."""
    regenerations: int = 0
    """Bytes landed again and sent under the next generation."""
    kills: int = 0
    launched_kills: int = 0
    """Kills right after the target was seen launched."""
    startup_kills: int = 0
    events_lost: int = 0
    elapsed_s: float = 0.0
    error: str = ""
    runtime_dir: str = ""

    @property
    def ok(self) -> bool:
        return not (self.blocks_corrupt or self.unanswered or self.contradictions or self.error)


# -- the engine ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Tracked:
    req_id: str
    blocks: list[int]
    ratio: int
    duplicate: Duplicate
    generation: int = 0
    final: Literal["", "ready", "invalid"] = ""
    sent: int = -1
    """The last generation sent."""
    resend_at: float = 0.0
    expected: torch.Tensor | None = None
    corrupt: set[int] = field(default_factory=set)

    @property
    def ids(self) -> torch.Tensor:
        return torch.tensor(self.blocks, dtype=torch.int64)


class Engine:
    """A decode engine that follows the engine contract, and nothing more:

    1. After a request's READ landed in its blocks, send ReadDone(cache, req_id, generation g,
       blocks) and wait for the event of (req_id, g) on the cache's topic.
    2. Ready(g): the blocks are good (here: verified byte for byte). Failed(g) with code
       interrupted, transform_failed or generation_in_flight: the blocks' contents are
       undefined: land the bytes again, then send the same ReadDone with g + 1, or give up and
       recompute (counted as blocks reported invalid). Any other Failed code touched nothing:
       send the same ReadDone (same g) again once a kvd serves. (An unknown_cache from a
       restarted kvd needs no attach of its own: every event carries the daemon's epoch, so
       the subscription raised EventsLost, and step 4 attached, before delivering it.)
    3. Never land bytes again while a generation is in flight (only after its event).
    4. On EventsLost (kvd restarted, or a gap beyond the replay buffer), or no event within
       ``ANSWER_TIMEOUT_S``: send again (same g) every request still waiting; after a restart,
       attach the cache again first (caches are not persisted; the journal is).
    """

    def __init__(
        self, client: Client, cache: ShmCache, content: Content, rng: random.Random, tally: Tally
    ) -> None:
        self.client, self.cache, self.content, self.rng, self.tally = (
            client,
            cache,
            content,
            rng,
            tally,
        )
        self.bytes = [t.view(torch.uint8) for t in cache.tensors]
        self.requests: dict[str, Tracked] = {}
        self.recorded: dict[tuple[str, int], str] = {}
        """The first recorded answer of each (req_id, generation)."""
        self.interrupted: set[tuple[str, int]] = set()
        self.waiting: dict[str, Tracked] = {}
        self.held: deque[Tracked] = deque()
        """Ready requests whose blocks the engine still uses (verified again on release)."""
        self.free = set(range(cache.tensors[0].shape[1]))
        self.late: list[Tracked] = []
        """Repeats to send once the next request has taken blocks (maybe theirs)."""
        self.unsettled: set[tuple[str, int]] = set()
        """Late repeats of this cycle not answered yet."""
        self.late_sent_at = 0.0
        self.progress_at = 0.0
        """When a request of the cycle last got its final answer."""
        self.attach_at: float | None = 0.0
        """When to (re-)attach the cache; None while it is attached. Nothing is sent before."""
        self.sub = client.subscribe([CACHE_ID])

    def close(self) -> None:
        self.sub.close()

    # -- one cycle ------------------------------------------------------------------------------

    def run_cycle(self, cycle: int, plan: CyclePlan, monkey: Monkey) -> None:
        todo = deque(enumerate(plan.requests))
        self.progress_at = next_send = time.monotonic()
        monkey.start()
        while True:
            now = time.monotonic()
            if now > max(self.progress_at, monkey.finished_at) + STALL_S:
                break
            self._attach_if_needed(now)
            if self.attach_at is None and todo and now >= next_send:
                started = len(self.waiting) < CONCURRENCY and self._start(cycle, *todo[0], monkey)
                if started:
                    todo.popleft()
                    next_send = now + self.rng.expovariate(1 / SEND_GAP_S)
            if self.attach_at is None:
                for r in [r for r in self.waiting.values() if now >= r.resend_at]:
                    self._notify(r)
            if monkey.error and not monkey.is_alive():
                break
            quiet_since = max(monkey.finished_at, self.late_sent_at)
            settled = not self.unsettled or now > quiet_since + SETTLE_S
            if not todo and not self.waiting and not monkey.is_alive() and settled:
                break
            self._receive(0.01)
        monkey.stopping.set()  # when stalled: a kill not done yet is not done at all
        monkey.join()
        self.tally.unanswered += len(self.waiting) + len(todo)
        self.tally.requests += len(plan.requests)
        while self.held:
            self._release(self.held.popleft())
        self.unsettled.clear()  # lost with a kvd, or answered in a later cycle
        if not self.waiting and not todo:
            self.tally.cycles += 1

    def _start(self, cycle: int, index: int, plan: RequestPlan, monkey: Monkey) -> bool:
        """Take free blocks (releasing Ready ones if need be), land, notify; False if short."""
        while len(self.free) < plan.blocks and self.held:
            self._release(self.held.popleft())
        if len(self.free) < plan.blocks:
            return False
        blocks = self.rng.sample(sorted(self.free), plan.blocks)
        self.free.difference_update(blocks)
        r = Tracked(f"c{cycle}-r{index}", blocks, plan.ratio, plan.duplicate)
        self.requests[r.req_id] = r
        self.waiting[r.req_id] = r
        self._land(r)
        self._notify(r)
        if r.duplicate == "at_once":
            self._notify(r, deliberate=True)
        if index == monkey.plan.target:
            monkey.target = r.req_id
            monkey.target_sent.set()
        for old in self.late:  # their blocks may now be this request's
            self._notify(old, deliberate=True)
            self.unsettled.add((old.req_id, old.generation))
            self.late_sent_at = time.monotonic()
        self.late.clear()
        return True

    # -- data -----------------------------------------------------------------------------------

    def _land(self, r: Tracked) -> None:
        """Write what the READ of (req_id, generation) puts in the request's blocks."""
        r.expected = self.content.expected(r.req_id, r.generation, len(r.blocks))
        pages = landed(r.expected, r.ratio)
        ids = r.ids
        for layer, tensor in enumerate(self.bytes):
            for part in range(2):
                tensor[part].index_copy_(0, ids, pages[layer, part])

    def _verify(self, r: Tracked) -> int:
        """Compare every page of the request's blocks with what it must hold; returns how
        many blocks matched, and records the others in ``r.corrupt``."""
        assert r.expected is not None
        ids = r.ids
        bad = torch.zeros(len(r.blocks), dtype=torch.bool)
        for layer, tensor in enumerate(self.bytes):
            for part in range(2):
                got, want = tensor[part].index_select(0, ids), r.expected[layer, part]
                if not torch.equal(got, want):
                    bad |= (got != want).flatten(1).any(1)
        new = {i for i in bad.nonzero().flatten().tolist() if i not in r.corrupt}
        r.corrupt |= new
        self.tally.blocks_corrupt += len(new)
        return len(r.blocks) - int(bad.sum())

    def _release(self, r: Tracked) -> None:
        """The engine is done with a Ready request's blocks: check them once more, free them."""
        self._verify(r)
        self._free(r)

    def _free(self, r: Tracked) -> None:
        self.free.update(r.blocks)
        if r.duplicate == "later":
            self.late.append(r)

    # -- notifications and events ---------------------------------------------------------------

    def _notify(self, r: Tracked, *, deliberate: bool = False) -> None:
        """Send the request's ReadDone (its current generation); ``deliberate``: a repeat sent
        on purpose, not by the contract."""
        try:
            self.client.read_done(
                r.req_id,
                CACHE_ID,
                r.blocks,
                remote_layout="HND",
                block_size_ratio=r.ratio,
                generation=r.generation,
            )
        except (KvdTimeout, KvdUnavailable, KvdError) as exc:
            # The client asks kvd whether the cache is attached when it did not see the
            # Attached reply itself (that attach timed out): not attached, or kvd is down.
            if isinstance(exc, KvdError) and exc.code != Reason.UNKNOWN_CACHE:
                raise
            self.attach_at = r.resend_at = time.monotonic()
            return
        if deliberate:
            self.tally.repeats_sent += 1
        elif r.sent == r.generation:
            self.tally.resends += 1
        r.sent = r.generation
        r.resend_at = time.monotonic() + ANSWER_TIMEOUT_S

    def _attach_if_needed(self, now: float) -> None:
        if self.attach_at is None or now < self.attach_at:
            return
        try:
            self.client.attach(CACHE_ID, self.cache.specs)
        except KVD_DOWN:
            self.attach_at = now + RETRY_S
            return
        except KvdError as exc:
            if exc.code != Reason.CACHE_EXISTS:
                raise
            # Ours, from an attach that timed out here: usable once kvd lists it (opening
            # the memory may still be under way).
            if not self._listed():
                self.attach_at = now + RETRY_S
                return
        self.attach_at = None

    def _listed(self) -> bool:
        try:
            return any(c.cache_id == CACHE_ID for c in self.client.status().caches)
        except KVD_DOWN:
            return False

    def _receive(self, timeout: float) -> None:
        try:
            delivery = self.sub.poll(timeout)
        except EventsLost:
            # kvd restarted (or events are gone): attach again, then re-send every request
            # still waiting; kvd answers those it knows from its journal.
            self.tally.events_lost += 1
            self.attach_at = now = time.monotonic()
            for r in self.waiting.values():
                r.resend_at = now
            return
        except (ReplayError, KvdUnavailable):
            return  # kvd is down: the restart shows as EventsLost once it is back
        if delivery is not None:
            self._answer(delivery.event)

    def _answer(self, event: Event) -> None:
        r = self.requests.get(event.req_id)
        if r is None:
            return
        key = (r.req_id, event.generation)
        self.unsettled.discard(key)
        kind = "ready" if isinstance(event, Ready) else event.code
        if kind in RECORDED:
            first = self.recorded.setdefault(key, kind)
            if first != kind:
                self.tally.contradictions += 1
            elif kind == Reason.INTERRUPTED and key not in self.interrupted:
                self.interrupted.add(key)
                self.tally.interrupted += 1
        if r.final or event.generation != r.generation:
            return  # a repeat's answer, or an older generation's
        if isinstance(event, Ready):
            self.tally.blocks_verified += self._verify(r)
            r.final = "ready"
            self.progress_at = time.monotonic()
            del self.waiting[r.req_id]
            self.held.append(r)
            if self.rng.random() < 0.5 and len(self.held) > 1:
                self._release(self.held.popleft())
        elif event.code in UNDEFINED:
            if self.rng.random() < GIVE_UP or r.generation + 1 >= MAX_GENERATIONS:
                r.final = "invalid"
                self.progress_at = time.monotonic()
                del self.waiting[r.req_id]
                self.tally.blocks_invalid += len(r.blocks)
                self._free(r)
            else:
                r.generation += 1
                self._land(r)
                self.tally.regenerations += 1
                r.resend_at = 0.0  # sent by the loop, once the cache is attached
        else:
            r.resend_at = time.monotonic() + RETRY_S


# -- the monkey ---------------------------------------------------------------------------------

KVD_ARGS = ("--log-level", "warning")


class Monkey(threading.Thread):
    """Kills the kvd at the planned point and starts a new one on the same runtime directory;
    ``kvd`` is then the new one. ``error`` says why a kvd would not start, or that one
    exited by itself."""

    def __init__(self, daemon: DaemonProcess, plan: KillPlan, tally: Tally) -> None:
        super().__init__(name="kvd-chaos-monkey", daemon=True)
        self.kvd, self.plan, self.tally = daemon, plan, tally
        self.target = ""
        self.target_sent = threading.Event()
        self.stopping = threading.Event()
        self.finished_at = 0.0
        self.error = ""

    def run(self) -> None:
        try:
            if self.plan.mode == "launched":
                if not self._kill_at_launch():
                    return
            elif self.stopping.wait(self.plan.delay_s):
                return
            else:
                self._kill(self.kvd)
            if self.plan.startup_kill_s is not None:
                starting = DaemonProcess(*KVD_ARGS, runtime_dir=self.kvd.runtime_dir)
                starting.spawn()
                time.sleep(self.plan.startup_kill_s)
                if self._kill(starting):
                    self.tally.startup_kills += 1
            again = DaemonProcess(*KVD_ARGS, runtime_dir=self.kvd.runtime_dir)
            self.kvd = again.start(START_TIMEOUT_S)
        except DaemonError as exc:
            self.error = f"kvd did not start again: {exc}"
        finally:
            self.finished_at = time.monotonic()

    def _kill_at_launch(self) -> bool:
        """Kill kvd as soon as the target request is seen ``launched`` (or past it: a kill all
        the same); False if stopped first. The kill comes before anything else this thread
        does (closing its client included): the rewrite it should land in lasts tens of
        milliseconds."""
        while not self.target_sent.wait(0.05):
            if self.stopping.is_set():
                return False
        with Client(self.kvd.runtime_dir, timeout=CLIENT_TIMEOUT_S) as client:
            while not self.stopping.is_set():
                try:
                    state = client.request_status(self.target, CACHE_ID).state
                except KVD_DOWN:
                    continue
                if state in ("launched", "done", "ready", "failed"):
                    self._kill(self.kvd)
                    self.tally.launched_kills += state == "launched"
                    return True
                time.sleep(0.0005)
        return False

    def _kill(self, daemon: DaemonProcess) -> bool:
        """SIGKILL ``daemon``; False if it was no longer running."""
        assert daemon.proc is not None
        code = daemon.proc.poll()
        if code is not None:
            if code != -signal.SIGKILL and not self.error:
                self.error = f"kvd exited by itself with {code}:\n{daemon.log_tail()}"
            return False
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        self.tally.kills += 1
        return True


# -- the run ------------------------------------------------------------------------------------


def run_chaos(
    cycles: int, requests: int, seed: int, on_cycle: Callable[[Tally], None] | None = None
) -> Tally:
    """``cycles`` cycles of ``requests`` requests each, one kill per cycle; stops after the
    first cycle that breaks exactly once (the runtime directory, with kvd.log, is then kept)."""
    tally = Tally(seed=seed)
    # Two streams, so that the plans of a seed do not depend on the order events arrive in.
    plans, choices = random.Random(seed), random.Random(seed + 1)
    runtime_dir = Path(tempfile.mkdtemp(prefix="kvd-chaos-"))
    daemon = DaemonProcess(*KVD_ARGS, runtime_dir=runtime_dir)
    cache = ShmCache.create(
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        layout="NHD",
    )
    monkey: Monkey | None = None
    started = time.monotonic()
    # The monkey's kill must land inside a rewrite of tens of milliseconds: it waits for the
    # GIL at most this long once kvd's answer is in (the default is 5 ms).
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        content = Content(seed, BIG_BLOCKS)
        daemon.start(START_TIMEOUT_S)
        with Client(runtime_dir, timeout=CLIENT_TIMEOUT_S) as client:
            engine = Engine(client, cache, content, choices, tally)
            try:
                for cycle in range(cycles):
                    plan = plan_cycle(plans, cycle, requests)
                    monkey = Monkey(daemon, plan.kill, tally)
                    engine.run_cycle(cycle, plan, monkey)
                    daemon = monkey.kvd
                    tally.error = tally.error or monkey.error
                    monkey = None
                    if on_cycle is not None:
                        on_cycle(tally)
                    if not tally.ok:
                        break
            finally:
                engine.close()
    finally:
        sys.setswitchinterval(switch_interval)
        if monkey is not None:  # the cycle was cut short by an exception
            monkey.stopping.set()
            if monkey.ident is not None:
                monkey.join()
            daemon = monkey.kvd
            tally.error = tally.error or monkey.error
        tally.elapsed_s = time.monotonic() - started
        try:
            daemon.close()
        finally:
            cache.close()
    if tally.ok:
        shutil.rmtree(runtime_dir, ignore_errors=True)
    else:
        tally.runtime_dir = str(runtime_dir)
    return tally


def run(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    quiet = args.json or args.no_progress
    with progress_bar(args.cycles, "kvd bench chaos", unit="cycle", quiet=quiet) as bar:

        def cycle_done(tally: Tally) -> None:
            bar.set_postfix_str(
                f"{tally.interrupted} interrupted, {tally.blocks_corrupt} corrupt blocks"
            )
            bar.update()

        tally = run_chaos(args.cycles, args.requests, seed, on_cycle=cycle_done)
    report = {
        "benchmark": "chaos",
        "cycles_planned": args.cycles,
        "requests_per_cycle": args.requests,
        **asdict(tally),
    }
    report["exactly_once"] = tally.ok
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report))
    if tally.error:
        print(f"kvd bench chaos: {tally.error}", file=sys.stderr)
    return 0 if tally.ok else 1


def _table(report: dict[str, Any]) -> str:
    r = report
    kills = (
        f"{r['kills']} ({r['launched_kills']} right after a launch, "
        f"{r['startup_kills']} while a kvd started)"
    )
    rows = [
        ("cycles survived", f"{r['cycles']} of {r['cycles_planned']}"),
        ("requests", str(r["requests"])),
        ("blocks verified", str(r["blocks_verified"])),
        ("blocks reported invalid", str(r["blocks_invalid"])),
        ("blocks corrupt", str(r["blocks_corrupt"])),
        ("requests unanswered", str(r["unanswered"])),
        ("contradictory answers", str(r["contradictions"])),
        ("repeats sent", str(r["repeats_sent"])),
        ("re-sends (contract)", str(r["resends"])),
        ("interrupted seen", str(r["interrupted"])),
        ("generations bumped", str(r["regenerations"])),
        ("kills", kills),
        ("restarts noticed", str(r["events_lost"])),
        ("elapsed", f"{r['elapsed_s']:.1f} s"),
    ]
    lines = [
        f"kvd bench chaos: {r['cycles_planned']} cycles of {r['requests_per_cycle']} requests, "
        f"one SIGKILL each, seed {r['seed']}",
        "",
        *format_table(rows),
        "",
        "exactly once: " + ("held" if r["exactly_once"] else "BROKEN"),
    ]
    if r["runtime_dir"]:
        lines.append(f"runtime directory kept (kvd.log, journal): {r['runtime_dir']}")
    return "\n".join(lines)
