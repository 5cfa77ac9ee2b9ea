"""The fast lane's guard (tests/conftest.py): a test not marked slow that starts a process fails, naming
itself, however it starts one."""

import multiprocessing
import re
import subprocess
import sys

import pytest
import torch.multiprocessing


def _nothing(*args) -> None:
    pass


def test_a_test_not_marked_slow_cannot_start_a_process(request):
    named = re.escape(request.node.nodeid) + r" starts a process \((?P<how>[\w.]+)\) but is not marked slow"
    starts = {
        "subprocess.Popen": lambda: subprocess.run([sys.executable, "-c", "pass"]),
        "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=_nothing).start(),
        "torch.multiprocessing.spawn": lambda: torch.multiprocessing.spawn(_nothing, nprocs=1),
        "torch.multiprocessing.start_processes": lambda: torch.multiprocessing.start_processes(_nothing, nprocs=1),
    }
    for how, start in starts.items():
        with pytest.raises(AssertionError, match=named) as e:
            start()
        assert re.search(named, str(e.value))["how"] == how


def test_every_test_of_a_folder_of_processes_is_slow():
    import conftest

    class Item:
        def __init__(self, path):
            self.path, self.marks = conftest.REPO / "tests" / path, []

        def add_marker(self, mark):
            self.marks.append(mark.name)

    items = [Item(f"{folder}/test_x.py") for folder in ("distributed", "integration", "layouts", "unit", "conformance")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.marks for item in items] == [["slow"], ["slow"], ["slow"], [], []]


def test_the_long_groups_start_first_and_each_names_a_group():
    """Under xdist the groups of conftest.LONG_GROUPS are handed out first, in that order; a renamed file
    would silently drop out of the list, so each entry must still name a test file (or the worlds group)."""
    import conftest

    for group in conftest.LONG_GROUPS:
        assert group == "worlds" or (conftest.REPO / group).is_file(), f"LONG_GROUPS names {group}, not a test file"

    class Config:
        class pluginmanager:
            hasplugin = staticmethod(lambda name: name == "xdist")

    class Item:
        def __init__(self, path):
            self.path, self.nodeid, self.fixturenames = conftest.REPO / path, f"{path}::test", ()

        def add_marker(self, mark):
            pass

    paths = ["tests/unit/test_a.py", "tests/integration/test_sft.py", "tests/unit/test_b.py",
             "tests/integration/test_grpo.py", "tests/layouts/test_x.py"]
    items = [Item(p) for p in paths]
    conftest.pytest_collection_modifyitems(Config(), items)
    assert [str(item.path.relative_to(conftest.REPO)) for item in items] == [
        "tests/layouts/test_x.py", "tests/integration/test_grpo.py", "tests/integration/test_sft.py",
        "tests/unit/test_a.py", "tests/unit/test_b.py"]
