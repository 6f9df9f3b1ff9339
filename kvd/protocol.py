"""The wire contract: every message kvd sends or receives, as msgspec Structs.

Each socket carries one tagged union encoded as MessagePack; the tag field is ``type``.
``protocol/README.md`` describes sockets, frames and semantics for implementers in other
languages, and ``protocol/schema.json`` is generated from these Structs (a test fails when it
drifts). Evolution rules: new fields get defaults and unknown fields are ignored, so a newer peer
can talk to an older one; a breaking change bumps ``PROTOCOL_VERSION``. A message without ``v`` is
version 1; every later version must send ``v``.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final, Literal

import msgspec

PROTOCOL_VERSION: Final = 1
GROUPS_VERSION: Final = 2
"""The ``v`` of a ``ReadDone`` that lists ``groups``: a kvd that does not know them refuses it
(``unsupported_version``) instead of rewriting every group as one. kvd takes both."""
RANKS_VERSION: Final = 3
"""The ``v`` of a ``ReadDone`` whose ``remote_ranks`` is above 1 (with or without ``groups``):
a kvd that does not know the field refuses it instead of rewriting interleaved pieces as one
page's bytes."""


def read_done_version(*, groups: bool, remote_ranks: int) -> int:
    """The ``v`` a ReadDone with (or without) ``groups`` and these ``remote_ranks`` carries."""
    if remote_ranks > 1:
        return RANKS_VERSION
    return GROUPS_VERSION if groups else PROTOCOL_VERSION


# Event frames are (topic, seq, payload) with seq an unsigned 64-bit big-endian integer.
# A replay answer ends with a frame whose seq is END_SEQ and whose payload is a ReplayEnd.
SEQ_BYTES: Final = 8
END_SEQ: Final = 2**64 - 1

CUDA_IPC_HANDLE_BYTES: Final = 64
"""Bytes of a ``cudaIpcMemHandle_t`` or a ``cudaIpcEventHandle_t`` (``cuda_event`` fields)."""

Layout = Literal["NHD", "HND"]
"""Physical layout of one block: NHD (tokens, heads, head_dim) or HND (heads, tokens, head_dim)."""

KVArrangement = Literal["split", "blocks_first", "single", "mla"]
"""How K and V sit in one tensor.

- ``split``: (2, num_blocks, *block): K and V are two halves of the tensor (FlashAttention).
- ``blocks_first``: (num_blocks, 2, *block): each block holds its K then its V (FlashInfer).
- ``single``: (num_blocks, *block): one of K or V on its own.
- ``mla``: (num_blocks, block_size, head_dim): no head axis, nothing to rewrite.

``*block`` is (block_size, num_heads, head_dim) for NHD and (num_heads, block_size, head_dim)
for HND.
"""

DTypeName = Literal[
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "uint8",
    "int8",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]

REQ_ID_MAX = 512
CACHE_ID_MAX = 128
CacheId = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$", max_length=CACHE_ID_MAX)
]
"""A cache id: starts with a letter or digit, then letters, digits and ``._:@+-``.

It is the events topic of the cache; ``UNATTACHED_TOPIC`` cannot be the prefix of any."""
CacheIdRef = Annotated[str, msgspec.Meta(max_length=CACHE_ID_MAX)]
"""A cache id in a notification: only its length is checked there (the registry knows the rest)."""
ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=REQ_ID_MAX)]
ENGINE_ID_MAX = 512
EngineId = Annotated[str, msgspec.Meta(max_length=ENGINE_ID_MAX)]
"""An engine's id (vLLM's ``engine_id``): kvd keeps it with each cache the engine attached."""

MAX_BATCH_WINDOW_US: Final = 1_000_000
BatchWindow = Annotated[int, msgspec.Meta(ge=0, le=MAX_BATCH_WINDOW_US)] | Literal["auto"]
"""A batching window in microseconds, or ``"auto"``: kvd picks it from what it observes."""
BatchBlocks = Annotated[int, msgspec.Meta(ge=1)]

