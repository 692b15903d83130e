"""A pipeline stage as a job of several processes (`processes`, tasks/stage_job.py): SFT, DPO and
sync GRPO each train as two processes that the task launches and waits for; process 0 records the
stage, its metrics and every process's GRPO sessions in the store and saves the policy; a job
whose process is killed is retried by the task and resumes from its checkpoint; a rerun reuses
the stages. PPO, tool episodes and asynchronous GRPO as jobs: tests/test_rl_processes.py, with
the helpers here.

One TINY pipeline (tests/test_pipeline.py), one host device per process, serves the slow tests:
each job launch costs about 20 s of imports and compilation on two cores, so the kill happens in
its SFT stage rather than in a pipeline of its own.
"""

import json
import os
import re
import signal

import pytest

pytest.importorskip("prefect")

from pydantic import ValidationError  # noqa: E402
from test_pipeline import query, tiny  # noqa: E402
from test_retrain_rules import run_log, said  # noqa: E402

from tasks.manifests import DataManifest, PolicyRef  # noqa: E402
from tasks.params import DPOParams, GRPOParams, PipelineParams, SFTParams, command_line  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "stage_job_worker.py")
STAGES = ("sft", "dpo", "grpo")
TWO = dict(sft=dict(steps=4, batch=4, log_every=1, checkpoint_every=2, processes=2),
           dpo=dict(steps=2, batch=4, log_every=1, checkpoint_every=1, processes=2, mesh="fsdp=2"),
           grpo=dict(steps=2, batch=2, groups=4, log_every=1, checkpoint_every=1, max_new_tokens=8, processes=2))


def run_with_a_crash(params: PipelineParams, process: int, step: int):
    """Run the pipeline `params` describes with every job's processes run by
    tests/stage_job_worker.py: process `process` of the first job to read the batch of `step`
    kills itself (SIGKILL) there, once. Returns the outcome and the run log's lines."""
    from flows.pipeline import pipeline
    from tasks import stage_job

    marker = os.path.join(params.root, "crashed")
    with pytest.MonkeyPatch.context() as patch, run_log() as lines:
        patch.setattr(stage_job, "ENTRY", (WORKER,))
        patch.setenv("DEW_TEST_CRASH", f"{marker}:{process}:{step}")
        outcome = pipeline(params)
    assert os.path.exists(marker), "no process was killed"
    return outcome, lines


def killed_and_resumed(lines, stage: str, checkpoint: int) -> bool:
    """Whether the log says process 1 of `stage`'s job was killed and the retry resumed it
    from the checkpoint of step `checkpoint`."""
    return (any(f"process 1 exited with signal {signal.SIGKILL.name}; ended the other 1" in line for line in lines)
            and bool(said(lines, stage, "trains from scratch"))
            and bool(said(lines, stage, f"resumes from its checkpoint at step {checkpoint}")))


@pytest.fixture(scope="module")
def finished(prefect_harness, tmp_path_factory):
    """The TINY pipeline with every stage a job of two processes, DPO's under FSDP over both
    (each process holds half of every weight); process 1 of the SFT job is
    killed (SIGKILL) as it reads the batch of step 4, after the checkpoint of step 2, once
    (tests/stage_job_worker.py)."""
    root = tmp_path_factory.mktemp("runs")
    return root, *run_with_a_crash(tiny(root, **TWO), process=1, step=4)


