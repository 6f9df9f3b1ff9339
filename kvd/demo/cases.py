"""The demo's matrix: which prefill engines feed which decode caches.

Pure data. Each case gets its own decode cache and its own requests; a case with two engines
sends both engines' requests into one cache at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.protocol import Layout


@dataclass(frozen=True, slots=True)
class PrefillEngine:
    engine_id: str
    block_size: int
    layout: Layout
    seed: int


@dataclass(frozen=True, slots=True)
class Case:
    engines: tuple[str, ...]
    decode_block_size: int
    decode_layout: Layout

    def name(self, engines: dict[str, PrefillEngine]) -> str:
        sources = " + ".join(f"{engines[e].layout}{engines[e].block_size}" for e in self.engines)
        return f"{sources} -> {self.decode_layout}{self.decode_block_size}"


ENGINES = {
    e.engine_id: e
    for e in (
        PrefillEngine("prefill-hnd16", 16, "HND", seed=1),
        PrefillEngine("prefill-nhd16", 16, "NHD", seed=2),
        PrefillEngine("prefill-hnd32", 32, "HND", seed=3),
        PrefillEngine("prefill-hnd64", 64, "HND", seed=4),
    )
}

CASES = (
    # vLLM's common case: an HND prefill, an NHD decode, with and without block merging.
    Case(("prefill-hnd16",), 16, "NHD"),
    Case(("prefill-hnd16",), 32, "NHD"),
    Case(("prefill-hnd16",), 64, "NHD"),
    # Same layout, bigger decode blocks: merge per head.
    Case(("prefill-hnd16",), 16, "HND"),
    Case(("prefill-hnd16",), 32, "HND"),
    Case(("prefill-hnd16",), 64, "HND"),
    # Tokens outermost: NIXL's placement is already right.
    Case(("prefill-nhd16",), 16, "NHD"),
    Case(("prefill-nhd16",), 64, "NHD"),
    # Not offered by vLLM: NHD prefill into an HND decode.
    Case(("prefill-nhd16",), 64, "HND"),
    # Two prefill engines with different block sizes into one decode cache at once.
    Case(("prefill-hnd16", "prefill-hnd32"), 64, "NHD"),
    # Prefill blocks larger than decode ones: each lands across 4 decode blocks.
    Case(("prefill-hnd64",), 16, "NHD"),
    Case(("prefill-hnd64",), 16, "HND"),
    # Both directions into one decode cache at once: 16 -> 16 and 64 -> 16 (groups of 4).
    Case(("prefill-hnd16", "prefill-hnd64"), 16, "NHD"),
)


def largest_group(cases: tuple[Case, ...], engines: dict[str, PrefillEngine]) -> int:
    """The most decode blocks one prefill block lands across, over ``cases``."""
    return max(
        max(1, engines[e].block_size // case.decode_block_size)
        for case in cases
        for e in case.engines
    )
