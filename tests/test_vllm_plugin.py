"""The pure parts of kvd.vllm, without vLLM: page formats, holding requests, the /dev/shm file."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvd.protocol import Failed, Ready
from kvd.vllm.formats import NO_GUESS, UnknownFormat, page_format, remote_page_format
from kvd.vllm.holding import Held, Holding
from kvd.vllm.shm import ShmAllocation, reap


def test_known_formats_are_named_and_the_rest_refused() -> None:
    cpu = {"use_mla": False, "kv_cache_dtype": "auto"}
    assert page_format("CPU_ATTN", "LBHNC", isa="vec", **cpu) == "cpu_attn_vec"
    assert page_format("CPU_ATTN", "LBHNC", isa="vec16", **cpu) == "cpu_attn_vec"
    assert page_format("FLASH_ATTN", "LBNHC", isa=None, **cpu) == "LBNHC"
    for args, named in [
        (("CPU_ATTN", "LBHNC"), "'amx'"),
        (("TRITON_ATTN", "LBHNC"), "'TRITON_ATTN'"),
        (("FLASHINFER", "XYZ"), "'XYZ'"),
    ]:
        with pytest.raises(UnknownFormat, match=named):
            page_format(*args, isa="amx", **cpu)
    with pytest.raises(UnknownFormat, match="MLA attention backend 'FLASH_ATTN'"):
        page_format("FLASH_ATTN", "LBHNC", isa=None, use_mla=True, kv_cache_dtype="auto")
    for static in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # 1-byte pages, scales per layer
        fp8 = {"use_mla": False, "kv_cache_dtype": static}
        assert page_format("CPU_ATTN", "LBHNC", isa="vec", **fp8) == "cpu_attn_vec"
        assert page_format("FLASH_ATTN", "LBHNC", isa=None, **fp8) == "LBHNC"
    for dynamic in ("fp8_per_token_head", "int8_per_token_head", "nvfp4", "fp8_ds_mla"):
        with pytest.raises(UnknownFormat, match=f"{dynamic}.*static per-layer scales"):
            page_format("FLASH_ATTN", "LBHNC", isa=None, use_mla=False, kv_cache_dtype=dynamic)


@pytest.mark.parametrize(
    ("engine", "named", "avoid"),
    [
        (("CPU_ATTN", "LBHNC", "amx", "auto"), "ISA 'amx'", "--dtype float16"),
        (("CPU_ATTN", "LBHNC", "neon", "auto"), "ISA 'neon'", "own NixlConnector at equal"),
        (("CPU_ATTN", "LBHNC", "avx10", "auto"), "ISA 'avx10'", "no setting kvd knows selects"),
        (("CPU_ATTN", "LBHNC", None, "auto"), "unknown ISA", "CPUs of one kind"),
        (("TRITON_ATTN", "LBHNC", None, "auto"), "'TRITON_ATTN'", "--attention-backend"),
        (("FLASH_ATTN", "XYZ", None, "auto"), "layout 'XYZ'", "VLLM_KV_CACHE_LAYOUT unset"),
        (("FLASH_ATTN", "LBHNC", None, "nvfp4"), "'nvfp4'", "kv_cache_dtype='auto'"),
    ],
)
def test_a_refusal_names_what_says_why_and_what_avoids_it(
    engine: tuple[str, str, str | None, str], named: str, avoid: str
) -> None:
    backend, layout, isa, dtype = engine
    with pytest.raises(UnknownFormat) as refused:
        page_format(backend, layout, isa=isa, use_mla=False, kv_cache_dtype=dtype)
    assert named in refused.value.what
    assert refused.value.avoid is not None and avoid in refused.value.avoid
    assert (
        str(refused.value)
        == f"{refused.value.what}. {NO_GUESS}. To avoid it: {refused.value.avoid}."
    )


def test_mla_caches_are_token_major_latent_pages_of_one_tensor_per_layer() -> None:
    mla = {"isa": None, "use_mla": True, "kv_cache_dtype": "auto"}
    for backend in ("CPU_MLA", "AMX_MLA", "FLASHMLA", "TRITON_MLA", "FLASH_ATTN_MLA"):
        for layout in ("LBHNC", "LBNHC", "LHBNC"):
            assert page_format(backend, layout, **mla) == "mla"
    with pytest.raises(UnknownFormat, match=r"'BLHNC'.*one tensor per layer"):
        page_format("CUTLASS_MLA", "BLHNC", **mla)
    with pytest.raises(UnknownFormat, match="fp8"):
        page_format("FLASHMLA", "LBHNC", isa=None, use_mla=True, kv_cache_dtype="fp8")
    # A prefill engine's handshake names its backend only: an MLA one has MLA pages.
    same = {"local": "mla", "local_isa": None, "kv_cache_dtype": "auto"}
    assert remote_page_format("CPU_MLA", "LBHNC", **same) == "mla"


def test_a_remote_cpu_engine_is_read_with_the_local_isa() -> None:
    same = {"local": "cpu_attn_vec", "local_isa": "vec", "kv_cache_dtype": "auto"}
    assert remote_page_format("CPU_ATTN", "LBHNC", **same) == "cpu_attn_vec"
    assert remote_page_format("FLASH_ATTN", "LBHNC", **same) == "LBHNC"
    with pytest.raises(UnknownFormat, match="unknown ISA"):
        remote_page_format(
            "CPU_ATTN", "LBHNC", local="LBHNC", local_isa=None, kv_cache_dtype="auto"
        )


def held(req_id: str) -> Held:
    return Held(req_id, [3, 4], 32, "cpu_attn_vec", 3, "prefill")


def test_held_requests_are_released_only_by_their_event() -> None:
    holding = Holding()
    for r in ("a", "b", "c"):
        holding.hold(held(r))
    released = holding.answer(
        [
            Ready(req_id="a", cache_id="c", physical_block_ids=[3, 4]),
            Failed(req_id="b", cache_id="c", code="interrupted", message=""),
            Ready(req_id="someone-else", cache_id="c", physical_block_ids=[]),
        ]
    )
    assert released.finished == {"a", "b"} and released.failed == {"b"}
    assert holding.failures == {"b": "interrupted"} and len(released.latencies_s) == 2
    assert [h.req_id for h in holding.resend()] == ["c"]
    assert (
        holding.answer([Ready(req_id="a", cache_id="c", physical_block_ids=[])]).finished == set()
    )
    gone = holding.give_up()
    assert gone.finished == gone.failed == {"c"} and len(holding) == 0


def test_the_kv_allocation_lands_in_dev_shm_and_nothing_else_does() -> None:
    allocation = ShmAllocation("kvd-test-alloc")
    try:
        with allocation:
            other = torch.zeros(16, dtype=torch.float32)
            kv = torch.zeros(10_000, dtype=torch.int8, device="cpu")
            second = torch.zeros(10_000, dtype=torch.int8)
        assert allocation.tensor is not None and kv.data_ptr() == allocation.tensor.data_ptr()
        assert second.data_ptr() != kv.data_ptr() and other.dtype == torch.float32
        assert os.stat(allocation.path).st_mode & 0o777 == 0o660
        layer = kv[4096:8192].view(torch.float32)
        assert allocation.offset_of(layer) == 4096
        with pytest.raises(RuntimeError, match="outside"):
            allocation.offset_of(second)
    finally:
        allocation.close()
    assert not Path(allocation.path).exists()


def test_the_kv_allocation_is_faulted_in_ahead_like_torch_zeros() -> None:
    # The forward that first writes or reads a page of the cache must not pay its page fault:
    # vLLM's own torch.zeros would have touched every page. 16 MiB, 4,096 pages.
    allocation = ShmAllocation("kvd-test-faults")
    try:
        with allocation:
            kv = torch.zeros(16 << 20, dtype=torch.int8)
        page = os.sysconf("SC_PAGE_SIZE")
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        kv[::page] = 1  # one byte in every page, no temporary tensor
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert faults < 64, f"{faults} page faults writing the {kv.numel() // page} pages"
    finally:
        allocation.close()


def test_files_of_dead_workers_are_reaped(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = Path("/dev/shm") / f"kvd-test-reap-{int(dead.stdout)}-abcd1234"
    mine = Path("/dev/shm") / f"kvd-test-reap-{os.getpid()}-abcd1234"
    for path in (stale, mine):
        path.write_bytes(b"x")
    try:
        assert reap("kvd-test-reap") == [stale.name]
        assert mine.exists() and not stale.exists()
    finally:
        mine.unlink(missing_ok=True)
        stale.unlink(missing_ok=True)


def test_a_file_another_worker_reaps_first_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks of a TP decode reap at once: a file listed here may be gone before it is
    looked at (CI: a TP 2 decode failed to start with ENOENT on a dead worker's file)."""
    stale = Path("/dev/shm") / "kvd-test-race-1-abcd1234"  # pid 1 is alive: no reap of its own
    stale.write_bytes(b"x")
    listed = list(os.scandir("/dev/shm"))

    def scandir_then_the_other_rank_reaps(path: str) -> list[os.DirEntry[str]]:
        stale.unlink()
        return listed

    monkeypatch.setattr("kvd.vllm.shm.os.scandir", scandir_then_the_other_rank_reaps)
    try:
        assert reap("kvd-test-race") == []
    finally:
        stale.unlink(missing_ok=True)