@pytest.mark.slow
def test_each_stage_trains_as_a_job_of_two_processes_and_process_0_records_it(finished):
    root, outcome, lines = finished
    run = outcome["run"]
    assert outcome["reused"] == {"start": False, "sft": False, "dpo": False, "grpo": False}
    stages = dict(query(root, f"SELECT stage, status FROM stages WHERE run = '{run}'"))
    assert {stages[s] for s in STAGES} == {"completed"}
    # Each logged window once (process 0 writes, the other writes nothing), at every step.
    rows = query(root, f"SELECT stage, step, count(*) FROM metrics WHERE run = '{run}' AND name = 'loss' "
                       "GROUP BY ALL ORDER BY ALL")
    assert rows == [("dpo", 1, 1), ("dpo", 2, 1), ("grpo", 1, 1), ("grpo", 2, 1),
                    *(("sft", step, 1) for step in range(1, 5))]
    # Every session of the global batch, from both processes: steps x prompts x groups, each
    # prompt row of the batch (group_id) once per update, with its prompt recorded.
    sessions = query(root, f"SELECT update, group_id, count(*) FROM sessions WHERE run = '{run}' "
                           "GROUP BY ALL ORDER BY ALL")
    assert sessions == [(update, group, 4) for update in (0, 1) for group in (0, 1)]
    missing = query(root, f"SELECT count(*) FROM sessions s ANTI JOIN prompts p ON s.run = p.run AND "
                          f"s.stage = p.stage AND s.task = p.task WHERE s.run = '{run}'")
    assert missing == [(0,)]
    policies = query(root, f"SELECT stage, path FROM checkpoints WHERE run = '{run}' AND kind = 'policy'")
    assert sorted(s for s, _ in policies) == sorted(STAGES)
    from dew_lib.models import load_pretrained

    for stage, path in policies:
        directory = os.path.dirname(path)
        assert load_pretrained(path).model.num_layers == 1
        result = json.load(open(os.path.join(directory, "result.json")))
        assert result["result"]["policy"]["path"] == path
        inputs = json.load(open(os.path.join(directory, "inputs.json")))["inputs"]["params"]
        assert inputs["processes"] == 2 and "mesh" not in inputs
        log = open(os.path.join(directory, "job.log")).read()
        assert f"[0] {stage} step {TWO[stage]['steps']}:" in log and "[1] " in log
        assert f"[1] {stage} step" not in log  # only process 0 logs metric windows
        assert os.path.getsize(os.path.join(directory, "curves.png")) > 1000
    # The task logged the job's lines through its logger.
    assert said(lines, "grpo", "trains as a job of 2 processes")
    assert any(line.startswith("[0] grpo step 2:") for line in lines)


@pytest.mark.slow
def test_a_job_whose_process_was_killed_was_retried_and_resumed_from_its_checkpoint(finished):
    root, outcome, lines = finished
    assert killed_and_resumed(lines, "sft", checkpoint=2)
    run = outcome["run"]
    attempts = dict(query(root, f"SELECT stage, attempt FROM stages WHERE run = '{run}'"))
    assert (attempts["sft"], attempts["dpo"], attempts["grpo"]) == (2, 1, 1)
    log = open(os.path.join(root, "demo", "sft", "latest", "job.log")).read()
    starts = [line for line in log.splitlines() if line.startswith("--- ")]
    assert [line.split(": ", 1)[1] for line in starts] == ["2 processes, from step 0",
                                                          "2 processes, resuming at step 2"]
    retried = log.split("resuming at step 2")[1]
    assert "[0] sft step 3:" in retried and "[0] sft step 1:" not in retried
    # The steps the killed attempt logged after its checkpoint were replaced, not counted twice
    # (the metrics query of the test above).


@pytest.mark.slow
def test_a_rerun_with_the_same_inputs_reuses_the_stages_the_jobs_trained(finished):
    from flows.pipeline import pipeline

    root, first, _ = finished
    recorded = query(root, f"SELECT count(*) FROM metrics WHERE run = '{first['run']}'")
    with run_log() as lines:
        again = pipeline(tiny(root, **TWO))
    assert again["reused"] == {"start": True, "sft": True, "dpo": True, "grpo": True}
    assert again["accuracy"] == first["accuracy"] and again["policy"] == first["policy"]
    assert not any("trains as a job" in line for line in lines)
    # The same run's next attempt, which records nothing twice.
    assert again["run"] == first["run"]
    assert query(root, f"SELECT count(*) FROM metrics WHERE run = '{again['run']}'") == recorded


def test_processes_is_checked_and_every_rl_stage_may_take_several():
    with pytest.raises(ValidationError, match="processes\n  Input should be greater than or equal to 1"):
        SFTParams(processes=0)
    with pytest.raises(ValidationError, match="batch=6 does not divide across processes=4"):
        DPOParams(batch=6, processes=4)
    assert GRPOParams(processes=2, mode="async").processes == 2  # tests/test_rl_processes.py trains these
    assert PipelineParams(rl="ppo", grpo=dict(processes=2)).grpo.processes == 2
    PipelineParams(data=dict(source="tools"), stages=("sft", "grpo"), grpo=dict(processes=2),
                   tools=dict(max_prompt_len=40), model=dict(max_seq_len=128))
    assert GRPOParams(processes=2).processes == 2 and SFTParams().processes == 1


