"""A run refused before it trains says why once: `python -m flows` with a parameters file whose
lengths cannot fit prints the reason one time, no traceback, and exits with status 1; Prefect does
not retry a refusal, which a retry cannot fix, but still retries other failures."""

import json
import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("prefect")

from tasks.refusals import QuietRefusals, RunRefused, refusal_in  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"data": {"train_problems": 400, "test_problems": 20},
        "model": {"emb_features": 32, "num_layers": 1, "num_heads": 2, "mlp_features": 64}}


def python_m_flows(tmp_path, params: dict) -> tuple[int, str]:
    """`python -m flows --params FILE` as `make run` starts it: (exit status, stdout and stderr)."""
    path = tmp_path / "params.json"
    path.write_text(json.dumps(params))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # not the harness's API
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, PREFECT_HOME=str(tmp_path / "prefect"))
    done = subprocess.run([sys.executable, "-m", "flows", "--params", str(path), "--root", str(tmp_path / "runs")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
def test_lengths_that_cannot_fit_are_refused_once_without_a_traceback(tmp_path):
    code, output = python_m_flows(tmp_path, {**TINY, "sft": {"max_length": 12}})
    assert code == 1, output[-3000:]
    assert "Traceback" not in output
    assert output.count("the run's lengths do not fit its data") == 1
    assert output.count("more than data.max_truncated=0.01 allows") == 1
    assert output.rstrip().splitlines()[-2:] == [
        "python -m flows: the run's lengths do not fit its data:",
        f"- sft.max_length=12 cuts 200 of 200 SFT conversations (100.0%) in {tmp_path}/runs/demo/data/chat.jsonl, "
        "more than data.max_truncated=0.01 allows. sft.max_length=34 cuts none of them (the longest has 34 ids); "
        "model.max_seq_len=128 must hold sft.max_length - 1 too. Raise sft.max_length, or accept the cut with "
        "data.max_truncated=1"]
    # What each length cuts is still logged before the refusal, once.
    assert output.count("sft.max_length=12 cuts 200 of 200 SFT conversations (100.0%)") == 2


@pytest.mark.slow
def test_parameters_that_do_not_validate_are_one_message(tmp_path):
    code, output = python_m_flows(tmp_path, {"sft": {"max_length": 8}})
    assert code == 1 and "Traceback" not in output
    assert output.count("Input should be greater than or equal to 9") == 1
    assert "python -m flows: 1 validation error for PipelineParams\nsft.max_length\n" in output


@pytest.fixture(scope="module")
def harness(prefect_harness):
    yield


def test_a_refusal_is_not_retried_and_other_failures_are(harness):
    from prefect import flow, task

    from tasks.refusals import retry_unless_refused

    calls = []

    @task(retries=2, retry_condition_fn=retry_unless_refused)
    def failing(error: Exception):
        calls.append(type(error).__name__)
        raise error

    @flow
    def run(error: Exception):
        failing(error)

    with pytest.raises(RunRefused, match="no eval_path"):
        run(RunRefused("no eval_path"))
    assert calls == ["RunRefused"]
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        run(OSError("disk full"))
    assert calls == ["OSError"] * 3


def record(message: str, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = None if error is None else (type(error), error, None)
    return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, message, (), exc_info)


def test_the_console_leaves_out_only_the_records_about_a_refusal():
    quiet = QuietRefusals()
    refused = RunRefused("lengths")
    assert not quiet.filter(record("Task run failed with exception", refused))
    assert not quiet.filter(record("Finished in state Failed('Task run encountered an exception RunRefused: x')"))
    wrapped = RuntimeError("flow failed")
    wrapped.__cause__ = refused
    assert not quiet.filter(record("Encountered exception during execution", wrapped))
    assert quiet.filter(record("Task run failed with exception", RuntimeError("the disk is full")))
    assert quiet.filter(record("sft.max_length=12 cuts 200 of 200 SFT conversations"))
    assert refusal_in(wrapped) is refused and refusal_in(RuntimeError("x")) is None
