"""The launch journal on real files: recovery after a crash, torn records, rotation, refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvd.daemon.journal import Journal, JournalError, Launch, Outcome


def launch(req_id: str, generation: int = 0, cache: str = "c") -> Launch:
    return Launch(cache, req_id, generation, [1, 2, 3], "prefill-0")


def done(req_id: str, generation: int = 0, code: str = "", cache: str = "c") -> Outcome:
    return Outcome(cache, req_id, generation, code, "", [1, 2, 3], "prefill-0")


def test_launches_without_an_outcome_are_interrupted(short_tmp: Path) -> None:
    journal = Journal(short_tmp, 1 << 20)
    assert journal.recover().interrupted == []
    journal.open()
    journal.launched([launch("a"), launch("b"), launch("c", cache="other")])
    journal.finished([done("a")])
    journal.launched([launch("a", generation=1)])  # read again, and launched again
    journal.close()  # the process dies here

    recovered = Journal(short_tmp, 1 << 20).recover()
    assert [(x.cache_id, x.req_id, x.generation) for x in recovered.interrupted] == [
        ("c", "b", 0),
        ("other", "c", 0),
        ("c", "a", 1),
    ]
    assert list(recovered.outcomes) == [("c", "a")]
    assert recovered.torn == 0


def test_a_record_torn_by_a_crash_is_ignored(short_tmp: Path) -> None:
    journal = Journal(short_tmp, 1 << 20)
    journal.recover()
    journal.open()
    journal.launched([launch("a")])
    journal.finished([done("a")])
    journal.close()
    (segment,) = short_tmp.glob("journal.*")
    data = segment.read_bytes()
    segment.write_bytes(data[:-3])  # the outcome's write was cut short
    recovered = Journal(short_tmp, 1 << 20).recover()
    assert recovered.torn == 1
    assert [x.req_id for x in recovered.interrupted] == ["a"]


def test_open_keeps_what_it_is_given_and_drops_older_segments(short_tmp: Path) -> None:
    journal = Journal(short_tmp, 1 << 20)
    journal.recover()
    journal.open()
    journal.launched([launch("a")])
    journal.finished([done("a", code="interrupted")])
    journal.close()
    second = Journal(short_tmp, 1 << 20)
    recovered = second.recover()
    second.open(recovered.outcomes.values())
    assert len(list(short_tmp.glob("journal.*"))) == 1
    second.close()
    assert list(Journal(short_tmp, 1 << 20).recover().outcomes) == [("c", "a")]


def test_rotation_bounds_the_journal_and_carries_running_launches(short_tmp: Path) -> None:
    journal = Journal(short_tmp, 8192)
    journal.recover()
    journal.open()
    journal.launched([launch("running")])
    rotations = 0
    for i in range(400):
        journal.launched([launch(f"r{i}")])
        journal.finished([done(f"r{i}")])
        rotations += journal.rotate_if_full([launch("running")])
        assert sum(p.stat().st_size for p in short_tmp.glob("journal.*")) <= 8192 + 512
    journal.close()
    assert rotations > 3
    assert len(list(short_tmp.glob("journal.*"))) == 2
    recovered = Journal(short_tmp, 8192).recover()
    assert [x.req_id for x in recovered.interrupted] == ["running"]
    assert ("c", "r399") in recovered.outcomes and ("c", "r0") not in recovered.outcomes


def test_a_planted_symlink_or_garbage_is_refused(short_tmp: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, short_tmp / "journal.7")
    with pytest.raises(JournalError, match=r"journal\.7"):
        Journal(short_tmp, 1 << 20).recover()
    (short_tmp / "journal.7").unlink()
    (short_tmp / "journal.8").write_bytes(b"\x05\x00\x00\x00garbage")
    with pytest.raises(JournalError, match="corrupt"):
        Journal(short_tmp, 1 << 20).recover()


def test_a_rotation_that_cannot_start_a_segment_keeps_the_current_one(short_tmp: Path) -> None:
    journal = Journal(short_tmp, 8192)
    journal.recover()
    journal.open()
    (short_tmp / "journal.2").touch()  # the next segment's name is taken
    for i in range(100):  # past half of max_bytes: a rotation is due
        journal.launched([launch(f"r{i}")])
        journal.finished([done(f"r{i}")])
    with pytest.raises(JournalError, match=r"journal\.2"):
        journal.rotate_if_full([])
    journal.launched([launch("after")])  # still written, to the segment in use
    assert journal.problem is None
    journal.close()
    assert [x.req_id for x in Journal(short_tmp, 8192).recover().interrupted] == ["after"]