def test_processes_enters_the_fingerprint_only_above_one():
    from tasks.stage_run import stage_inputs

    data = DataManifest(directory="d", tokenizer=None, chat_path=None, chat_val_path=None, pairs_path=None,
                        prompts_path=None, eval_path="e", fingerprint="data")
    start = PolicyRef(path="p", fingerprint="start")
    one, inputs = stage_inputs("sft", SFTParams(steps=4, batch=4), data, start, 0)
    # What the key was before the field existed (computed by the code before it), so the stages of
    # earlier runs are still reused.
    assert one == "88151340d460851c" and "processes" not in inputs["params"]
    grpo = GRPOParams(steps=2, batch=2, groups=4, learning_rate=2e-5)  # the default rate then
    assert stage_inputs("grpo", grpo, data, start, 0)[0] == "430d7c8acd6c3d49"
    two, inputs = stage_inputs("sft", SFTParams(steps=4, batch=4, processes=2), data, start, 0)
    assert two != one and inputs["params"]["processes"] == 2
    # Where the state lives is not an input: a stage resumes under another mesh.
    assert stage_inputs("sft", SFTParams(steps=4, batch=4, mesh="fsdp=2"), data, start, 0)[0] == one


def test_a_mesh_that_cannot_be_read_is_refused_naming_the_form():
    with pytest.raises(ValidationError, match=r"cannot read the mesh 'fsdp 2'.*'data=2,fsdp=2,tensor=2'"):
        SFTParams(mesh="fsdp 2")


def test_the_parameters_file_in_the_docs_sets_processes(tmp_path):
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "pipeline.md")).read()
    block = re.search(r"```yaml\n(# python -m flows --params processes.yaml\n.*?)```", text, re.S)[1]
    (tmp_path / "processes.yaml").write_text(block)
    params = command_line(["--params", str(tmp_path / "processes.yaml")], PipelineParams(), prog="python -m flows",
                          description="")
    assert (params.sft.processes, params.dpo.processes, params.grpo.processes) == (2, 2, 2)


def test_each_process_s_session_arguments_join_into_one_per_session():
    from tasks.stage_job import _joined

    assert _joined([None, None], [2, 1]) is None
    assert _joined(["admitted", "admitted"], [2, 1]) == "admitted"
    assert _joined([[0.5, 0.25], [0.125]], [2, 1]) == [0.5, 0.25, 0.125]
    assert _joined([True, [False]], [2, 1]) == [True, True, False]
    assert _joined(["admitted", "cut"], [1, 2]) == ["admitted", "cut", "cut"]


def test_the_processes_scheduler_records_of_an_update_merge_into_one():
    from dew_lib.records.scheduler import SchedulerRecord
    from tasks.job_records import merged_record

    def record(groups, version, waited, **metrics):
        return SchedulerRecord(updates=5, version=version, lag=5 - version, groups=groups,
                               resubmitted={"timeout": 1}, cancelled=1, abandoned=0, cut=groups - 1,
                               waited=waited, metrics=metrics)

    merged = merged_record([record(3, 4, 0.5, **{"reward/mean": 1.0, "latency/max": 2.0, "sessions/reused": 2.0}),
                            record(1, 3, 1.5, **{"reward/mean": 0.0, "latency/max": 3.0, "sessions/reused": 1.0})])
    assert (merged.updates, merged.version, merged.lag, merged.groups, merged.cut) == (5, 3, 2, 4, 2)
    assert (merged.resubmitted, merged.cancelled, merged.waited) == ({"timeout": 2}, 2, 1.5)
    assert merged.metrics == {"reward/mean": 0.75, "latency/max": 3.0, "sessions/reused": 3.0}


def test_an_async_stage_s_records_wait_for_the_end_of_the_trainer_call():
    from dew_lib.records.sessions import Task
    from tasks.job_records import DeferredWriter

    written = []

    class Writer:
        def prompts(self, prompts, *, update):
            written.append(("prompts", [p.prompt for p in prompts], update))

        def sessions(self, sessions, *, update, **given):
            written.append(("sessions", sessions, update))

        def record(self, record):
            written.append(("record", record))

    kept = DeferredWriter(Writer())
    task = Task("7", {"prompt_ids": [1, 2]})
    assert kept.prompts([task], update=0, decode=lambda ids: f"ids {ids.tolist()}") == 1
    assert kept.has_prompt("7") and kept.prompts([task], update=0) == 0  # handed on once
    kept.sessions(["s"], update=0, causes="admitted")
    assert written == []  # nothing until the call ends
    packed = kept.after_each(lambda state, batch, key: "packed")(None, None, None)
    assert packed == "packed" and written == [("prompts", ["ids [1, 2]"], 0), ("sessions", ["s"], 0)]
