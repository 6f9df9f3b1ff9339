"""Routes: decided once per (cache, remote side as a ReadDone states it), remembered bounded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvd.daemon.attach import open_cache
from kvd.daemon.ledger import Ledger
from kvd.daemon.registry import AttachedCache, Owner, Registry
from kvd.daemon.routes import ROUTES_PER_CACHE, Rejection, Route
from kvd.daemon.validate import validate_read_done
from kvd.protocol import (
    GROUPS_VERSION,
    RANKS_VERSION,
    Attach,
    BlockGroup,
    Layout,
    ReadDone,
    Reason,
)
from kvd.shm import ShmCache

CPU = torch.device("cpu")


@pytest.fixture
def attached() -> Iterator[tuple[Registry, AttachedCache]]:
    shm = ShmCache.create(num_layers=1, num_blocks=8, block_size=16, num_heads=2, head_dim=8)
    registry = Registry(CPU)
    cache = open_cache(Attach(cache_id="c", tensors=shm.specs), CPU, Owner(b"", ""))
    registry.add(cache)
    yield registry, cache
    registry.remove("c")
    shm.close()


def read_done(
    req_id: str,
    ids: list[int],
    layout: Layout = "HND",
    *,
    ratio: int = 1,
    remote_block_size: int = 0,
    covered: int = 0,
) -> ReadDone:
    return ReadDone(
        req_id=req_id,
        cache_id="c",
        remote_layout=layout,
        physical_block_ids=ids,
        block_size_ratio=0 if remote_block_size else ratio,
        remote_block_size=remote_block_size,
        covered_sub_blocks=covered,
    )


def test_a_route_is_decided_once_and_says_whether_work_is_needed(
    attached: tuple[Registry, AttachedCache],
) -> None:
    registry, cache = attached
    ledger = Ledger()
    hnd = validate_read_done(read_done("a", [0, 1]), registry, ledger)
    assert isinstance(hnd, Route) and hnd.moves_bytes and hnd.needs_work(0, 2)
    assert validate_read_done(read_done("b", [2]), registry, ledger) is hnd, "decided once"
    nhd = validate_read_done(read_done("c", [3], "NHD"), registry, ledger)
    assert isinstance(nhd, Route) and not nhd.moves_bytes
    assert not nhd.needs_work(0, 1) and not nhd.needs_work(1, 1) and not nhd.needs_work(0, 0)
    halves = validate_read_done(read_done("d", [4], "NHD", ratio=2), registry, ledger)
    assert isinstance(halves, Route) and (halves.pages, halves.remote_pages) == (1, 2)
    assert halves.needs_work(1, 1), "one of two remote halves landed: the rest is zeroed"
    assert len(cache.routes) == 3


def test_refused_remote_sides_and_broken_group_rules_are_rejections(
    attached: tuple[Registry, AttachedCache],
) -> None:
    registry, _ = attached
    ledger = Ledger()
    odd = validate_read_done(read_done("a", [0], ratio=3), registry, ledger)
    assert isinstance(odd, Rejection) and odd.code == Reason.INVALID_RATIO
    assert validate_read_done(read_done("b", [0], ratio=3), registry, ledger) is odd
    double = read_done("c", [0, 1, 2], "NHD", remote_block_size=32)
    broken = validate_read_done(double, registry, ledger)
    assert isinstance(broken, Rejection) and broken.code == Reason.INVALID_RATIO
    assert broken.message.startswith("physical_block_ids: 3 block ids do not fill whole groups")
    beyond = validate_read_done(read_done("d", [0], ratio=2, covered=3), registry, ledger)
    assert isinstance(beyond, Rejection) and beyond.code == Reason.INVALID_MESSAGE
    assert beyond.message.startswith("covered_sub_blocks: 3 is not in [0, 2]")


def test_a_peer_naming_ever_new_block_sizes_leaves_the_routes_bounded(
    attached: tuple[Registry, AttachedCache],
) -> None:
    registry, cache = attached
    ledger = Ledger()
    for k in range(1, 4 * ROUTES_PER_CACHE):
        msg = read_done(f"r{k}", [0], "NHD", remote_block_size=16 * k)
        validate_read_done(msg, registry, ledger)
    assert len(cache.routes) <= ROUTES_PER_CACHE
    newest = cache.routes[(None, "NHD", 0, 16 * (4 * ROUTES_PER_CACHE - 1), 0)]
    assert isinstance(newest, Route) and newest.pages == 4 * ROUTES_PER_CACHE - 1


def test_groups_split_the_block_ids_and_each_fits_on_its_own(
    attached: tuple[Registry, AttachedCache],
) -> None:
    """A hybrid request's ``groups`` (v 2) must count exactly its block ids, and each group's
    blocks and coverage must fit the route as a whole request's would."""
    registry, _ = attached
    ledger = Ledger()

    def grouped(req_id: str, ids: list[int], groups: list[tuple[int, int]], **kw: int) -> ReadDone:
        return ReadDone(
            req_id=req_id, cache_id="c", remote_layout="HND", physical_block_ids=ids,
            block_size_ratio=2, v=GROUPS_VERSION,
            groups=[BlockGroup(num_blocks=n, covered_sub_blocks=c) for n, c in groups], **kw,
        )  # fmt: skip

    ok = validate_read_done(grouped("a", [0, 1, 2], [(1, 2), (2, 3)]), registry, ledger)
    assert isinstance(ok, Route) and ok.any_work([(1, 2), (2, 3)])
    cases = {
        "groups: they count 2 blocks, physical_block_ids lists 3": grouped(
            "b", [0, 1, 2], [(1, 0), (1, 0)]
        ),
        "groups[1].covered_sub_blocks: 5 is not in [0, 4]": grouped(
            "c", [0, 1, 2], [(1, 0), (2, 5)]
        ),
        "covered_sub_blocks: with groups": grouped("d", [0], [(1, 1)], covered_sub_blocks=1),
        "v: a ReadDone with 1 groups and remote_ranks 0 carries v 2, not 1": ReadDone(
            req_id="e",
            cache_id="c",
            remote_layout="HND",
            physical_block_ids=[0],
            groups=[BlockGroup(num_blocks=1)],
        ),
        "v: a ReadDone with 0 groups and remote_ranks 0 carries v 1, not 2": ReadDone(
            req_id="f", cache_id="c", remote_layout="HND", physical_block_ids=[0], v=2
        ),
        "v: a ReadDone with 0 groups and remote_ranks 2 carries v 3, not 1": ReadDone(
            req_id="h", cache_id="c", remote_layout="HND", physical_block_ids=[0], remote_ranks=2
        ),
        "v: a ReadDone with 1 groups and remote_ranks 2 carries v 3, not 2": grouped(
            "i", [0], [(1, 0)], remote_ranks=2
        ),
    }
    for text, msg in cases.items():
        verdict = validate_read_done(msg, registry, ledger)
        assert isinstance(verdict, Rejection) and verdict.code == Reason.INVALID_MESSAGE, text
        assert verdict.message.startswith(text), verdict.message
    three = validate_read_done(
        ReadDone(req_id="g", cache_id="c", remote_layout="HND", physical_block_ids=[0], v=4),
        registry,
        ledger,
    )
    assert isinstance(three, Rejection) and three.code == Reason.UNSUPPORTED_VERSION


