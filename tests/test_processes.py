"""Training in real subprocesses: SIGKILL and resume, and data parallelism over 8 host devices."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import xla_flags

WORKER = os.path.join(os.path.dirname(__file__), "train_worker.py")


def run_worker(out, *args, devices=1, check=True):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if devices > 1:
        env["XLA_FLAGS"] = xla_flags(f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, WORKER, str(out), *map(str, args)], env=env,
                          capture_output=True, text=True, check=check, timeout=300)


def load(path):
    with np.load(path) as data:
        return [data[str(i)] for i in range(len(data.files))]


def checkpoints(directory):
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit()) if os.path.isdir(directory) else []


@pytest.mark.slow
def test_sigkilled_run_resumes_bit_identical(tmp_path):
    run_worker(tmp_path / "whole.npz", "--steps", 12)
    directory = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, WORKER, str(tmp_path / "never.npz"), "--directory", str(directory),
         "--steps", "12", "--pause", "0.4"],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    while not [s for s in checkpoints(directory) if s >= 5]:  # step 5: inside a window of 2
        assert process.poll() is None, "worker exited before it could be killed"
        assert time.monotonic() < deadline, "worker made no checkpoint in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = max(checkpoints(directory))
    assert killed_at < 12
    run_worker(tmp_path / "resumed.npz", "--directory", directory, "--steps", 12)
    for a, b in zip(load(tmp_path / "resumed.npz"), load(tmp_path / "whole.npz"), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_eight_devices_train_like_one(tmp_path):
    run_worker(tmp_path / "one.npz", "--steps", 4)
    result = run_worker(tmp_path / "eight.npz", "--steps", 4, devices=8)
    assert "devices 8 done 4" in result.stdout
    for a, b in zip(load(tmp_path / "eight.npz"), load(tmp_path / "one.npz"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_eight_devices_resume_bit_identical_and_refuse_an_indivisible_batch(tmp_path):
    run_worker(tmp_path / "whole.npz", "--steps", 6, devices=8)
    run_worker(tmp_path / "part.npz", "--steps", 3, "--directory", tmp_path / "run", devices=8)
    run_worker(tmp_path / "resumed.npz", "--steps", 6, "--directory", tmp_path / "run", devices=8)
    for a, b in zip(load(tmp_path / "resumed.npz"), load(tmp_path / "whole.npz"), strict=True):
        np.testing.assert_array_equal(a, b)
    failed = run_worker(tmp_path / "bad.npz", "--batch", 6, devices=8, check=False)
    assert failed.returncode != 0
    assert "6 rows, which do not divide into this process's 8 slices of the batch" in failed.stderr
