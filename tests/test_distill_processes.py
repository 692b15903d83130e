"""The distill stage as a job of two processes (tasks/stage_job.py) against one process on the
same two CPU devices.

Both run the stage body as the training task's job does (`python -m tasks.stage_job job.json`,
no Prefect): one process with two host devices, and `run_job`'s two processes of one device each,
on the same student, teacher and arithmetic prompts. With `batch=2` each process of the job
reads one prompt a step, `order[index::2]`, which is the single process's batch in the same order,
so both train on the same global batches. Every process draws the job's whole batch from the
same key and keeps its own rows (DistillRollout, as SampledRollout), so the two draw the same
completions; the per-step `loss` and `kl`, the sessions' rewards and the final parameters agree to
float32 rounding (test_distributed's tolerance: the gradient's sum runs over gloo in the job), and
process 0 records every session of the global batch, as one process does.
"""

import logging
import sys

import jax
import numpy as np
import pytest
from conftest import xla_flags
from test_distributed import ROUNDING
from test_pipeline import TINY, query
from test_pipeline_distill import check_sessions, save_decoder

from dew_lib.data.tokenizer import load_tokenizer
from dew_lib.models import load_pretrained
from dew_lib.train.launch import launch
from tasks.data import generate_arithmetic
from tasks.manifests import PolicyRef
from tasks.params import DataParams, DistillParams
from tasks.stage_job import ENTRY, ROOT, StageJob, run_job
from tasks.storage import write_json

STEPS, BATCH = 3, 2
STAGE = dict(steps=STEPS, batch=BATCH, max_new_tokens=8, learning_rate=1e-2, log_every=1, checkpoint_every=STEPS)


def stage_job(root, name: str, data, student: str, teacher: str, processes: int) -> StageJob:
    params = DistillParams(teacher=teacher, processes=processes, **STAGE)
    directory = root / name
    directory.mkdir()
    return StageJob(stage="distill", kind="distill", params=params.model_dump(mode="json"), data=data,
                    start=PolicyRef(path=student, fingerprint="student"), directory=str(directory), key=name,
                    store_root=str(directory / "store"), run=name, seed=0)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The stage in one process on two host devices, and as a job of two processes of one each."""
    root = tmp_path_factory.mktemp("distill-jobs")
    data = generate_arithmetic(DataParams(**TINY["data"]), str(root / "data"), seed=0)
    tokenizer = load_tokenizer(data.tokenizer)
    teacher = save_decoder(root / "teacher", vocab_size=len(tokenizer), emb_features=64, num_layers=2,
                           tokenizer=tokenizer, seed=2)
    student = save_decoder(root / "student", vocab_size=len(tokenizer), emb_features=32, num_layers=1,
                           tokenizer=tokenizer, seed=1)
    one = stage_job(root, "one", data, student, teacher, processes=1)
    two = stage_job(root, "two", data, student, teacher, processes=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XLA_FLAGS", xla_flags())  # no host device count: each process of the job has one CPU device
        patch.setenv("PYTHONPATH", ROOT)
        path = str(root / "one" / "job.json")
        write_json(path, one.model_dump(mode="json"))
        with open(root / "one" / "job.log", "w") as out:
            assert launch([sys.executable, *ENTRY, path], 1, local_devices=2, out=out) == 0, \
                (root / "one" / "job.log").read_text()[-4000:]
        run_job(two, 2, logging.getLogger(__name__))
    return root, one, two


def metrics(job) -> dict:
    rows = query(f"{job.directory}/store", f"SELECT name, step, value FROM metrics WHERE run = '{job.run}' "
                                           "AND name IN ('loss', 'kl') ORDER BY name, step")
    return {(name, step): value for name, step, value in rows}


def sessions(job) -> list:
    return query(f"{job.directory}/store", f"SELECT s.update, s.group_id, s.sample, s.task, s.reward, c.sampled_ids "
                                           f"FROM sessions s JOIN calls c ON c.run = s.run AND c.session_uid = "
                                           f"s.session_uid WHERE s.run = '{job.run}' ORDER BY ALL")


@pytest.mark.slow
def test_two_processes_distil_like_one_process_on_the_same_two_devices(jobs):
    root, one, two = jobs
    log = (root / "two" / "job.log").read_text()
    assert f"[0] distill step {STEPS}:" in log and "[1] " in log and "[1] distill step" not in log
    first, second = metrics(one), metrics(two)
    assert sorted(first) == sorted(second) == [(name, step) for name in ("kl", "loss") for step in range(1, STEPS + 1)]
    np.testing.assert_allclose([second[k] for k in sorted(first)], [first[k] for k in sorted(first)], **ROUNDING)
    # The same draws: each session's prompt, sampled ids and reward, under the same global group.
    drawn, drawn_apart = sessions(one), sessions(two)
    assert [row[:4] for row in drawn] == [row[:4] for row in drawn_apart]
    assert all(np.array_equal(a[5], b[5]) for a, b in zip(drawn, drawn_apart, strict=True))
    np.testing.assert_allclose([r[4] for r in drawn_apart], [r[4] for r in drawn], **ROUNDING)
    # The final parameters, as each policy was saved.
    leaves = [jax.tree.leaves(load_pretrained(f"{job.directory}/policy")[1]) for job in (one, two)]
    assert len(leaves[0]) == len(leaves[1])
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), **ROUNDING)


@pytest.mark.slow
def test_process_0_records_every_session_of_the_global_batch(jobs):
    root, _, two = jobs
    store = f"{two.directory}/store"
    # steps x batch sessions, whose rewards weighted by length give back each step's kl.
    check_sessions(store, two.run, STEPS, BATCH)
    groups = query(store, f"SELECT update, group_id, count(*) FROM sessions WHERE run = '{two.run}' "
                          "GROUP BY ALL ORDER BY ALL")
    assert groups == [(update, group, 1) for update in range(STEPS) for group in range(BATCH)]
    missing = query(store, f"SELECT count(*) FROM sessions s ANTI JOIN prompts p ON s.run = p.run AND "
                           f"s.stage = p.stage AND s.task = p.task WHERE s.run = '{two.run}'")
    assert missing == [(0,)]
    assert query(store, f"SELECT status FROM stages WHERE run = '{two.run}' AND stage = 'distill'") == [("completed",)]


def test_the_distill_stage_takes_several_processes_when_its_batch_divides():
    assert DistillParams(processes=2, batch=8).processes == 2
    with pytest.raises(ValueError, match="batch=3 does not divide across processes=2"):
        DistillParams(processes=2, batch=3)
