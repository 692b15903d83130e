"""How the suite is shared out under `pytest -n`: module-fixture units, and a worker that crashes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from xdist_units import unit

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
