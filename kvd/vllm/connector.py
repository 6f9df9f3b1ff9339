"""``KvdConnector``: vLLM 0.32's NIXL connector with the decode-side post-process done by kvd.

Load it with ``KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd.vllm",
kv_role=..., kv_connector_extra_config={"kvd_runtime_dir": ...})``. The scheduler side, the
prefill side (``kv_role="kv_producer"``) and every NIXL transfer are vLLM's own; a decode worker
differs in four places:

- its KV cache is allocated in a /dev/shm file on CPU (``get_mem_pool_context``), and attached
  to kvd at ``register_kv_caches`` with its exact page format (CUDA IPC on GPU); a backend, layout
  or CPU ISA whose format kvd does not know is refused at startup, never guessed;
- the post-process vLLM would run inline is replaced: each request whose READ finished is sent
  to kvd as a ReadDone (covered sub-blocks included) and held out of ``finished_recving``;
- kvd's Ready releases it; kvd's Failed releases it as a failed receive, its blocks reported
  invalid, so ``kv_load_failure_policy="recompute"`` recomputes it;
- a kvd restart is answered by attaching again and re-sending what is held (kvd answers from its
  journal); a kvd gone for ``kvd_down_timeout_s`` fails what is held. Nothing hangs, and nothing
  decodes from blocks kvd did not finish.

kvd is found through ``kv_connector_extra_config["kvd_runtime_dir"]``, else ``KVD_RUNTIME_DIR``,
else kvd's default runtime directory for the worker's rank; an unreachable kvd is a startup error.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from kvd.client import (
    Client,
    EventsLost,
    KvdError,
    KvdTimeout,
    KvdUnavailable,
    Subscription,
    read_done_message,
    resolve_runtime_dir,
)
from kvd.dtypes import dtype_name
from kvd.endpoints import daemon_alive
from kvd.protocol import CACHE_ID_MAX, MemoryRef, ShmRef, TensorSpec
from kvd.subscription import ReplayError
from kvd.vllm.formats import UnknownFormat, page_format, remote_page_format
from kvd.vllm.holding import Held, Holding, Released
from kvd.vllm.shm import ShmAllocation

# Under "vllm.", so vLLM's own log handler shows these lines with the engine's.
log = logging.getLogger("vllm.kvd")

DOWN_TIMEOUT_S = 10.0
"""How long held requests wait for a kvd that is not running before they are failed."""
_CACHE_ID = re.compile(r"[^A-Za-z0-9._:@+-]")


class KvdConnectorError(RuntimeError):
    """The decode worker cannot use kvd; the message says what to change."""


class KvdWorker(NixlPullConnectorWorker):
    """A NIXL pull worker whose received blocks kvd post-processes."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        found = resolve_runtime_dir(extra.get("kvd_runtime_dir") or None, gpu=str(self.tp_rank))
        assert found is not None  # no explicit endpoints: always a directory
        self.kvd_dir = found
        self.down_timeout_s = float(extra.get("kvd_down_timeout_s", DOWN_TIMEOUT_S))
        self._stats_path = extra.get("kvd_stats_path")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise KvdConnectorError(
                f"kvd.vllm supports one KV cache group, this model has "
                f"{len(kv_cache_config.kv_cache_groups)} (a hybrid model)"
            )
        self.cache_id = _CACHE_ID.sub("-", f"vllm.{engine_id}.{self.tp_rank}")[:CACHE_ID_MAX]
        self.kvd = Client(self.kvd_dir, timeout=float(extra.get("kvd_timeout_s", 2.0)))
        self._attach_timeout_s = float(extra.get("kvd_attach_timeout_s", 120.0))
        self._events: Subscription | None = None
        self._specs: list[TensorSpec] = []
        self._local_format = ""
        self._isa: str | None = None
        self._remote_formats: dict[str, str] = {}
        self._holding = Holding()
        self._down_since: float | None = None
        self._last_event = time.monotonic()
        self.stats = _Stats()
        group = extra.get("kvd_shm_group")
        self.allocation = (
            ShmAllocation("kvd-vllm", _group_id(group) if group is not None else None)
            if self.device_type == "cpu"
            else None
        )

    # -- startup --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Attach the caches to kvd with their page format, then let NIXL register them."""
        self._local_format = self._page_format()
        try:
            self.kvd.ping()
        except (KvdTimeout, KvdUnavailable, KvdError) as exc:
            raise KvdConnectorError(
                f"kvd is not reachable at {self.kvd_dir} ({exc}): start kvd first (systemd: "
                "After=/Requires= on kvd@N.service), or set kv_connector_extra_config "
                "kvd_runtime_dir / KVD_RUNTIME_DIR"
            ) from exc
        self._specs = self._tensor_specs(kv_caches)
        self._attach()
        super().register_kv_caches(kv_caches)
        log.info(
            "kvd post-processes this worker's received blocks: cache %r, %s pages, %d tensors, "
            "kvd at %s",
            self.cache_id,
            self._local_format,
            len(self._specs),
            self.kvd_dir,
        )

    def _page_format(self) -> str:
        cache_dtype = str(self.vllm_config.cache_config.cache_dtype)
        if self.backend_name == "CPU_ATTN":
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            model_dtype = self.model_config.dtype
            assert isinstance(model_dtype, torch.dtype)  # resolved when the engine started
            self._isa = _get_attn_isa(
                model_dtype,
                self.block_size,
                self.model_config.get_head_size(),
                cache_dtype,
            )
        try:
            return page_format(
                self.backend_name,
                self.kv_cache_layout,
                isa=self._isa,
                use_mla=self.use_mla,
                kv_cache_dtype=cache_dtype,
            )
        except UnknownFormat as exc:
            raise KvdConnectorError(
                f"kvd cannot post-process this engine's KV cache: {exc}"
            ) from exc

    def _tensor_specs(self, kv_caches: dict[str, torch.Tensor]) -> list[TensorSpec]:
        """One spec per distinct layer tensor (layers that share a cache share its bytes)."""
        specs = []
        seen: set[int] = set()
        for name, tensor in kv_caches.items():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            num_blocks, heads, block_size, content = tensor.shape
            dtype = dtype_name(tensor.dtype)
            if dtype is None or not tensor.is_contiguous():
                raise KvdConnectorError(f"{name}: a {tensor.dtype} KV cache kvd cannot attach")
            specs.append(
                TensorSpec(
                    name=name,
                    shape=[num_blocks, heads, block_size, content],
                    dtype=dtype,
                    block_size=block_size,
                    memory=self._memory(tensor),
                    page_format=self._local_format,
                    num_heads=heads,
                    head_dim=content // 2,
                )
            )
        return specs

    def _memory(self, tensor: torch.Tensor) -> MemoryRef:
        if tensor.device.type == "cuda":
            from kvd.cudaipc import export_tensor

            return export_tensor(tensor)
        if self.allocation is None:
            raise KvdConnectorError("a CPU KV cache outside shared memory")
        return ShmRef(name=self.allocation.name, offset=self.allocation.offset_of(tensor))

    def _attach(self) -> None:
        # Mapping a large cache takes a while (kvd fills in its page tables): a longer wait.
        timeout, self.kvd.timeout = self.kvd.timeout, self._attach_timeout_s
        try:
            self.kvd.attach(self.cache_id, self._specs, engine_id=self.engine_id)
        finally:
            self.kvd.timeout = timeout
        if self._events is not None:
            self._events.close()
        self._events = self.kvd.subscribe([self.cache_id])
        self._down_since = None

    def _reattach(self) -> bool:
        """Attach again after a kvd restart; False (and tried again later) if kvd is not
        back yet."""
        try:
            self._attach()
        except (KvdTimeout, KvdUnavailable, KvdError) as exc:
            log.warning("kvd: attaching again failed (%s); trying again", exc)
            if self._down_since is None:
                self._down_since = time.monotonic()
            return False
        return True

    def add_remote_agent(self, nixl_agent_meta: Any, *args: Any, **kwargs: Any) -> str:
        """Learn a prefill engine's page format at its handshake; refuse one kvd does not know."""
        try:
            fmt = remote_page_format(
                nixl_agent_meta.attn_backend_name,
                nixl_agent_meta.kv_cache_layout,
                local=self._local_format,
                local_isa=self._isa,
                kv_cache_dtype=str(self.vllm_config.cache_config.cache_dtype),
            )
        except UnknownFormat as exc:
            raise KvdConnectorError(
                f"prefill engine {nixl_agent_meta.engine_id!r}: kvd cannot read its pages: {exc}"
            ) from exc
        self._remote_formats[nixl_agent_meta.engine_id] = fmt
        result: str = super().add_remote_agent(nixl_agent_meta, *args, **kwargs)
        return result

    # -- the post-process, handed to kvd --------------------------------------------------------

    def post_process_device_kv_on_receive(
        self, block_size_ratio: int, block_ids_list: list[Any], convert: bool = True
    ) -> None:
        """Not here: kvd rewrites these blocks (see ``get_transfer_results``)."""

    def post_process_device_kv_on_receive_heterogeneous_attn(self, block_ids: list[int]) -> None:
        """Not here either: kvd knows the remote format, whatever its attention backend."""

    def get_transfer_results(self) -> KVConnectorTransferResults:
        metas = dict(self._recving_metadata)  # vLLM pops them below
        results = super().get_transfer_results()
        started = time.perf_counter()
        arrived = results.finished_recving - results.failed_recving
        for req_id in arrived:
            meta = metas.get(req_id)
            if meta is None or meta.remote is None:
                continue  # nothing landed for kvd to rewrite
            results.finished_recving.discard(req_id)
            self._hand_off(req_id, meta)
        released = self._answers()
        results.finished_recving |= released.finished
        results.failed_recving |= released.failed
        if arrived or released.finished:
            self.stats.step(time.perf_counter() - started, len(arrived), released)
            self._write_stats()
        return results

    def _hand_off(self, req_id: str, meta: Any) -> None:
        engine_id = meta.remote.engine_id
        assert self.transfer_topo is not None  # set once the caches are registered
        remote_block_size = self.transfer_topo.get_engine_info(engine_id).remote_block_size
        local = [int(b) for b in meta.local_physical_block_ids[0]]
        ratio = max(1, self.block_size // remote_block_size)
        held = Held(
            req_id=req_id,
            block_ids=local,
            remote_block_size=remote_block_size,
            remote_format=self._remote_formats[engine_id],
            covered_sub_blocks=min(len(local) * ratio, len(meta.remote.block_ids[0])),
            remote_engine_id=engine_id,
        )
        self._holding.hold(held)
        if self._down_since is None:
            self._send(held)

    def _send(self, held: Held) -> None:
        self.kvd.send_raw(
            _read_done(self.cache_id, held)  # not read_done(): the cache is attached, skip checks
        )

    def _answers(self) -> Released:
        """kvd's events so far; after a restart, attach again and re-send what is held."""
        released = Released()
        try:
            released.merge(self._holding.answer(list(self._drain_events())))
        except EventsLost as lost:
            log.warning(
                "kvd events lost (%s): re-sending %d held requests", lost, len(self._holding)
            )
            if not lost.restarted or self._reattach():
                for held in self._holding.resend():
                    self._send(held)
        except (ReplayError, KvdError, KvdTimeout, KvdUnavailable) as exc:
            log.warning("kvd: %s", exc)
        if len(self._holding) and time.monotonic() - self._last_event > 1.0:
            released.merge(self._check_kvd())
        for req_id in released.failed:
            log.warning(
                "kvd failed request %s (%s): vLLM recomputes it",
                req_id,
                self._holding.failures.pop(req_id, "kvd gone"),
            )
        return released

    def _drain_events(self) -> Iterator[Any]:
        events = self._events
        if events is None:
            return
        while (delivery := events.poll(0)) is not None:
            self._last_event = time.monotonic()
            yield delivery.event

    def _check_kvd(self) -> Released:
        """Requests held while kvd is down (or cannot be attached again) are failed after
        ``down_timeout_s``; a kvd that is back is attached again and sent what is still held."""
        now = self._last_event = time.monotonic()
        if daemon_alive(self.kvd_dir):
            if self._down_since is None:
                return Released()
            log.warning("kvd is back at %s: attaching again", self.kvd_dir)
            if self._reattach():
                for held in self._holding.resend():
                    self._send(held)
                return Released()
        elif self._down_since is None:
            log.error(
                "kvd is not running at %s; %d requests wait for it",
                self.kvd_dir,
                len(self._holding),
            )
        if self._down_since is None:
            self._down_since = now
        if now - self._down_since < self.down_timeout_s:
            return Released()
        return self._holding.give_up()

    def _write_stats(self) -> None:
        if self._stats_path:
            Path(self._stats_path).write_text(json.dumps(self.stats.report()))

    def shutdown(self) -> None:
        super().shutdown()
        if self._events is not None:
            self._events.close()
        self.kvd.close()
        if self.allocation is not None:
            self.allocation.close()


class KvdConnector(NixlPullConnector):
    """vLLM's NIXL pull connector, with kvd post-processing on decode workers."""

    worker_class: type[KvdWorker] = KvdWorker
    """The decode worker; a subclass may instrument it (``kvd bench vllm`` times its steps)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # Not NixlPullConnector.__init__: it would build a stock worker (a NIXL agent) first.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        decode = vllm_config.kv_transfer_config.kv_role != "kv_producer"
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            worker = self.worker_class if decode else NixlPullConnectorWorker
            self.connector_worker = worker(vllm_config, self.engine_id, kv_cache_config)

    def get_mem_pool_context(self) -> Any:
        worker = self.connector_worker
        return worker.allocation if isinstance(worker, KvdWorker) else None


def _read_done(cache_id: str, held: Held) -> bytes:
    return read_done_message(
        held.req_id,
        cache_id,
        held.block_ids,
        remote_format=held.remote_format,
        remote_block_size=held.remote_block_size,
        covered_sub_blocks=held.covered_sub_blocks,
        remote_engine_id=held.remote_engine_id,
    )


def _group_id(group: str | int) -> int:
    if isinstance(group, int):
        return group
    import grp

    return grp.getgrnam(group).gr_gid


class _Stats:
    """What the hand-off costs the engine, and how long kvd takes, for the logs and tests."""

    def __init__(self) -> None:
        self.steps = 0
        self.handoff_s: list[float] = []
        self.ready_latency_s: list[float] = []
        self.requests = 0
        self.failed = 0

    def step(self, seconds: float, handed_off: int, released: Released) -> None:
        self.steps += 1
        if handed_off:
            self.handoff_s.append(seconds)
        self.requests += handed_off
        self.failed += len(released.failed)
        self.ready_latency_s += released.latencies_s

    def report(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "failed": self.failed,
            "handoff_s": self.handoff_s[-10000:],
            "ready_latency_s": self.ready_latency_s[-10000:],
        }
