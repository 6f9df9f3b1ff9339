"""Checks a ReadDone against what kvd knows before anything is accepted.

Pure logic: reads the registry and ledger, changes nothing. The result is either what the
pipeline needs to accept the request (its cache and resolved ratio) or a ``Rejection`` with a
reason code for the Failed event.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.daemon.ledger import Ledger
from kvd.daemon.registry import AttachedCache, Registry
from kvd.layout.geometry import check_block_ids, preview, resolve_remote_block_size
from kvd.protocol import PROTOCOL_VERSION, ReadDone, Reason


@dataclass(frozen=True, slots=True)
class Rejection:
    code: Reason
    message: str


def validate_read_done(
    msg: ReadDone, registry: Registry, ledger: Ledger
) -> tuple[AttachedCache, int] | Rejection:
    """The cache and resolved block_size_ratio of an acceptable ``msg``, or why it is not."""
    if msg.v != PROTOCOL_VERSION:
        return Rejection(
            Reason.UNSUPPORTED_VERSION,
            f"v: protocol version {msg.v} is not supported (this kvd speaks {PROTOCOL_VERSION})",
        )
    if not msg.req_id:
        return Rejection(Reason.INVALID_MESSAGE, "req_id: must not be empty")
    if ledger.get(msg.req_id) is not None:
        return Rejection(
            Reason.DUPLICATE_REQUEST,
            f"req_id: {msg.req_id!r} is already in flight; this notification is ignored",
        )
    cache = registry.get(msg.cache_id)
    if cache is None:
        return Rejection(Reason.UNKNOWN_CACHE, f"cache_id: {msg.cache_id!r} is not attached")
    ratio = msg.block_size_ratio
    if msg.remote_block_size or ratio < 1 or cache.block_size % ratio:
        try:
            remote_block_size = resolve_remote_block_size(
                cache.block_size, msg.block_size_ratio, msg.remote_block_size
            )
        except ValueError as exc:
            return Rejection(Reason.INVALID_RATIO, str(exc))
        if remote_block_size > cache.block_size:
            return Rejection(
                Reason.INVALID_RATIO,
                f"remote_block_size: {remote_block_size} is larger than the local block size "
                f"{cache.block_size}; this kvd does not batch such requests yet",
            )
        ratio = cache.block_size // remote_block_size
    if msg.remote_layout is not None:
        problem = cache.legacy_layout_problem(msg.remote_layout)
        if problem is not None:
            return Rejection(Reason.INVALID_LAYOUT, problem)
    ids = msg.physical_block_ids
    bad_ids = check_block_ids(ids, cache.num_blocks)
    if bad_ids is not None:
        code = (
            Reason.BLOCK_OUT_OF_RANGE
            if bad_ids.fault == "out_of_range"
            else Reason.DUPLICATE_BLOCK_ID
        )
        return Rejection(code, f"physical_block_ids: {bad_ids}")
    busy = ledger.busy_blocks(msg.cache_id, ids)
    if busy:
        return Rejection(
            Reason.BLOCK_IN_FLIGHT,
            f"physical_block_ids: blocks {preview(busy)} belong to a request still in flight",
        )
    return cache, ratio
