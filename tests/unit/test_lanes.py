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