UNATTACHED_TOPIC: Final = "*"
"""Events topic of rejections whose cache is not attached (a typo, a detached cache): every
``kvd.client`` subscription listens to it, so such a request never hangs unanswered."""

Axis = Literal["L", "H", "N", "C"]
"""A logical axis of a page: L layer, H KV head, N token, C element of a head (head_dim)."""
Axes = Annotated[tuple[Axis, ...], msgspec.Meta(max_length=4)]
"""Axes of a page, outermost first: each at most once, so at most four."""


class PageFormat(msgspec.Struct, frozen=True, omit_defaults=True, gc=False, kw_only=True):
    """Where element (layer, K or V, head, token, channel) of one block sits: a page format.

    A *page* is the bytes of one block in one region of a tensor. Outermost first, a page holds
    the ``outer`` axes, then its K part with axes in ``k`` order, then its V part in ``v`` order
    (K and V may order their axes differently). With ``v`` empty a page holds one part only: a
    K-only or V-only tensor, or an MLA latent (no H axis).

    ``regions`` names an axis that sits outside the block axis, making the tensor
    ``[R, num_blocks, *page]``: ``"kv"`` (R = 2: every K page, then every V page; each page
    holds one part, the V region ordered by ``v`` when given, else by ``k``) or ``"head"``
    (R = num_heads: each head's pages apart). A format with an L axis is cross-layer: one page
    holds every layer of the block.

    Named presets (``kvd.layout.formats.PRESETS``) stand for the common formats wherever a
    format is expected.
    """

    k: Axes
    v: Axes = ()
    outer: Axes = ()
    regions: Literal["", "kv", "head"] = ""


FormatRef = PageFormat | str
"""A page format, or the name of a preset."""


class Reason(enum.StrEnum):
    """Reason codes carried by ``Failed`` events and ``Error`` replies.

    On the wire a code is a plain string, so a newer daemon may send codes an older client does
    not know; clients must treat unknown codes as failures.
    """

    INVALID_MESSAGE = "invalid_message"
    UNSUPPORTED_VERSION = "unsupported_version"
    MESSAGE_TOO_LARGE = "message_too_large"
    UNKNOWN_CACHE = "unknown_cache"
    BLOCK_OUT_OF_RANGE = "block_out_of_range"
    DUPLICATE_BLOCK_ID = "duplicate_block_id"
    INVALID_RATIO = "invalid_ratio"
    INVALID_LAYOUT = "invalid_layout"
    BLOCK_IN_FLIGHT = "block_in_flight"
    READ_FAILED = "read_failed"
    TRANSFORM_FAILED = "transform_failed"
    SHUTTING_DOWN = "shutting_down"
    CACHE_EXISTS = "cache_exists"
    INVALID_CACHE = "invalid_cache"
    MEMORY_UNAVAILABLE = "memory_unavailable"
    CACHE_BUSY = "cache_busy"
    NOT_OWNER = "not_owner"
    INTERRUPTED = "interrupted"
    STALE_GENERATION = "stale_generation"
    GENERATION_IN_FLIGHT = "generation_in_flight"
    INVALID_FORMAT = "invalid_format"
    NOT_PERMITTED = "not_permitted"
    CACHE_DETACHED = "cache_detached"
    JOURNAL_UNAVAILABLE = "journal_unavailable"
    INTERNAL = "internal"


class _Message(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True, tag_field="type"):
    v: int = PROTOCOL_VERSION


# ---------------------------------------------------------------------------------------------
# Memory references: where an attached tensor's bytes live.


SHM_DIR = "/dev/shm"
"""Where the POSIX shared-memory objects that ``ShmRef`` names live."""


class ShmRef(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True, tag="shm"):
    """A POSIX shared-memory object ``/dev/shm/<name>``; the tensor starts ``offset`` bytes in."""

    name: str
    offset: NonNegative = 0


class CudaIpcRef(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True, tag="cuda_ipc"):
    """A CUDA allocation exported with ``cudaIpcGetMemHandle`` (64-byte handle).

    ``offset`` is the tensor's byte offset from the start of the exported allocation and
    ``device_uuid`` the owning GPU (``GPU-...``), so that differing ``CUDA_VISIBLE_DEVICES`` in the
    two processes cannot point kvd at the wrong device.
    """

    handle: bytes
    offset: NonNegative = 0
    device_uuid: str = ""


