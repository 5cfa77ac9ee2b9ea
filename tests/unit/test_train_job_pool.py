"""tests/conftest.py's TrainJobPool orders its jobs: a job declared `after` another runs once that one
has, in a later batch or later in the same one; single-process jobs run here, one at a time. The
launches are recorded instead of run."""

from __future__ import annotations

import pytest

from conftest import TrainJobPool


class _Item:
    def __init__(self, nodeid: str, *marks):
        self.nodeid = nodeid
        self._marks = marks

    def iter_markers(self, name):
        return iter(self._marks) if name == "train_run" else iter(())


class _RecordingPool(TrainJobPool):
    def __init__(self, root, items):
        super().__init__(root, items)
        self.log: list[tuple[str, ...]] = []

    def _launch(self, batch):
        self.log.append(tuple(self._key(j) for j in batch))
        for j in batch:
            (self.root / f"{j.name}.rc").write_text("0")
            self.outputs[j.name] = ""

    def _run_here(self, job):
        self.log.append(("here", self._key(job)))
        (self.root / f"{job.name}.rc").write_text("0")
        self.outputs[job.name] = ""

    def _key(self, job):
        return next(name for (_, name), j in self.jobs.items() if j is job)


def _mark(name, nproc=1, after=None):
    return pytest.mark.train_run(name=name, nproc=nproc, after=after).mark


def test_a_resume_runs_after_its_save_in_the_same_batch_or_a_later_one(tmp_path):
    items = [_Item("t::a", _mark("resume", 2, after="save"), _mark("save", 2)),
             _Item("t::b", _mark("resume4", 4, after="save2"), _mark("save2", 2)),
             _Item("t::c", _mark("again", 1, after="pp"), _mark("pp", 2, after="one"), _mark("one", 1))]
    pool = _RecordingPool(tmp_path, items)
    pool.get("t::a", "resume")  # the save first, then the resume in the same batch; nothing launched twice
    assert pool.log == [("here", "one"), ("save", "save2", "pp", "resume")]
    pool.get("t::a", "save")
    pool.get("t::b", "resume4")
    pool.get("t::c", "again")
    assert pool.log[2:] == [("resume4",), ("here", "again")]


def test_a_job_after_one_the_test_does_not_declare_is_refused(tmp_path):
    with pytest.raises(ValueError, match="comes after 'nothing', which the test does not declare"):
        TrainJobPool(tmp_path, [_Item("t::a", _mark("resume", 2, after="nothing"))])
