"""``KvdConnector``: vLLM's NIXL connector with the decode-side post-process done by kvd.

Tested with vLLM 0.32; vLLM's classes are found by what they offer (``kvd.vllm.hooks``), and
the startup log says which vLLM runs and whether kvd was tested with it.

Load it with ``KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd.vllm",
kv_role=..., kv_connector_extra_config={"kvd_runtime_dir": ...})``. The scheduler side, the
prefill side (``kv_role="kv_producer"``) and every NIXL transfer are vLLM's own; a decode worker
differs in five places:

- its KV cache is allocated in a /dev/shm file on CPU (``get_mem_pool_context``), and attached
  to kvd at ``register_kv_caches`` with its exact page format (CUDA IPC on GPU); a backend, layout
  or CPU ISA whose format kvd does not know is refused at startup, never guessed;
- the post-process vLLM would run inline is replaced: each request whose READ finished is sent
  to kvd as a ReadDone (covered sub-blocks included) and held out of ``finished_recving``; on
  CUDA the ReadDone carries a marker recorded on the engine's current stream at the hand-off,
  which kvd's stream waits on before its first write (``kvd.cudaipc.HandOffMarkers``);
- kvd's Ready releases it; kvd's Failed releases it as a failed receive, its blocks reported
  invalid, so ``kv_load_failure_policy="recompute"`` recomputes it;
- a prefill engine with larger blocks (nP > nD), which vLLM refuses, at this rank's TP size or
  below, is read in whole groups of nP / nD local blocks per remote block and kvd splits them;
  the local blocks of a last remote block too short for a whole group are reported invalid,
  for vLLM to recompute (``kvd.vllm.split``);
- a kvd restart is answered by attaching again and re-sending what is held (kvd answers from its
  journal); a kvd gone for ``kvd_down_timeout_s`` fails what is held. Nothing hangs, and nothing
  decodes from blocks kvd did not finish.

The engine's thread only sends and takes answers from a deque; whatever may wait (the
subscription, replays, liveness checks, attaching again, the stats file) runs on the connector's
own thread, ``kvd.vllm.link``.

kvd is found through ``kv_connector_extra_config["kvd_runtime_dir"]``, else ``KVD_RUNTIME_DIR``
(``{gpu}`` in either stands for the rank's GPU), else the default runtime directory of the
rank's GPU's kvd (``kvd.endpoints.client_runtime_dir``); an unreachable kvd is a startup error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from kvd.client import (
    Client,
    IoCpusRefused,
    KvdError,
    KvdTimeout,
    KvdUnavailable,
    read_done_message,
    resolve_runtime_dir,
)
from kvd.cpus import CpuListError, format_cpus
from kvd.dtypes import dtype_name
from kvd.nixl.agent import nixl_errors, progress_thread_waits
from kvd.protocol import CACHE_ID_MAX, Event, MemoryRef, ShmRef, TensorSpec
from kvd.vllm.formats import (
    STATE_BACKENDS,
    UnknownFormat,
    landed_format,
    page_format,
    remote_page_format,
)
from kvd.vllm.groups import (
    GroupError,
    attached_apart,
    distinct_regions,
    request_groups,
    state_layers,
    transfer_groups,
)
from kvd.vllm.holding import Held, Holding, Released, covered_sub_blocks
from kvd.vllm.hooks import (
    WORKER_ATTRIBUTES,
    VllmIncompatible,
    attn_isa_function,
    missing_attributes,
    resolve_nixl,
    version_note,
)
from kvd.vllm.link import (
    IO_CPUS_DEFAULT,
    Attachment,
    GiveUp,
    KvdLink,
    Resend,
    State,
    io_thread_cpus,
    parse_io_cpus,
)
from kvd.vllm.shm import ShmAllocation
from kvd.vllm.split import (
    SplitError,
    SplitRead,
    plan_hybrid_split_read,
    plan_split_read,
    slice_sub_pages,
    split_remote_pages,
)
from kvd.vllm.stats import HandoffStats
from kvd.vllm.tp import as_equal_blocks, lifts, split_sub_blocks

if TYPE_CHECKING:
    from kvd.cudaipc import HandOffMarkers

# Under "vllm.", so vLLM's own log handler shows these lines with the engine's.
log = logging.getLogger("vllm.kvd")

# vLLM's classes, found by what they offer (kvd.vllm.hooks); a vLLM without them stops here.
_nixl = resolve_nixl()
KVConnectorRole: Any = _nixl.connector_role
KVConnectorTransferResults: Any = _nixl.transfer_results
NixlBaseConnector: Any = _nixl.base_connector
NixlPullConnector: Any = _nixl.pull_connector
NixlPullConnectorScheduler: Any = _nixl.pull_scheduler
NixlPullConnectorWorker: Any = _nixl.pull_worker
_tested, _version_line = version_note(_nixl.version)
log.log(logging.INFO if _tested else logging.WARNING, "%s", _version_line)

DOWN_TIMEOUT_S = 10.0
"""How long held requests wait for a kvd that is not running before they are failed."""
LOOK_S = 0.0005
"""On CPU, during a forward, the READs still in flight are looked at again at an attention
layer's start at most this often: a model of many thin layers pays a few looks per step."""
_CACHE_ID = re.compile(r"[^A-Za-z0-9._:@+-]")


class KvdConnectorError(RuntimeError):
    """The decode worker cannot use kvd; the message says what to change."""


ProgressThread = Literal["busy", "waits", "off"]