def test_interleaved_ranks_are_a_route_of_their_own_and_need_one_page_of_their_pages(
    attached: tuple[Registry, AttachedCache],
) -> None:
    """``remote_ranks`` (v 3): with nP > nD a route of its own, whose rewrites read each rank's
    pieces; refused, naming the field, where the ranks' pages are not one remote page."""
    registry, _ = attached
    ledger = Ledger()

    def ranked(req_id: str, layout: Layout, ranks: int, **kw: object) -> ReadDone:
        return ReadDone(
            req_id=req_id, cache_id="c", remote_layout=layout, physical_block_ids=[0, 1],
            remote_block_size=32, remote_ranks=ranks, v=RANKS_VERSION, **kw,
        )  # fmt: skip

    plain = validate_read_done(read_done("a", [0, 1], remote_block_size=32), registry, ledger)
    two = validate_read_done(ranked("b", "HND", 2), registry, ledger)
    assert isinstance(plain, Route) and isinstance(two, Route) and two is not plain
    assert (plain.remote_ranks, two.remote_ranks) == (1, 2)
    assert [r.remote_ranks for r in two.rewrites] == [2] * len(two.rewrites)
    grouped = ranked("c", "HND", 2, groups=[BlockGroup(num_blocks=2)])
    assert validate_read_done(grouped, registry, ledger) is two
    for msg, why in [
        (ranked("d", "NHD", 2), "heads outermost"),
        (ranked("e", "HND", 4), "4 ranks do not share the page's 2 heads evenly"),
    ]:
        verdict = validate_read_done(msg, registry, ledger)
        assert isinstance(verdict, Rejection) and verdict.code == Reason.INVALID_LAYOUT
        assert verdict.message.startswith("remote_ranks: ") and why in verdict.message
