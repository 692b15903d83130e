"""How the suite is shared out under `pytest -n`: module-fixture units, and a worker that crashes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from xdist_units import make_scheduler, unit

HERE = os.path.dirname(os.path.abspath(__file__))

CONFTEST = f"""
import sys
sys.path.insert(0, {HERE!r})
import pytest

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist_units import make_scheduler
    return make_scheduler(config, log)
"""

SHARED = """
import os, signal, pytest

@pytest.fixture(scope="module")
def pipeline():
    return 1

@pytest.mark.parametrize("i", range(6))
def test_reads_the_pipeline(pipeline, i):
    if i == 2:
        os.kill(os.getpid(), signal.SIGSEGV)

def test_alone():
    pass
"""

ALONE = """
import os, signal, pytest

@pytest.mark.parametrize("i", range(20))
def test_quick(i):
    pass

def test_crashes():
    os.kill(os.getpid(), signal.SIGSEGV)
"""


def test_the_tests_of_a_module_fixture_are_one_unit_and_the_others_their_own(tmp_path):
    (tmp_path / "test_shared.py").write_text(textwrap.dedent(SHARED))
    assert unit(tmp_path, "test_shared.py::test_reads_the_pipeline[3]") == "test_shared.py::<module fixtures>"
    assert unit(tmp_path, "test_shared.py::test_alone") == "test_shared.py::test_alone"


@pytest.mark.slow
def test_a_crashed_worker_fails_its_test_and_the_session_still_ends(tmp_path):
    """A segfault in a test of a shared unit and in a test of its own: each is reported failed
    once, every other test runs, and the session ends (it once hung until CI's limit)."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_shared.py").write_text(textwrap.dedent(SHARED))
    (tmp_path / "test_alone.py").write_text(textwrap.dedent(ALONE))
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1 and "2 failed, 26 passed" in summary, done.stdout[-3000:]
    assert "crashed while running 'test_shared.py::test_reads_the_pipeline[2]'" in done.stdout
    assert "crashed while running 'test_alone.py::test_crashes'" in done.stdout


class Worker:
    """What the scheduler sees of an xdist worker: the ids it was sent; once `gone`, a send raises
    as execnet's does on a closed channel."""

    def __init__(self, name: str):
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down, self.gone, self.sent = False, False, []

    def send_runtest_some(self, indices):
        if self.gone:
            raise OSError("cannot send (already closed?)")
        self.sent.append(list(indices))

    def shutdown(self):
        self.shutting_down = True


class Quiet:
    def __call__(self, *args):
        pass

    def __getattr__(self, name):
        return self


def test_a_worker_that_dies_before_its_next_unit_is_sent_hands_that_unit_back():
    """A worker reports a test, then dies before the controller sends it more: the send fails
    (this once ended a CI session with an INTERNALERROR), the worker's unfinished units go back to
    the queue, and the test it was running is the one reported crashed."""
    config = types.SimpleNamespace(getvalue={"tx": ["2*popen"]}.get, rootpath=Path("/nonexistent"),
                                   option=types.SimpleNamespace(loadscopereorder=False))
    scheduler = make_scheduler(config, Quiet())
    tests = [f"test_x.py::test_{i}" for i in range(8)]
    first, second = Worker("gw0"), Worker("gw1")
    for worker in (first, second):
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, tests)
    scheduler.schedule()
    assert first.sent == [[0], [2]] and second.sent == [[1], [3]]

    first.gone = True
    scheduler.mark_test_complete(first, 0)  # test_0 passed; test_4 is assigned, and the send fails
    assert first.sent == [[0], [2]]
    assert scheduler.remove_node(first) == "test_x.py::test_2"  # it died running test_2
    assert list(scheduler.workqueue) == ["test_x.py::test_6", "test_x.py::test_7", "test_x.py::test_4"]