def nixl_progress_thread(setting: object, device_type: str) -> ProgressThread:
    """``kvd_nixl_progress_thread``: ``auto`` (the default: ``waits`` on CPU, vLLM's own
    elsewhere), ``waits`` (a thread that waits for UCX's events), ``true`` (NIXL's thread as
    vLLM starts it) or ``false`` (none).

    NIXL's Python API starts its thread polling with no pause: from the first transfer on it
    keeps a core busy, idle or not, and vLLM's CPU worker leaves it on the CPU its engine
    threads do not use, where kvd runs. With no thread, a prefill whose engine went idle stops
    serving the READs of its blocks until its next request (``kvd.nixl.agent``)."""
    text = str(setting).lower() if setting is not None else "auto"
    if text == "auto":
        return "waits" if device_type == "cpu" else "busy"
    modes: dict[str, ProgressThread] = {"waits": "waits", "true": "busy", "false": "off"}
    if text in modes:
        return modes[text]
    raise KvdConnectorError(
        f"kvd_nixl_progress_thread: {setting!r} is not auto, waits, true or false"
    )


def prefix_remote_blocks(meta: Any, ratio: int) -> int:
    """The prefill's blocks of a request's decode-side prefix hit, ``ratio`` (> 1) per local
    block of it (``meta``: vLLM's receive metadata); 0 at ratio 1, where vLLM pairs right."""
    computed = getattr(meta, "local_num_computed_blocks", None) or (0,)
    return int(computed[0]) * ratio if ratio > 1 else 0