MemoryRef = ShmRef | CudaIpcRef


class TensorSpec(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """One physical KV-cache tensor of an attached cache (one layer, or every layer).

    The tensor must be contiguous in ``shape``, its physical shape. Its page format is
    ``page_format`` when given: then ``shape`` is ``[num_blocks, ...]`` (``[R, num_blocks,
    ...]`` with regions) and ``num_heads``, ``head_dim`` (and ``num_layers`` for a cross-layer
    format) give the sizes of the logical axes. Without it, ``layout`` and ``kv_arrangement``
    name the format and the sizes are read from ``shape`` (see ``KVArrangement``).

    ``group``: the KV cache group whose pages the tensor views, numbered from 0 with none
    skipped. One group (all 0) is the usual cache. A hybrid model whose groups hold different
    tokens per page (other head sizes, the pages the same size) attaches each group's views
    apart: every tensor of a group has the group's block size, and tensors of different groups
    may view the same bytes, block for block (the same first byte, bytes and num_blocks, no
    regions): one block pool, where a block id names one group's page at a time. A ReadDone
    to such a cache lists one ``groups`` entry per group, in group order.
    """

    name: str
    shape: list[int]
    dtype: DTypeName
    layout: Layout | None = None
    kv_arrangement: KVArrangement | None = None
    block_size: int
    memory: MemoryRef
    page_format: FormatRef | None = None
    num_heads: NonNegative = 0
    head_dim: NonNegative = 0
    num_layers: NonNegative = 0
    group: NonNegative = 0


# ---------------------------------------------------------------------------------------------
# Control socket (ROUTER; clients REQ or DEALER): requests.


class Attach(_Message, tag="attach"):
    """Make a KV cache known to kvd. Every tensor must have the same num_blocks, and those of
    one ``group`` the same block_size (``TensorSpec.group``).

    ``engine_id`` names the engine that owns the cache: it, or the connection that attached,
    may detach it. An Attach of an attached ``cache_id`` with the same non-empty ``engine_id``
    (a restarted engine) replaces the old cache once its requests are answered; any other is
    refused with ``cache_exists``. A cache is detached when its engine is gone: its control
    connection closed, or, once the engine sent a ``Heartbeat``, no Heartbeat came, for
    ``engine_lease_s``.

    ``release_with_process``: the cache's memory dies with the process that attached it (vLLM's
    KvdConnector allocates it in a /dev/shm file of the worker's own): once that connection
    closed and its process no longer exists, the cache is detached at once rather than after
    ``engine_lease_s``. A connection closed by a process still alive keeps the lease.
    """

    cache_id: CacheId
    tensors: list[TensorSpec]
    engine_id: EngineId = ""
    release_with_process: bool = False


class Detach(_Message, tag="detach"):
    """Forget a cache and release its memory. Refused with ``not_owner`` unless it comes from
    the connection that attached the cache, names the same non-empty ``engine_id``, or is an
    operator's ``force`` from kvd's own user (or root) over an ipc socket. Without ``force`` it
    is refused with ``cache_busy`` while any of the cache's requests is in flight; with it,
    those not yet launched get ``Failed(cache_detached)``, the launched ones finish and are
    published, and then the cache is detached and ``Detached`` sent."""

    cache_id: str
    engine_id: EngineId = ""
    force: bool = False


class Status(_Message, tag="status"):
    """One request's state when ``req_id`` is given (of ``cache_id`` when given, else the first
    cache that knows it), else the daemon's status."""

    req_id: str | None = None
    cache_id: str = ""


class Ping(_Message, tag="ping"):
    pass


class Configure(_Message, tag="configure"):
    """Change the batching of a running kvd; a field left out keeps its value. Answered with
    ``Configured``, the settings in force. Only kvd's own user (or root) over an ipc socket may
    send it (``not_permitted`` otherwise)."""

    batch_window_us: BatchWindow | None = None
    max_batch_blocks: BatchBlocks | None = None


class Heartbeat(_Message, tag="heartbeat"):
    """Engine ``engine_id`` is alive: renews the lease of every cache it attached, and makes the
    sending connection theirs. Once an engine has sent one, its caches are detached when no
    Heartbeat comes for ``engine_lease_s``; send one every third of it."""

    engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=ENGINE_ID_MAX)]


ControlRequest = Attach | Detach | Status | Ping | Configure | Heartbeat


# Control socket: replies. Every request gets exactly one reply: a result or an Error.


class Attached(_Message, tag="attached"):
    cache_id: str
    num_blocks: int
    block_size: int
    num_tensors: int
    nbytes: int


class Detached(_Message, tag="detached"):
    cache_id: str


RequestState = Literal["accepted", "batched", "launched", "done", "ready", "failed", "unknown"]
"""``accepted -> batched -> launched -> done`` while in flight; ``ready``/``failed`` once its
event is published; ``unknown`` when kvd never saw the request or has forgotten it."""


class RequestStatus(_Message, tag="request_status"):
    req_id: str
    state: RequestState
    cache_id: str = ""
    code: str = ""
    message: str = ""


class CacheInfo(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """``expires_in_s``: seconds until kvd detaches the cache because its engine is gone
    (None while the engine holds it); ``detaching``: being detached, its requests answered
    first; ``group_block_sizes``: each group's block size, for a cache attached in several
    groups (``TensorSpec.group``; ``block_size`` is group 0's)."""

    cache_id: str
    num_blocks: int
    block_size: int
    num_tensors: int
    nbytes: int
    in_flight: int = 0
    engine_id: str = ""
    expires_in_s: float | None = None
    detaching: bool = False
    group_block_sizes: list[int] = []


class DaemonStatus(_Message, tag="daemon_status"):
    version: str
    protocol_version: int
    pid: int
    uptime_s: float
    device: str
    batch_window_us: int
    """The window in force; with ``batch_window_auto``, kvd's latest choice."""
    max_batch_blocks: int
    in_flight: int
    caches: list[CacheInfo] = []
    counters: dict[str, int] = {}
    rejections: dict[str, int] = {}
    batch_window_auto: bool = False
    engine_lease_s: float = 0.0
    journal_problem: str = ""
    """Why the launch journal cannot be written (new work is refused); empty when it can."""
    cpus: list[int] = []
    """The CPUs kvd may run on (its affinity), in order."""
    dedicated_cpus: bool = False
    """``dedicated_cpus`` in force: kvd's ZMQ I/O threads run SCHED_BATCH."""


class Pong(_Message, tag="pong"):
    version: str
    protocol_version: int
    pid: int


class Configured(_Message, tag="configured"):
    """The batching settings in force (``batch_window_us``: kvd's latest choice when auto)."""

    batch_window_us: int
    max_batch_blocks: int
    batch_window_auto: bool = False


class Lease(_Message, tag="lease"):
    """Answer to a Heartbeat: the caches of ``engine_id`` and how long they are held without
    another one (0: no lease, they are held until detached)."""

    engine_id: str
    lease_s: float
    cache_ids: list[str] = []


class Error(_Message, tag="error"):
    code: str
    message: str


ControlReply = (
    Attached | Detached | RequestStatus | DaemonStatus | Pong | Configured | Lease | Error
)


# ---------------------------------------------------------------------------------------------
# Ingest socket (PULL; clients PUSH): one-way notifications from the engine worker.


class BlockGroup(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """One KV cache group's part of a ``ReadDone``'s ``physical_block_ids``.

    A hybrid model (sliding-window and full-attention layers) keeps one block list per KV cache
    group, all from one block pool: each group's READ covers its own blocks, so each group has
    its own coverage. ``num_blocks`` ids of the request's list, after the earlier groups';
    ``covered_sub_blocks`` as the ``ReadDone`` field, counted from the group's first block.
    """

    num_blocks: NonNegative
    covered_sub_blocks: NonNegative = 0


class ReadDone(_Message, tag="read_done", kw_only=True):
    """The NIXL READs of one request have finished; its blocks need the post-process.

    A notification is identified by (``cache_id``, ``req_id``, ``generation``): kvd rewrites
    the blocks of one notification at most once, and answers a repeated one with the outcome
    it recorded. The engine bumps ``generation`` when it has read the blocks again.

    The remote (prefill) page format is ``remote_format``, or, for older clients,
    ``remote_layout``: the local format with the remote's NHD/HND order. Give either
    ``block_size_ratio`` (decode block size / prefill block size, for a remote block no larger
    than the local one) or ``remote_block_size`` (any size that divides or is a multiple of the
    local one); 0 means "not given". ``physical_block_ids`` are local block ids, in request
    order; kvd rewrites exactly these blocks and no other. ``covered_sub_blocks``, when not 0,
    is how many remote blocks the READ filled, counted from the request's first local block (as
    vLLM's NIXL worker counts them: ``min(len(local) * ratio, len(remote))``): the tokens past
    them in the block they end in, and every later listed block, are zeroed, as vLLM does.

    ``remote_ranks``, when above 1 (with ``v`` = ``RANKS_VERSION``), says the READs came from
    that many remote ranks, one each, and each rank's page (nP > nD: its heads, nP tokens)
    landed in nP / nD pieces, piece ``j`` of every rank side by side, rank by rank, in the
    ``j``-th local block of a group; the remote format, heads outermost, describes the ranks'
    pages back to back. 0 or 1: one rank's pages, or nP <= nD, where each lands whole.

    ``groups``, when given (with ``v`` = ``GROUPS_VERSION``), splits ``physical_block_ids`` into
    the request's KV cache groups, in order, each with its own coverage; the top-level
    ``covered_sub_blocks`` is then 0. The request is one notification: one outcome for every
    group, a Ready only when every group is rewritten. To a cache attached in several groups
    (``TensorSpec.group``) it lists one entry per group, and entry ``i``'s blocks are rewritten
    in group ``i``'s tensors only; the block sizes above are group 0's, and each other group's
    remote blocks are in the same proportion to its own.

    ``cuda_event`` (a kvd on CUDA only) is the 64-byte ``cudaIpcEventHandle_t`` of an event the
    engine recorded on its compute stream when it handed the blocks over: kvd's stream waits on
    it (``cudaStreamWaitEvent``) before its first write to them, so nothing the engine enqueued
    before the hand-off (a kernel still reading these blocks for an earlier request) sees kvd's
    writes. The engine may record that event again, or destroy it, only once this request's
    Ready or Failed arrived (kvd's wait is enqueued by then, or will never be). See
    protocol/README.md.
    """

    req_id: ReqId
    cache_id: CacheIdRef
    remote_layout: Layout | None = None
    physical_block_ids: list[int]
    block_size_ratio: NonNegative = 0
    remote_block_size: NonNegative = 0
    remote_engine_id: str = ""
    remote_format: FormatRef | None = None
    covered_sub_blocks: NonNegative = 0
    generation: NonNegative = 0
    groups: list[BlockGroup] = []
    cuda_event: bytes = b""
    remote_ranks: NonNegative = 0


class ReadFailed(_Message, tag="read_failed"):
    """The READs of one request failed; kvd forwards this as a ``Failed`` event."""

    req_id: ReqId
    cache_id: CacheIdRef
    physical_block_ids: list[int] = []
    reason: str = ""
    remote_engine_id: str = ""
    generation: NonNegative = 0


IngestMessage = ReadDone | ReadFailed


# ---------------------------------------------------------------------------------------------
# Events socket (PUB; clients SUB). Topic = cache id (UTF-8); seq counts per topic from 1.


class Ready(_Message, tag="ready"):
    """The request's blocks hold the local layout; the first decode step may read them.

    With ``cuda_event`` (kvd's ``ready_cuda_event`` setting, CUDA only) the blocks hold it once
    that event has completed on the GPU: the 64-byte ``cudaIpcEventHandle_t`` of an event kvd
    recorded on its stream after the post-process. The engine makes the stream that reads the
    blocks wait on it (``cudaStreamWaitEvent``; ``kvd.cudaipc.wait_event``) instead of waiting
    for kvd on the host. See protocol/README.md for when that is safe.
    """

    req_id: str
    cache_id: str
    physical_block_ids: list[int]
    remote_engine_id: str = ""
    elapsed_us: int = 0
    generation: int = 0
    epoch: int = 0
    cuda_event: bytes = b""


class Failed(_Message, tag="failed"):
    """The request's blocks must not be used as they are.

    ``invalid_block_ids`` lists every block the notification named. ``code`` is a ``Reason``:
    for ``transform_failed``, ``interrupted`` and ``generation_in_flight`` the blocks' contents
    are undefined; for every other code they were not touched.
    """

    req_id: str
    cache_id: str
    code: str
    message: str
    invalid_block_ids: list[int] = []
    remote_engine_id: str = ""
    generation: int = 0
    epoch: int = 0


Event = Ready | Failed


# Replay socket (ROUTER; clients DEALER).


class Replay(_Message, tag="replay"):
    """Resend the events of ``topic`` with seq >= ``from_seq`` that are still buffered."""

    topic: str
    from_seq: NonNegative


class ReplayEnd(_Message, tag="replay_end"):
    """Sentinel payload of a replay answer.

    ``oldest_seq``..``newest_seq`` is what the buffer held for the topic (0 and 0 when empty). If
    the requested ``from_seq`` is below ``oldest_seq``, the events in between are lost for good.
    ``epoch`` identifies the daemon instance: a new value means kvd restarted and its sequence
    numbers started again at 1.
    """

    topic: str
    oldest_seq: int
    newest_seq: int
    epoch: int = 0
    code: str = ""
    message: str = ""


# ---------------------------------------------------------------------------------------------
# Handshake socket (ROUTER on the prefill side; readers REQ or DEALER). kvd itself does not serve
# it: the prefill engine's ``kvd.nixl.Exporter`` does, and the decode side's ``kvd.nixl.Reader``
# asks it once per peer before issuing NIXL READs.


class Handshake(_Message, tag="handshake"):
    """Ask an exporter for its NIXL agent metadata and the description of its cache."""

    engine_id: str = ""


class RemoteTensor(msgspec.Struct, omit_defaults=True, gc=False, kw_only=True):
    """One tensor the exporter registered with NIXL, in the exporter's address space.

    ``block_len`` is the byte length of one block in one K/V region of the tensor (a split tensor
    has two regions, K then V, of ``num_blocks`` blocks each; other arrangements have one).
    """

    name: str
    base_addr: NonNegative
    nbytes: NonNegative
    block_len: NonNegative


class CacheDescription(_Message, tag="cache_description"):
    """What a reader needs to address the exporter's blocks with NIXL.

    Every tensor has the geometry given by ``kv_arrangement``, ``layout``, ``block_size``,
    ``num_heads``, ``head_dim`` and ``dtype`` (see ``TensorSpec``). ``page_format``, when an
    exporter states it, is the page format those name (a preset name or a ``PageFormat``); a
    reader passes it to kvd as the ``remote_format`` of its ``ReadDone``s (``remote_layout``
    when absent). The reader sends, with each READ, the notification ``<req_id>:<tp_size>``
    that vLLM's prefill side counts.
    """

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    mem_type: Literal["DRAM", "VRAM"]
    num_blocks: int
    block_size: int
    layout: Layout
    kv_arrangement: KVArrangement
    dtype: DTypeName
    num_heads: int
    head_dim: int
    tensors: list[RemoteTensor]
    device_id: NonNegative = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    page_format: FormatRef | None = None


HandshakeReply = CacheDescription | Error


class MessageHeader(msgspec.Struct, gc=False):
    """The fields kvd needs to answer a notification it could not decode in full."""

    type: str = ""
    req_id: str = ""
    cache_id: str = ""
    remote_engine_id: str = ""
    generation: int = 0


_HEADER_FIELDS = {f: f for f in ("type", "req_id", "cache_id", "remote_engine_id", "generation")}
_HEADER_STR_MAX = {
    "type": 64,
    "req_id": REQ_ID_MAX,
    "cache_id": CACHE_ID_MAX,
    "remote_engine_id": ENGINE_ID_MAX,
}
HEADER_SCAN_BYTES: Final = 64 * 1024


def decode_header(frame: bytes, limit: int = HEADER_SCAN_BYTES) -> MessageHeader | None:
    """Best-effort read of the routing fields of a frame that failed full decoding.

    Reads only the top-level map, without recursion, and gives up after ``limit`` bytes, so
    neither a deeply nested nor an oversized frame can make it expensive; None when the frame
    is not a map. Fields that cannot be read keep their defaults.
    """
    reader = _Scanner(frame, min(len(frame), limit))
    try:
        entries = reader.map_header()
    except _Stop:
        return None
    header = MessageHeader()
    try:
        for _ in range(entries):
            key = reader.scalar()
            if isinstance(key, str) and key in _HEADER_FIELDS:
                value = reader.scalar()
                want = int if key == "generation" else str
                if isinstance(value, want) and not isinstance(value, bool):
                    if isinstance(value, str) and len(value) > _HEADER_STR_MAX[key]:
                        continue  # not a valid id: answering it would only echo it back
                    setattr(header, key, value)
            else:
                reader.skip()
    except _Stop:
        pass
    return header


class _Stop(Exception):
    """The scan ran out of bytes (or of budget) or met something it does not read."""


class _Scanner:
    """A minimal MessagePack reader: map headers, scalars, and an iterative skip."""

    def __init__(self, data: bytes, end: int) -> None:
        self.data, self.pos, self.end = data, 0, end

    def _take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise _Stop
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def _uint(self, n: int) -> int:
        return int.from_bytes(self._take(n), "big")

    def map_header(self) -> int:
        b = self._take(1)[0]
        if 0x80 <= b <= 0x8F:
            return b & 0x0F
        if b == 0xDE:
            return self._uint(2)
        if b == 0xDF:
            return self._uint(4)
        raise _Stop

    def scalar(self) -> object:
        """A str or int (anything else is skipped and read as None)."""
        b = self.data[self.pos] if self.pos < self.end else None
        if b is None:
            raise _Stop
        if b <= 0x7F:
            self.pos += 1
            return b
        if b >= 0xE0:
            self.pos += 1
            return b - 0x100
        if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
            self.pos += 1
            n = b & 0x1F if b <= 0xBF else self._uint(1 << (b - 0xD9))
            return self._take(n).decode("utf-8", "replace")
        if 0xCC <= b <= 0xCF or 0xD0 <= b <= 0xD3:
            self.pos += 1
            size = 1 << ((b - 0xCC) if b <= 0xCF else (b - 0xD0))
            return int.from_bytes(self._take(size), "big", signed=b >= 0xD0)
        self.skip()
        return None

    def skip(self) -> None:
        """Skip one value, nested containers included, with a counter instead of recursion."""
        pending = 1
        while pending:
            pending -= 1
            b = self._take(1)[0]
            if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
                continue
            if 0x80 <= b <= 0x8F:
                pending += 2 * (b & 0x0F)
            elif 0x90 <= b <= 0x9F:
                pending += b & 0x0F
            elif 0xA0 <= b <= 0xBF:
                self._take(b & 0x1F)
            elif b in (0xDC, 0xDD):
                pending += self._uint(2 if b == 0xDC else 4)
            elif b in (0xDE, 0xDF):
                pending += 2 * self._uint(2 if b == 0xDE else 4)
            elif b in (0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB):
                size = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}[b]
                self._take(self._uint(size))
            elif b in (0xC7, 0xC8, 0xC9):
                self._take(self._uint({0xC7: 1, 0xC8: 2, 0xC9: 4}[b]) + 1)
            elif 0xCA <= b <= 0xD3:
                self._take({0xCA: 4, 0xCB: 8}.get(b, 1 << ((b - 0xCC) % 4)))
            elif 0xD4 <= b <= 0xD8:
                self._take(1 + (1 << (b - 0xD4)))
            else:
                raise _Stop


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")