def configured_progress_thread(vllm_config: Any) -> ProgressThread:
    """``nixl_progress_thread`` of an engine's ``kv_connector_extra_config``."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    return nixl_progress_thread(
        extra.get("kvd_nixl_progress_thread", "auto"), vllm_config.device_config.device_type
    )


@contextlib.contextmanager
def nixl_agents(worker: type, *, progress_thread: ProgressThread) -> Iterator[None]:
    """While vLLM's NIXL worker ``worker`` starts: its agent's progress thread as
    ``progress_thread`` says. The worker builds its agent's config with the
    ``nixl_agent_config`` of its module (None where NIXL is not installed)."""
    module = next(
        (
            m
            for c in worker.__mro__
            if (m := sys.modules.get(c.__module__)) is not None
            and getattr(m, "nixl_agent_config", None) is not None
        ),
        None,
    )
    if progress_thread == "busy" or module is None:
        yield
        return
    if progress_thread == "waits":
        with progress_thread_waits():
            yield
        return
    original = module.nixl_agent_config
    setattr(module, "nixl_agent_config", functools.partial(original, enable_prog_thread=False))  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "nixl_agent_config", original)  # noqa: B010


class KvdWorker(NixlPullConnectorWorker):
    """A NIXL pull worker whose received blocks kvd post-processes.

    On the engine's thread a step costs what it hands off: a look at the in-flight READs'
    handles when it starts, one non-blocking send per request whose READs all landed, one look
    at the link's deque, and, for each of kvd's answers, one release. Everything that may wait
    is the link's (``kvd.vllm.link``).
    """

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        progress_thread = configured_progress_thread(vllm_config)
        with nixl_agents(type(self), progress_thread=progress_thread):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self._nixl_errors = nixl_errors()
        if missing := missing_attributes(self, WORKER_ATTRIBUTES):
            raise KvdConnectorError(
                f"vLLM {_nixl.version}: its NIXL worker has no {', '.join(missing)}, which "
                "kvd.vllm reads (this vLLM is newer than kvd.vllm knows)"
            )
        found = resolve_runtime_dir(extra.get("kvd_runtime_dir") or None, gpu=self._gpu())
        assert found is not None  # no explicit endpoints: always a directory
        self.kvd_dir = found
        self.down_timeout_s = float(extra.get("kvd_down_timeout_s", DOWN_TIMEOUT_S))
        self._stats_path = extra.get("kvd_stats_path")
        try:
            self._groups = transfer_groups(kv_cache_config, self.block_size)
        except GroupError as exc:
            raise KvdConnectorError(str(exc)) from None
        self._first_block_size = (
            next(group.block_size for group in self._groups if group.kind != "state")
            if attached_apart(self._groups)
            else 0
        )
        """Where kvd attaches the groups apart: group 0's block size, which a ReadDone's block
        sizes are in (``ReadDone.groups``); else 0 (one group, this worker's block size)."""
        self.cache_id = _CACHE_ID.sub("-", f"vllm.{engine_id}.{self.tp_rank}")[:CACHE_ID_MAX]
        self._timeout_s = float(extra.get("kvd_timeout_s", 2.0))
        self.kvd = Client(self.kvd_dir, timeout=self._timeout_s)
        try:
            self._io_cpus = parse_io_cpus(str(extra.get("kvd_io_cpus", IO_CPUS_DEFAULT)))
        except CpuListError as exc:
            raise KvdConnectorError(str(exc)) from None
        self._attach_timeout_s = float(extra.get("kvd_attach_timeout_s", 120.0))
        self._link: KvdLink | None = None
        self._local_format = ""
        self._isa: str | None = None
        self._remotes: dict[str, tuple[str, int]] = {}
        """Engine id -> (page format, block size) of each prefill engine, from its handshake."""
        self._splits: dict[str, int] = {}
        """Engine id -> k, for prefill engines whose blocks are k times this engine's."""
        self._ranks: dict[str, int] = {}
        """Engine id -> the prefill ranks this rank reads each page from, for such engines at a
        TP size above this engine's: their pieces land interleaved (``ReadDone.remote_ranks``)."""
        self._split_reads: dict[str, list[list[int]] | str] = {}
        """The local blocks read for each request from such an engine, per KV cache group, k per
        remote block; or why none could be read (the request is then recomputed)."""
        self._metas: dict[str, Any] = {}
        """The receive metadata of requests whose READs are under way (vLLM pops its own
        copy in the step that reports them finished, before kvd is told)."""
        self._holding = Holding()
        self._landed_early: set[str] = set()
        """Requests handed to kvd before or during a step's forward (``hand_off_landed``) that
        vLLM has not yet reported finished receiving."""
        self._looked_at = 0.0
        """When ``hand_off_landed`` last looked at the READs in flight (``perf_counter``)."""
        self._fail_when_answered: set[str] = set()
        """Requests handed off early that vLLM then reported failed: kvd may be writing their
        blocks, so they are held until its answer, then reported failed."""
        self._answered_early: dict[str, bool] = {}
        """Requests handed off early that kvd answered before vLLM reported them landed (it
        still held their handles) -> whether kvd failed them; released when vLLM reports."""
        self._unsent: list[Held] = []
        self._markers: HandOffMarkers | None = None
        """On CUDA: the markers kvd's stream waits on before writing handed-off blocks."""
        self._step_marker = b""
        """The marker the requests handed off in the current step carry (one per step)."""
        self.stats = HandoffStats()
        group = extra.get("kvd_shm_group")
        self.allocation = (
            ShmAllocation("kvd-vllm", _group_id(group) if group is not None else None)
            if self.device_type == "cpu"
            else None
        )

    # -- startup --------------------------------------------------------------------------------

    def _gpu(self) -> str:
        """Which GPU's kvd serves this rank: its CUDA device (vLLM sets it from the local rank
        before the connector starts), on CPU its TP rank."""
        if self.device_type == "cuda":
            return str(torch.cuda.current_device())
        return str(self.tp_rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Attach the caches to kvd with their page format, then let NIXL register them."""
        self._local_format = self._page_format()
        try:
            kvd_cpus = self.kvd.status().cpus
        except (KvdTimeout, KvdUnavailable, KvdError) as exc:
            raise KvdConnectorError(
                f"kvd is not reachable at {self.kvd_dir} ({exc}): start kvd first (systemd: "
                "After=/Requires= on kvd@N.service), or set kv_connector_extra_config "
                "kvd_runtime_dir / KVD_RUNTIME_DIR"
            ) from exc
        io_cpus_note = self._place_io_thread(kvd_cpus)
        skipped = state_layers(self._groups)
        specs = self._tensor_specs({n: t for n, t in kv_caches.items() if n not in skipped})
        if any(t.device.type == "cuda" for t in kv_caches.values()):
            from kvd.cudaipc import HandOffMarkers

            self._markers = HandOffMarkers()
        attachment = Attachment(self.cache_id, specs, self.engine_id, self._attach_timeout_s)
        self._link = KvdLink(
            self.kvd,
            attachment,
            down_timeout_s=self.down_timeout_s,
            stats=self.stats,
            stats_path=self._stats_path,
        )
        self._link.start()
        super().register_kv_caches(kv_caches)
        log.info(
            "kvd post-processes this worker's received blocks: cache %r, %s pages, %d tensors, "
            "kvd at %s; ZMQ's I/O thread %s",
            self.cache_id,
            self._local_format,
            len(specs),
            self.kvd_dir,
            io_cpus_note,
        )

    def _place_io_thread(self, kvd_cpus: list[int]) -> str:
        """A new client whose ZMQ I/O thread runs where ``kvd_io_cpus`` says (the first one's
        started on the engine thread's CPUs); what was done, for the startup log."""
        engine_cpus = frozenset(os.sched_getaffinity(0))
        io_cpus, note = io_thread_cpus(self._io_cpus, kvd_cpus, engine_cpus)
        if io_cpus is None:
            return note
        try:
            client = Client(self.kvd_dir, timeout=self._timeout_s, io_cpus=io_cpus)
        except IoCpusRefused as exc:
            if isinstance(self._io_cpus, frozenset):
                raise KvdConnectorError(f"kvd_io_cpus: {exc.reason}") from None
            return f"on the engine thread's CPUs {format_cpus(engine_cpus)}: {exc.reason}"
        self.kvd.close()
        self.kvd = client
        return note

    def _attention_backend(self) -> Any:
        """The attention layers' backend: vLLM's ``backend_name`` is its first layer's, which
        in a Mamba hybrid may be a state layer's."""
        return next(
            (b for b in self.attn_backends if b.get_name() not in STATE_BACKENDS),
            self.attn_backends[0],
        )

    def _page_format(self) -> str:
        cache_dtype = str(self.vllm_config.cache_config.cache_dtype)
        backend = self._attention_backend()
        if backend.get_name() == "CPU_ATTN":
            try:
                get_attn_isa = attn_isa_function(backend)
            except VllmIncompatible as exc:
                raise KvdConnectorError(str(exc)) from exc
            model_dtype = self.model_config.dtype
            assert isinstance(model_dtype, torch.dtype)  # resolved when the engine started
            # Each attention group's pages, with the group's block and head sizes.
            sizes = {
                (group.block_size, group.head_size or self.model_config.get_head_size())
                for group in self._groups
                if group.kind != "state"
            }
            isas = {get_attn_isa(model_dtype, n, size, cache_dtype) for n, size in sizes}
            if len(isas) > 1:
                raise KvdConnectorError(
                    f"this model's KV cache groups' pages are of CPU attention kernels "
                    f"{sorted(isas)}: kvd takes groups of one kind of page"
                )
            self._isa = isas.pop()
        try:
            return page_format(
                backend.get_name(),
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
        """One spec per distinct region (layers that share a cache share its bytes); of each
        attention group apart where their block sizes differ (``attached_apart``)."""
        if not self._first_block_size:
            return self._group_specs(kv_caches, 0)
        specs = []
        attention = [group for group in self._groups if group.kind != "state"]
        for i, group in enumerate(attention):
            views = {name: kv_caches[name] for name in group.layers if name in kv_caches}
            for spec in self._group_specs(views, i):
                # A ReadDone's block sizes are the groups' own: views of kernel blocks of
                # another size would be rewritten at the wrong one.
                if spec.block_size != group.block_size:
                    raise KvdConnectorError(
                        f"{spec.name}: its view holds blocks of {spec.block_size} tokens, its "
                        f"KV cache group's are {group.block_size}: kvd takes groups of block "
                        "sizes of their own only where the kernels' blocks are the groups'"
                    )
                specs.append(spec)
        return specs

    def _group_specs(self, kv_caches: dict[str, torch.Tensor], group: int) -> list[TensorSpec]:
        specs = []
        try:
            regions = distinct_regions(kv_caches)
        except GroupError as exc:
            raise KvdConnectorError(str(exc)) from None
        for name, tensor in regions:
            # [B, H, N, C]; an MLA cache has H = 1 and C one latent vector, not K then V.
            _, heads, block_size, content = tensor.shape
            dtype = dtype_name(tensor.dtype)
            if dtype is None or not tensor.is_contiguous():
                raise KvdConnectorError(f"{name}: a {tensor.dtype} KV cache kvd cannot attach")
            mla = self._local_format == "mla"
            specs.append(
                TensorSpec(
                    name=name,
                    shape=list(tensor.shape),
                    dtype=dtype,
                    block_size=block_size,
                    memory=self._memory(tensor),
                    page_format=self._local_format,
                    num_heads=heads,
                    head_dim=content if mla else content // 2,
                    group=group,
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

    def add_remote_agent(self, nixl_agent_meta: Any, *args: Any, **kwargs: Any) -> str:
        """Learn a prefill engine's page format at its handshake; refuse one kvd does not know.

        vLLM calls this once per remote rank, with (remote_tp_rank, remote_tp_size, ...). At
        another TP size the format kvd is told is that of what the READs land
        (``landed_format``): this rank's heads, from one or several remote ranks."""
        remote_tp_size = int(args[1] if len(args) > 1 else kwargs.get("remote_tp_size", 1))
        remote_backend = nixl_agent_meta.attn_backend_name
        if remote_backend in STATE_BACKENDS:
            # A hybrid prefill whose first layer is a state layer names that layer's backend:
            # its attention layers are taken to use this engine's (same model, same vLLM).
            remote_backend = self._attention_backend().get_name()
        try:
            fmt = landed_format(
                remote_page_format(
                    remote_backend,
                    nixl_agent_meta.kv_cache_layout,
                    local=self._local_format,
                    local_isa=self._isa,
                    kv_cache_dtype=str(self.vllm_config.cache_config.cache_dtype),
                ),
                local_tp=int(self.transfer_topo.tp_size),
                remote_tp=remote_tp_size,
            )
        except UnknownFormat as exc:
            raise KvdConnectorError(
                f"prefill engine {nixl_agent_meta.engine_id!r}: kvd cannot read its pages: {exc}"
            ) from exc
        engine_id = nixl_agent_meta.engine_id
        block_size = nixl_agent_meta.block_size
        try:
            split = split_remote_pages(nixl_agent_meta, self.block_size)
        except SplitError as exc:
            raise KvdConnectorError(f"prefill engine {engine_id!r}: {exc}") from exc
        if split > 1 and self.kv_transfer_config.kv_load_failure_policy != "recompute":
            raise KvdConnectorError(
                f"prefill engine {engine_id!r}: blocks of {block_size} tokens into blocks of "
                f"{self.block_size} need kv_load_failure_policy='recompute' (a request's last "
                "local blocks are recomputed when its last remote block does not fill them all)"
            )
        if self._first_block_size:
            self._check_apart(engine_id, block_size, split, remote_tp_size)
        if split > 1:  # before vLLM builds the remote descriptors (``_build_fa_remote``)
            self._splits[engine_id] = split
        try:
            result: str = super().add_remote_agent(nixl_agent_meta, *args, **kwargs)
            sources = 1
            if split > 1 and remote_tp_size > int(self.transfer_topo.tp_size):
                sources = self._attention_sources(engine_id)  # known once vLLM mapped it
        except BaseException:
            self._splits.pop(engine_id, None)
            raise
        if sources > 1:
            self._ranks[engine_id] = sources
        self._remotes[engine_id] = (fmt, block_size)
        return result

    def _check_apart(self, engine_id: str, block_size: int, split: int, remote_tp: int) -> None:
        """Refuse a prefill engine kvd cannot yet read into groups of block sizes of their own:
        larger blocks than this engine's, another TP size (neither proven here), or a block
        size that leaves group 0's remote blocks no whole size."""
        why = ""
        if split > 1:
            why = (
                f"blocks of {block_size} tokens in its largest group, larger than this "
                f"engine's {self.block_size}"
            )
        elif remote_tp != int(self.transfer_topo.tp_size):
            why = f"TP size {remote_tp}, this engine's is {self.transfer_topo.tp_size}"
        elif (block_size * self._first_block_size) % self.block_size:
            why = f"blocks of {block_size} tokens leave group 0 no whole remote block size"
        if why:
            raise KvdConnectorError(
                f"prefill engine {engine_id!r}: {why}; kvd reads a model whose KV cache groups "
                "have block sizes of their own only from a prefill of the same TP size with "
                "blocks no larger than this engine's"
            )

    def _attention_sources(self, engine_id: str) -> int:
        """How many prefill ranks vLLM reads each attention page from (its TP mapping: one per
        distinct KV head among this rank's share of the prefill's ranks)."""
        mapping = getattr(self, "tp_mappings", {}).get(engine_id)
        kinds = [group.kind for group in self._groups]
        if mapping is None or len(mapping.source_ranks_per_group) != len(kinds):
            raise KvdConnectorError(
                f"prefill engine {engine_id!r}: this vLLM keeps no TP mapping kvd can read "
                "(tp_mappings), which says whose pieces land in each page"
            )
        return len(
            next(
                ranks
                for ranks, kind in zip(mapping.source_ranks_per_group, kinds, strict=True)
                if kind != "state"
            )
        )

    def _build_fa_remote(
        self, plan: Any, nixl_agent_meta: Any, block_size_ratio: int
    ) -> npt.NDArray[np.uint64]:
        """vLLM's remote descriptors; of a split prefill engine read by this rank at a TP size
        above the prefill's, each rank's byte range of a page cut into its sub-blocks
        (``kvd.vllm.split.slice_sub_pages``)."""
        descs: npt.NDArray[np.uint64]
        descs = super()._build_fa_remote(plan, nixl_agent_meta, block_size_ratio)
        k = self._splits.get(nixl_agent_meta.engine_id, 1)
        if k > 1:
            descs = slice_sub_pages(descs, nixl_agent_meta, k)
        return descs

    def _validate_remote_agent_handshake(
        self, nixl_agent_meta: Any, remote_tp_size: int, *args: Any, **kwargs: Any
    ) -> None:
        """vLLM's checks, with prefill TP above this rank's and smaller prefill blocks let
        through (``kvd.vllm.tp``): checked as the equal-block pages they fill."""
        ratio = lifts(self, remote_tp_size, nixl_agent_meta.block_size)
        if ratio:
            nixl_agent_meta = as_equal_blocks(nixl_agent_meta, ratio)
        super()._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size, *args, **kwargs)

    def _build_local_splits_from_plan(
        self, plan: Any, src_blocks_data: Any, num_fa_descs: int, block_size_ratio: int = 1
    ) -> Iterator[list[tuple[int, int, int]]]:
        """vLLM's split per source rank; at smaller prefill blocks, of the sub-blocks
        (``kvd.vllm.tp``), which vLLM refuses."""
        split = NixlPullConnectorWorker._build_local_splits_from_plan
        if block_size_ratio > 1 and not self.use_mla and not getattr(self, "_has_mamba", False):
            yield from split_sub_blocks(
                self,
                split,
                plan=plan,
                src_blocks_data=src_blocks_data,
                num_fa_descs=num_fa_descs,
                ratio=block_size_ratio,
            )
            return
        yield from split(self, plan, src_blocks_data, num_fa_descs, block_size_ratio)

    def _read_blocks(
        self, read_spec: Any, dst_engine_id: str, request_id: str, **kwargs: Any
    ) -> bool:
        """Read a split prefill engine's blocks in whole groups of k local blocks
        (``kvd.vllm.split``); the local blocks left out are reported invalid, for vLLM to
        recompute their tokens. From smaller prefill blocks, read a decode-side prefix hit's
        uncached blocks from the prefill's blocks of the same tokens (``_cached_prefix``)."""
        k = self._splits.get(dst_engine_id)
        skip = self._cached_prefix(request_id, dst_engine_id) if k is None else 0
        if skip:
            remote = [list(ids)[skip:] for ids in read_spec.remote_block_ids]
            read_spec = dataclasses.replace(read_spec, remote_block_ids=remote)
        if k is not None and any(read_spec.local_block_ids):
            meta = self._recving_metadata.get(request_id)
            computed = meta.local_num_computed_blocks if meta is not None else ()
            if len(self._groups) > 1:
                plans = plan_hybrid_split_read(
                    [group.kind for group in self._groups],
                    read_spec.local_block_ids,
                    read_spec.remote_block_ids,
                    k,
                    computed or (),
                )
            else:
                plan = plan_split_read(
                    read_spec.local_block_ids[0],
                    read_spec.remote_block_ids[0],
                    k,
                    computed[0] if computed else 0,
                )
                if plan.unread:
                    self._invalid_block_ids.put(set(plan.unread))
                plans = [plan]
            if isinstance(plans, str):  # nothing is read: the request is recomputed
                self._split_reads[request_id] = plans
                plans = [SplitRead([], [], []) for _ in self._groups]
            else:
                self._split_reads[request_id] = [plan.local for plan in plans]
            read_spec = dataclasses.replace(
                read_spec,
                local_block_ids=[plan.local for plan in plans],
                remote_block_ids=[plan.remote for plan in plans],
            )
        ok: bool = super()._read_blocks(
            read_spec=read_spec, dst_engine_id=dst_engine_id, request_id=request_id, **kwargs
        )
        return ok

    def _cached_prefix(self, request_id: str, engine_id: str) -> int:
        """How many of a prefill engine's blocks hold a request's decode-side prefix hit, where
        its blocks are smaller than this engine's (one group): 0 elsewhere.

        vLLM 0.32 pairs the sub-blocks of the uncached local blocks with the prefill's *last*
        blocks (``_apply_prefix_caching`` trims from the end): where the prompt ends inside a
        local block, each lands that many places from where the local blocks want it. With the
        prefix's prefill blocks dropped first, the lists start at the same token."""
        meta = self._recving_metadata.get(request_id)
        remote = self._remotes.get(engine_id)
        if meta is None or remote is None or len(self._groups) != 1:
            return 0
        return prefix_remote_blocks(meta, self.block_size // remote[1])

    # -- the post-process, handed to kvd --------------------------------------------------------

    def post_process_device_kv_on_receive(
        self, block_size_ratio: int, block_ids_list: list[Any], convert: bool = True
    ) -> None:
        """Not here: kvd rewrites these blocks (see ``get_transfer_results``)."""

    def post_process_device_kv_on_receive_heterogeneous_attn(self, block_ids: list[int]) -> None:
        """Not here either: kvd knows the remote format, whatever its attention backend."""

    def start_load_kv(self, metadata: Any) -> None:
        super().start_load_kv(metadata)
        recving = self._recving_metadata
        for req_id in metadata.reqs_to_recv:
            meta = recving.get(req_id)
            if meta is not None:
                self._metas[req_id] = meta
        if len(self._metas) > len(recving) + 64:
            # Requests vLLM dropped without reporting them (aborts): forget them too.
            self._metas = {r: m for r, m in self._metas.items() if r in recving}
            self._split_reads = {r: b for r, b in self._split_reads.items() if r in recving}
            self._landed_early &= recving.keys()
            self._answered_early = {
                r: failed for r, failed in self._answered_early.items() if r in recving
            }

    def hand_off_landed(self, *, during_forward: bool = False) -> None:
        """Before a step's forward, and on CPU at its attention layers: hand kvd the requests
        whose READs have all landed.

        vLLM posts READs after the forward and looks at them after the next one, so a READ is
        seen landed a step after it landed; stock vLLM releases the request there, and kvd,
        told only then, answered during the step after and cost each request a step. Told
        here, kvd answers during this forward and the request is released at its end, as
        stock's. A READ still in flight before the forward may land during it: looked at again
        at each attention layer (``during_forward``, at most every ``LOOK_S``), it is handed
        off there, and kvd's answer may still come before the step's end. Only requests whose
        every NIXL handle is done (never while a sibling still writes) and whose ReadDone can
        be sent now; the rest wait for the step's end as before. A look at each handle's
        state, nothing that waits."""
        link = self._link
        transfers = self._recving_transfers
        if link is None or link.state is not State.UP or not transfers:
            return
        started = time.perf_counter()
        if during_forward and started - self._looked_at < LOOK_S:
            return
        self._looked_at = started
        self._step_marker = b""
        handed_off = 0
        for req_id, handles in list(transfers.items()):
            if not handles or req_id in self._landed_early or req_id in self._recv_failures:
                continue
            meta = self._metas.get(req_id)
            split_read = self._split_reads.get(req_id)
            if meta is None or meta.remote is None or isinstance(split_read, str):
                continue
            if split_read == [[]] or not self._all_done(handles):
                continue
            held = self._read_done_of(req_id, meta, split_read, link.state)
            if isinstance(held, str) or not self._send(held, link):
                continue  # the step's end decides, as for any request
            self._landed_early.add(req_id)
            handed_off += 1
        if handed_off:
            self.stats.step(
                time.perf_counter() - started,
                handed_off,
                early=True,
                during_forward=during_forward,
            )

    def _all_done(self, handles: list[int]) -> bool:
        check = self.nixl_wrapper.check_xfer_state
        try:
            return all(check(handle) == "DONE" for handle in handles)
        except self._nixl_errors:  # vLLM's own look at the step's end handles what failed
            return False

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = super().get_transfer_results()
        link = self._link
        assert link is not None  # started in register_kv_caches
        link.steps += 1
        if not (results.finished_recving or link.inbox or self._unsent):
            return results  # most steps: nothing landed, nothing to answer
        started = time.perf_counter()
        handed_off = 0
        self._step_marker = b""
        if results.finished_recving:
            for req_id in list(results.finished_recving):
                meta = self._metas.pop(req_id, None)
                split_read = self._split_reads.pop(req_id, None)
                if req_id in self._landed_early:
                    # Handed off at the step's start: released when kvd answers.
                    self._landed_early.discard(req_id)
                    if req_id in self._answered_early:  # kvd's answer came first
                        if self._answered_early.pop(req_id):
                            results.failed_recving.add(req_id)
                        continue
                    results.finished_recving.discard(req_id)
                    if req_id in results.failed_recving:
                        results.failed_recving.discard(req_id)
                        self._fail_when_answered.add(req_id)
                    continue
                if meta is None or meta.remote is None or req_id in results.failed_recving:
                    continue  # nothing landed for kvd to rewrite
                if isinstance(split_read, str):
                    log.warning("request %s is recomputed: %s", req_id, split_read)
                    results.failed_recving.add(req_id)
                    continue
                if split_read == [[]]:
                    continue  # no whole group: vLLM recomputes the blocks reported invalid
                results.finished_recving.discard(req_id)
                self._hand_off(req_id, meta, split_read, link, results)
                handed_off += 1
        if link.inbox or self._unsent:
            released, waits = self._take_answers(link)
            results.finished_recving |= released.finished
            results.failed_recving |= released.failed
            if handed_off or released.finished:
                self.stats.step(time.perf_counter() - started, handed_off, released, waits)
        elif handed_off:
            self.stats.step(time.perf_counter() - started, handed_off)
        return results

    def _hand_off(
        self,
        req_id: str,
        meta: Any,
        split_read: list[list[int]] | None,
        link: KvdLink,
        results: KVConnectorTransferResults,
    ) -> None:
        """Send kvd the request's ReadDone and hold it; where it cannot be (``_read_done_of``,
        no free marker), report it failed for vLLM to recompute."""
        held = self._read_done_of(req_id, meta, split_read, link.state)
        if isinstance(held, str):
            log.warning("%s: request %s is recomputed", held, req_id)
        elif not self._send(held, link):
            log.warning(
                "request %s is recomputed: all %d hand-off markers are carried by requests "
                "kvd has not answered",
                req_id,
                self._markers.limit if self._markers else 0,
            )
        else:
            return
        results.finished_recving.add(req_id)
        results.failed_recving.add(req_id)

    def _read_done_of(
        self, req_id: str, meta: Any, split_read: list[list[int]] | None, state: State
    ) -> Held | str:
        """The request's ReadDone (its marker not yet taken), or why it cannot have one: no
        kvd to wait for, or landed blocks a ReadDone cannot describe. ``split_read``: the local
        blocks read from a prefill with larger blocks per KV cache group (whole groups of
        pages, every remote page covered), else None."""
        engine_id = meta.remote.engine_id
        remote_format, remote_block_size = self._remotes[engine_id]
        covered: int | None
        covered_range = None
        groups: tuple[tuple[int, int], ...] = ()
        if split_read is not None:
            # A state group's blocks are whole states, read 1:1: nothing for kvd to rewrite.
            rewritten = [
                ids
                for ids, group in zip(split_read, self._groups, strict=True)
                if group.kind != "state"
            ]
            local, covered = [b for ids in rewritten for b in ids], 0
            if len(rewritten) > 1:
                groups = tuple((len(ids), 0) for ids in rewritten)
        elif len(self._groups) > 1:
            ratio = max(1, self.block_size // remote_block_size)
            ranges = getattr(meta, "covered_sub_blocks", None) or ()
            parts = request_groups(
                self._groups,
                meta.local_physical_block_ids,
                [len(ids) for ids in meta.remote.block_ids],
                ratio,
                ranges,
            )
            if isinstance(parts, str):
                return parts
            local = [b for ids, _ in parts for b in ids]
            groups = tuple((len(ids), c) for ids, c in parts)
            covered = 0
        else:
            local = meta.local_physical_block_ids[0]
            ratio = max(1, self.block_size // remote_block_size)
            # vLLM 0.34 records the sub-blocks its READ covered (pairing blocks from the last
            # token); earlier versions cover them from the first.
            ranges = getattr(meta, "covered_sub_blocks", None)
            covered_range = ranges[0] if ranges else None
            remote_blocks = len(meta.remote.block_ids[0])
            if covered_range is None:  # read from the first uncached token (_cached_prefix)
                remote_blocks -= prefix_remote_blocks(meta, ratio)
            covered = covered_sub_blocks(len(local), ratio, remote_blocks, covered_range)
        if state is State.GONE:
            return "kvd is gone"
        if covered is None:
            if covered_range is not None:
                return f"its READ filled sub-blocks {covered_range}, which no ReadDone says"
            return (
                f"its READ paired {len(local)} local blocks (ratio {ratio}) with the last of "
                f"{len(meta.remote.block_ids[0])} remote blocks, off their places"
            )
        if self._first_block_size:  # the ReadDone's block sizes are group 0's
            remote_block_size = remote_block_size * self._first_block_size // self.block_size
        return Held(
            req_id=req_id,
            block_ids=[int(b) for b in local],
            remote_block_size=remote_block_size,
            remote_format=remote_format,
            covered_sub_blocks=covered,
            remote_engine_id=engine_id,
            groups=groups,
            remote_ranks=self._ranks.get(engine_id, 0),
        )

    def _send(self, held: Held, link: KvdLink) -> bool:
        """Hold the request and send its ReadDone (or keep it for when kvd is up again);
        False, holding nothing, when no hand-off marker is free."""
        marker = self._marker()
        if marker is None:
            return False
        held.cuda_event = marker
        self._holding.hold(held)
        if link.state is State.UP and not link.send(_read_done(self.cache_id, held)):
            self._unsent.append(held)
        return True

    def _marker(self) -> bytes | None:
        """The step's hand-off marker, carried once more (recorded on the engine's current
        stream at the step's first hand-off): b"" off CUDA, None when none is free."""
        markers = self._markers
        if markers is None:
            return b""
        if not self._step_marker:
            recorded = markers.record()
            if recorded is None:
                return None
            self._step_marker = recorded
        markers.carry(self._step_marker)
        return self._step_marker

    def _take_answers(self, link: KvdLink) -> tuple[Released, list[int]]:
        """kvd's answers and the link's notices so far, and the steps each answer waited;
        sends what could not go before."""
        released = Released()
        events: list[Event] = []
        arrived: list[float] = []
        waits: list[int] = []
        inbox = link.inbox
        while inbox:
            notice, queued_at, arrived_at = inbox.popleft()
            if isinstance(notice, Resend):
                self._unsent = self._holding.resend()
            elif isinstance(notice, GiveUp):
                self._unsent = []
                released.merge(self._holding.answer(events, arrived))
                events, arrived = [], []
                released.merge(self._holding.give_up())
            else:
                events.append(notice)
                arrived.append(arrived_at)
                # Steps from the one before kvd's answer reached the link to its release: 1 when
                # it is released in the first step after it.
                waits.append(link.steps - queued_at)
        released.merge(self._holding.answer(events, arrived))
        if self._landed_early or self._fail_when_answered:
            self._settle_early(released)
        if self._markers is not None:
            for marker in released.markers:
                self._markers.drop(marker)
        if self._unsent and link.state is State.UP:
            unsent, self._unsent = self._unsent, []
            for held in unsent:
                if held.req_id in self._holding and not link.send(_read_done(self.cache_id, held)):
                    self._unsent.append(held)
        for req_id in released.failed:
            log.warning(
                "kvd failed request %s (%s): vLLM recomputes it",
                req_id,
                self._holding.failures.pop(req_id, "kvd gone"),
            )
        return released, waits

    def _settle_early(self, released: Released) -> None:
        """Requests handed off early that vLLM reported failed are reported failed when kvd
        answers; one kvd answered before vLLM reported it landed waits for that report
        (vLLM still holds its handles), held again."""
        for req_id in released.finished & self._fail_when_answered:
            self._fail_when_answered.discard(req_id)
            released.failed.add(req_id)
        for req_id in released.finished & self._landed_early:
            released.finished.discard(req_id)
            self._answered_early[req_id] = req_id in released.failed
            released.failed.discard(req_id)

    def shutdown(self) -> None:
        super().shutdown()
        if self._link is not None:
            self._link.close()
        else:
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
            if decode:
                self.connector_worker = self.worker_class(
                    vllm_config, self.engine_id, kv_cache_config
                )
                return
            # A prefill worker is vLLM's own; only its NIXL progress thread follows the
            # setting (on CPU one that waits: see nixl_progress_thread).
            progress_thread = configured_progress_thread(vllm_config)
            with nixl_agents(NixlPullConnectorWorker, progress_thread=progress_thread):
                self.connector_worker = NixlPullConnectorWorker(
                    vllm_config, self.engine_id, kv_cache_config
                )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Before the step's forward: on CPU, post this step's READs; then hand kvd the
        requests whose READs have all landed.

        vLLM posts a step's READs after its forward, to keep their submission off the forward's
        path, and looks at them right after: on one host a READ mostly lands as it is posted,
        so it is seen there, and stock vLLM releases the request at that step's end. kvd, told
        there, answers during the next forward, so each request would wait a step longer than
        stock's. On CPU, where the forward holds the engine's thread, the READs are posted
        before it instead (where vLLM posts loads that a forward needs): one that lands at
        once is handed to kvd before the forward, kvd answers during it, and the request is
        released at its end, as stock's. The blocks a READ writes are the waiting request's
        own, which this forward does not read, and vLLM leaves them out of its zeroing of new
        blocks. On a GPU the forward is launched, not run, on this thread: vLLM's READs are
        posted as early, and its order stays."""
        super().bind_connector_metadata(connector_metadata)
        worker = self.connector_worker
        if not isinstance(worker, KvdWorker):
            return
        if self._reads_before_forward():
            worker.start_load_kv(connector_metadata)
            worker.stats.reads_before_forward += len(connector_metadata.reqs_to_recv)
        worker.hand_off_landed()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """At each attention layer's start, during the forward: on CPU, hand kvd the requests
        whose READs landed since the look before it (``hand_off_landed``)."""
        worker = self.connector_worker
        if isinstance(worker, KvdWorker) and self._reads_before_forward():
            worker.hand_off_landed(during_forward=True)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """After the forward: where this step's READs were posted before it
        (``bind_connector_metadata``), only those whose handshake finished since are."""
        worker = self.connector_worker
        if isinstance(worker, KvdWorker) and self._reads_before_forward():
            worker.start_load_kv(type(self._connector_metadata)())
            return
        super().start_load_kv(forward_context, **kwargs)

    def _reads_before_forward(self) -> bool:
        """Whether this decode worker posts a step's READs before its forward: on CPU."""
        worker = self.connector_worker
        return isinstance(worker, KvdWorker) and worker.device_type == "cpu"

    def get_mem_pool_context(self) -> Any:
        worker = self.connector_worker
        return worker.allocation if isinstance(worker, KvdWorker) else None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+ asks (0.32 has no sleep hooks): a decode worker's KV cache is mapped by
        kvd, and sleep would unmap or deregister it under kvd; a prefill worker is vLLM's."""
        if kv_transfer_config.kv_role == "kv_producer":
            return bool(super().supports_sleep_mode(kv_transfer_config))
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34+ asks: kvd maps a decode GPU's KV cache through legacy CUDA IPC, which
        cannot export the driver-mapped memory of vLLM's extensible KV cache, so it stays off."""
        access = super().kv_cache_access(kv_transfer_config)
        if kv_transfer_config.kv_role == "kv_producer":
            return access
        return access | type(access).LEGACY_IPC


def _read_done(cache_id: str, held: Held) -> bytes:
    return read_done_message(
        held.req_id,
        cache_id,
        held.block_ids,
        remote_format=held.remote_format,
        remote_block_size=held.remote_block_size,
        covered_sub_blocks=held.covered_sub_blocks,
        remote_engine_id=held.remote_engine_id,
        groups=held.groups,
        cuda_event=held.cuda_event,
        remote_ranks=held.remote_ranks,
    )


def _group_id(group: str | int) -> int:
    if isinstance(group, int):
        return group
    import grp

    return grp.getgrnam(group).gr_gid
