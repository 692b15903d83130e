"""The Prefect pipeline: every stage end to end, reruns that reuse, retries that resume, faults.

Flows run against Prefect's test harness (a temporary API and database) with a tiny decoder and
a few steps per stage; what they write is checked through the run store, as a user would.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import run_log

pytest.importorskip("prefect")

from pydantic import ValidationError  # noqa: E402

from dew_lib.store import Store  # noqa: E402
from tasks.params import (  # noqa: E402
    DataParams,
    DPOParams,
    EvalParams,
    GRPOParams,
    ModelParams,
    PipelineParams,
    SFTParams,
    command_line,
)

HERE = os.path.dirname(__file__)
ROOT = Path(HERE).resolve().parent
TINY = dict(
    data=dict(train_problems=400, test_problems=20),
    model=dict(emb_features=32, num_layers=1, num_heads=2, mlp_features=64),
    sft=dict(steps=4, batch=4, log_every=2, checkpoint_every=2),
    dpo=dict(steps=2, batch=4, log_every=1, checkpoint_every=1),
    grpo=dict(steps=2, batch=2, groups=4, log_every=1, checkpoint_every=1, max_new_tokens=8),
    evaluation=dict(batch=20, max_new_tokens=8, samples=2),
)


def tiny(root, **changes) -> PipelineParams:
    return PipelineParams(root=str(root), **{**TINY, **changes})


@contextlib.contextmanager
def without_flow_heartbeats():
    """Prefect's flow runs without their heartbeat thread, whose end each flow run waits up to a
    second for (it sleeps in steps of one): half a second on average for each of the dozen flow
    runs of a pipeline. The heartbeats tell a server which flow runs crashed; nothing here reads
    them. Entered after the harness (its settings are a context it stacks on)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture(scope="module")
def harness(prefect_harness):
    """The harness for the tests of the finished run (one worker runs them all, see
    tests/xdist_units.py)."""
    with without_flow_heartbeats():
        yield


@pytest.fixture
def flow_harness(prefect_harness):
    """The harness for a test that runs its own pipeline: a function-scoped fixture, so that
    `pytest -n N` can run such a test on any worker (a module-scoped one would tie it to the
    worker of the finished run)."""
    with without_flow_heartbeats():
        yield


@pytest.fixture(scope="module")
def finished(harness, tmp_path_factory):
    from flows.pipeline import pipeline

    root = tmp_path_factory.mktemp("runs")
    # DPO cuts its 3 steps to 1: a fraction of one pass over its pairs (dpo.max_epochs). Each
    # stage is planned against an H200's memory before it trains.
    planned = dict(device_memory="h200")
    params = tiny(root, sft=dict(TINY["sft"], **planned), dpo=dict(TINY["dpo"], steps=3, max_epochs=0.001, **planned),
                  grpo=dict(TINY["grpo"], **planned))
    with run_log() as lines:
        outcome = pipeline(params)
    return root, params, {**outcome, "log": lines}


def query(root, sql):
    return Store(str(root)).rows(sql)[1]


@pytest.mark.slow
def test_the_pipeline_trains_every_stage_and_records_it(finished):
    root, params, outcome = finished
    assert list(outcome["accuracy"]) == ["start", "sft", "dpo", "grpo"]
    run = outcome["run"]
    stages = dict(query(root, f"SELECT stage, status FROM stages WHERE run = '{run}'"))
    assert {stages[s] for s in ("sft", "dpo", "grpo", "eval-grpo")} == {"completed"}
    # Every GRPO rollout landed with its ids, log-probs, reward and version; every step's metrics too.
    sessions = query(root, f"SELECT count(*), min(reward), max(update) FROM sessions WHERE run = '{run}'")[0]
    assert sessions[0] == 2 * 2 * 4  # steps x prompts x groups
    calls = query(root, f"SELECT len(sampled_ids), len(behavior_log_probs) FROM calls WHERE run = '{run}'")
    assert len(calls) == sessions[0] and all(a == b and a > 0 for a, b in calls)
    steps = dict(query(root, f"SELECT stage, max(step) FROM metrics WHERE run = '{run}' GROUP BY stage"))
    assert steps == {"sft": 4, "dpo": 1, "grpo": 2}
    # Each evaluation is labelled with the step its stage ended at, the steps DPO cut included.
    evaluated = dict(query(root, f"SELECT stage, max(step) FROM evaluations WHERE run = '{run}' GROUP BY stage"))
    assert evaluated == {"eval-start": 0, "eval-sft": 4, "eval-dpo": 1, "eval-grpo": 2}
    # Each held-out prompt's greedy answer (sample 0) and two drawn at temperature 1 landed; the
    # stage's accuracies are their means.
    answers = query(root, f"SELECT stage, sample, temperature, count(*), avg(correct::INT) FROM evaluations "
                          f"WHERE run = '{run}' GROUP BY ALL ORDER BY ALL")
    assert [row[:4] for row in answers] == [(f"eval-{stage}", sample, 0.0 if sample == 0 else 1.0, 20)
                                            for stage in ("dpo", "grpo", "sft", "start")
                                            for sample in range(3)]
    for stage, sample, _, _, accuracy in answers:
        stage = stage.removeprefix("eval-")
        if sample == 0:
            assert accuracy == pytest.approx(outcome["accuracy"][stage])
        else:
            drawn = [a for s, n, _, _, a in answers if s == f"eval-{stage}" and n > 0]
            assert outcome["sampled_accuracy"][stage] == pytest.approx(sum(drawn) / 2)
    # `dew runs`: a training stage's row has its batches' token accuracy, never as held-out; the
    # held-out one is on its evaluation's row, whose seconds cover generating and grading.
    columns, shown = Store(str(root)).runs()
    shown = {row[columns.index("stage")]: dict(zip(columns, row)) for row in shown if row[0] == run}
    assert shown["sft"]["accuracy"] is None and 0 <= shown["sft"]["train_accuracy"] <= 1
    assert shown["eval-sft"]["accuracy"] == pytest.approx(outcome["accuracy"]["sft"], abs=1e-4)
    # (`dew runs` shows tenths of a second, which a warm evaluation of 20 prompts may round to 0)
    took = dict(query(root, f"SELECT stage, epoch(finished_at - started_at) FROM stages WHERE run = '{run}'"))
    assert all(took[f"eval-{stage}"] > 0 and abs(shown[f"eval-{stage}"]["seconds"] - took[f"eval-{stage}"]) <= 0.051
               for stage in outcome["accuracy"])
    # The final policy is a Hugging Face checkpoint that loads back; curves were plotted.
    from dew_lib.models import load_pretrained

    loaded = load_pretrained(outcome["policy"])
    assert loaded.tokenizer is not None and loaded.model.num_layers == 1
    for stage in ("sft", "dpo", "grpo"):
        assert os.path.getsize(os.path.join(root, "demo", stage, "curves.png")) > 1000
    # Each stage's compiled update was planned before it trained, and fitted.
    plans = {line.split(" fits: ")[0]: line for line in outcome["log"] if " fits: " in line}
    assert set(plans) == {"sft", "dpo", "grpo"}
    for stage, rows, width in (("sft", 4, 97), ("dpo", 4, 40), ("grpo", 8, 32)):
        assert f"{stage}: {rows} rows of {width} ids a step on data=1 x fsdp=1 x tensor=1" in plans[stage]
        assert "fits: 0% of the device's 150.8 GB" in plans[stage]


def closing_message(lines) -> str:
    return next(line for line in lines if "| stage | held-out accuracy" in line)


@pytest.mark.slow
def test_a_rerun_with_the_same_inputs_is_the_same_run_and_reuses_every_finished_stage(finished):
    from flows.pipeline import pipeline

    root, params, first = finished
    counts = ("SELECT (SELECT count(*) FROM metrics), (SELECT count(*) FROM sessions), "
              "(SELECT count(*) FROM evaluations), (SELECT count(*) FROM stages)")
    before = query(root, counts)
    with run_log() as lines:
        again = pipeline(params)
    assert again["run"] == first["run"] and again["accuracy"] == first["accuracy"]
    assert set(again["reused"].values()) == {True}
    assert any(line.startswith(f"continuing run {first['run']} (same name, parameters and data files) as its "
                               "next attempt") for line in lines)
    assert query(root, f"SELECT status, attempts FROM runs WHERE run = '{first['run']}'") == [("completed", 2)]
    # Each stage keeps the record of the attempt that did its work; nothing is recorded twice.
    stages = query(root, f"SELECT stage, status, attempt FROM stages WHERE run = '{first['run']}'")
    assert {(status, attempt) for _, status, attempt in stages} == {("completed", 1)}
    evaluated = query(root, f"SELECT step FROM evaluations WHERE run = '{first['run']}' AND stage = 'eval-dpo'")
    assert {step for step, in evaluated} == {1}  # the reused stage's own step count
    assert query(root, counts) == before
    # The closing message names the store and its commands work exactly as printed.
    summary = closing_message(lines)
    assert f"Run store: `{root}` (this run: `{first['run']}`)" in summary
    listed, queried = (subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
                       for command in re.findall(r"^- `(.+)`$", summary, re.M))
    assert listed.returncode == 0 and first["run"] in listed.stdout, listed.stderr
    assert queried.returncode == 0 and queried.stdout.endswith("(7 rows)\n"), queried.stderr
    assert queried.stdout.split()[:4] == ["stage", "|", "kind", "|"]


@pytest.mark.slow
def test_rl_ppo_trains_the_prompts_as_one_turn_episodes_with_a_critic(finished):
    """The finished run again with only rl='ppo': SFT and DPO are reused, the RL stage trains
    with PPO, each prompt one episode of one turn graded by its reward."""
    from flows.pipeline import pipeline

    root, params, _ = finished
    outcome = pipeline(params.model_copy(update={"rl": "ppo"}))
    assert outcome["reused"] == {"start": True, "sft": True, "dpo": True, "ppo": False}
    run = outcome["run"]
    assert query(root, f"SELECT stage, kind FROM stages WHERE run = '{run}' AND stage = 'ppo'") == [("ppo", "ppo")]
    assert os.path.isdir(os.path.join(root, "demo", "ppo", "policy"))  # a directory of its own
    names = {name for (name,) in query(root, f"SELECT DISTINCT name FROM metrics WHERE run = '{run}' "
                                             "AND stage = 'ppo'")}
    # A reply that used its whole budget is truncated and masked; the policy and critic losses
    # have a value only in windows that trained some sampled token (none is written otherwise).
    answered = query(root, f"SELECT count(*) FROM sessions WHERE run = '{run}' AND stage = 'ppo' "
                           "AND status = 'completed'")[0][0]
    assert {"grad_norm", "steps_per_second"} <= names
    assert ({"critic/vf_loss", "critic/vf_explained_var", "pg_loss"} <= names) == (answered > 0)
    turns = query(root, f"SELECT count(*), count(DISTINCT session_uid), max(turn) FROM turns WHERE run = '{run}'")
    sessions = query(root, f"SELECT count(*) FROM sessions WHERE run = '{run}' AND stage = 'ppo'")[0][0]
    assert turns[0][0] == turns[0][1] == sessions == 2 * 2 * 4 and turns[0][2] == 0  # steps x prompts x groups


@pytest.mark.slow
@pytest.mark.parametrize("chosen", [dict(policy_loss="gspo", advantage_estimator="rloo"),
                                    dict(policy_loss="cispo", aggregation="session-mean", kl_estimator="k3")])
def test_the_rl_stage_trains_the_loss_its_options_choose(finished, chosen):
    """The finished run again with GRPO's algorithm changed: SFT and DPO are reused, GRPO trains
    anew in a directory of its own and the store records the choice with its parameters."""
    from flows.pipeline import pipeline

    root, params, first = finished
    outcome = pipeline(params.model_copy(update={"grpo": params.grpo.model_copy(update=chosen)}))
    assert outcome["reused"] == {"start": True, "sft": True, "dpo": True, "grpo": False}
    recorded = json.loads(query(root, f"SELECT params FROM stages WHERE run = '{outcome['run']}' "
                                      "AND stage = 'grpo'")[0][0])
    assert {name: recorded[name] for name in chosen} == chosen
    names = {name for (name,) in query(root, f"SELECT DISTINCT name FROM metrics WHERE run = '{outcome['run']}' "
                                             "AND stage = 'grpo'")}
    assert {"pg_loss", "reward"} <= names
    inputs = sorted(Path(root, "demo", "grpo").glob("*/inputs.json"))
    assert any(json.loads(p.read_text())["inputs"]["params"].get("policy_loss") == chosen["policy_loss"]
               for p in inputs)


@pytest.mark.slow
def test_dpo_and_grpo_train_lora_adapters_the_store_records_them_and_the_stage_keeps_the_adapter(finished):
    """The finished run again with adapters on DPO and GRPO: SFT is reused, both stages train
    rank-4 adapters on their frozen starting policy, the store records rank and targets with
    each stage, and each stage directory holds the adapter as PEFT files beside the merged policy."""
    from dew_lib.models import load_adapter, load_pretrained
    from dew_lib.recipes import LoRAOptions
    from flows.pipeline import pipeline

    root, params, first = finished
    adapters = LoRAOptions(rank=4, alpha=8, targets="all-linear")
    outcome = pipeline(params.model_copy(update={  # adapters start at B = 0: a rate they move at
        "dpo": params.dpo.model_copy(update={"lora": adapters, "learning_rate": 1e-2}),
        "grpo": params.grpo.model_copy(update={"lora": adapters})}))
    assert outcome["reused"] == {"start": True, "sft": True, "dpo": False, "grpo": False}
    rows = query(root, f"SELECT stage, json_extract(params, '$.lora.rank')::INT, "
                       f"json_extract_string(params, '$.lora.targets') FROM stages "
                       f"WHERE run = '{outcome['run']}' AND kind IN ('dpo', 'grpo') ORDER BY stage")
    assert rows == [("dpo", 4, "all-linear"), ("grpo", 4, "all-linear")]
    for stage in ("dpo", "grpo"):
        adapter = Path(root, "demo", stage, "adapter")
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"]) == (4, 8)
        assert sorted(config["target_modules"]) == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        merged = load_pretrained(Path(root, "demo", stage, "policy"), tokenizer=False)
        assert getattr(merged.model, "lora", None) is None  # a plain checkpoint, adapters folded in
        start = load_pretrained(config["base_model_name_or_path"], tokenizer=False)  # the stage's start
        model, variables = load_adapter(adapter, start.model, start.variables)
        ids = np.arange(1, 17, dtype=np.int32)[None]
        np.testing.assert_allclose(model.apply(variables, ids), merged.model.apply(merged.variables, ids), atol=1e-5)
        if stage == "dpo":  # moved by its step (GRPO's tiny policy earns no reward: no gradient)
            assert not np.allclose(start.model.apply(start.variables, ids), model.apply(variables, ids), atol=1e-4)


@pytest.mark.slow
def test_a_failed_training_task_is_retried_and_resumes_from_its_checkpoint(flow_harness, tmp_path, monkeypatch):
    from dew_lib.train import trainer
    from flows.pipeline import pipeline
    from tasks import ui

    starts = []
    original_start = trainer._Run._start_state

    def recording_start(self, state):
        started = original_start(self, state)  # (state, position, ...)
        starts.append(started[1])
        return started

    failed = []
    original_write = ui.Deadline.write

    def failing_write(self, step, metrics):
        original_write(self, step, metrics)
        if self.stage == "sft" and step == 3 and not failed:
            failed.append(step)
            raise RuntimeError("injected failure after the step-2 checkpoint")

    monkeypatch.setattr(trainer._Run, "_start_state", recording_start)
    monkeypatch.setattr(ui.Deadline, "write", failing_write)
    params = tiny(tmp_path, stages=("sft",), sft=dict(steps=4, batch=4, log_every=1, checkpoint_every=2))
    outcome = pipeline(params)
    assert failed == [3] and starts == [0, 2]  # the retry continued at the last checkpoint
    run = outcome["run"]
    attempts = query(tmp_path, f"SELECT attempt FROM stages WHERE run = '{run}' AND stage = 'sft'")
    assert attempts == [(2,)]
    rows = query(tmp_path, f"SELECT step, count(*) FROM metrics WHERE run = '{run}' AND stage = 'sft' "
                           "AND name = 'loss' GROUP BY step ORDER BY step")
    assert rows == [(1, 1), (2, 1), (3, 1), (4, 1)]  # the failed attempt's step 3 was replaced, not doubled


def test_a_stage_that_outgrows_its_device_memory_is_refused_before_it_trains(flow_harness, tmp_path):
    from flows.pipeline import pipeline

    params = tiny(tmp_path, stages=("sft",), sft=dict(TINY["sft"], device_memory="100000"))
    with pytest.raises(Exception, match=r"sft does not fit a device's 100,000 bytes \(device_memory='100000'\), "
                                        "so it was not started") as refused:
        pipeline(params)
    message = str(refused.value)
    assert "sft: 4 rows of 97 ids a step on data=1 x fsdp=1 x tensor=1" in message
    assert "does NOT fit" in message and "shrinks with the mesh's fsdp (now 1)" in message
    assert not list(tmp_path.rglob("checkpoints/*")), "the stage trained"
    (status, error), = query(tmp_path, "SELECT status, error FROM stages WHERE stage = 'sft'")
    assert status == "failed" and "does not fit" in error
    with pytest.raises(ValidationError, match="device_memory='h900' is neither a known device"):
        SFTParams(device_memory="h900")


@pytest.mark.slow
def test_a_stage_that_keeps_failing_fails_the_run_with_its_cause(flow_harness, tmp_path, monkeypatch):
    from flows.pipeline import pipeline
    from tasks import ui

    def broken(self, step, metrics):
        raise RuntimeError("the disk is full")

    monkeypatch.setattr(ui.Deadline, "write", broken)
    params = tiny(tmp_path, stages=("sft",), sft=dict(steps=2, batch=4, log_every=1))
    with pytest.raises(RuntimeError, match="the disk is full"):
        pipeline(params)
    (status, error), = query(tmp_path, "SELECT status, error FROM stages WHERE stage = 'sft'")
    assert status == "failed" and "the disk is full" in error
    (run_status,), = query(tmp_path, "SELECT status FROM runs")
    assert run_status == "failed"


@pytest.mark.slow
def _pipeline_process(params, *options):
    """Run the pipeline in tests/pipeline_worker.py: (exit code, stdout, stderr). Its flow runs
    report to the harness's API, as to a configured server, instead of a temporary server of its
    own, which took it a dozen seconds to start."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_HOME": str(params.root) + "-prefect", "PYTHONPATH": os.path.dirname(HERE),
           "PREFECT_API_URL": PREFECT_API_URL.value()}
    command = [sys.executable, os.path.join(HERE, "pipeline_worker.py"), params.model_dump_json(), *options]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, env=env, start_new_session=True, text=True, stdout=out,
                                   stderr=err)
        try:
            process.wait(timeout=900)
        finally:
            _kill_group(process)  # whatever it started, should a test fail before it ends
        out.seek(0)
        err.seek(0)
        return process.returncode, out.read(), err.read()


def _answers(root) -> dict:
    """What the README's and docs/store.md's queries answer, with the run id spelled RUN, except
    those about time (latency, waits, seconds). Without their LIMIT and sorted: rows that tie in
    a query's order come in either order."""
    blocks = [sql for doc in ("README.md", "docs/store.md")
              for sql in re.findall(r"```sql\n(.*?)```", (ROOT / doc).read_text(), re.S)]
    statements = [s.strip() for block in blocks for s in block.split(";") if s.strip()]
    timeless = [s for s in statements if not re.search(r"latency|waited|seconds|_at\b", s)]
    assert len(timeless) >= 10
    store = Store(str(root))
    (run,), = store.rows("SELECT run FROM runs")[1]
    answers = {}
    for sql in timeless:
        rows = store.rows(re.sub(r"\s+LIMIT \d+", "", sql))[1]
        answers[sql] = sorted((tuple("RUN" if value == run else value for value in row) for row in rows), key=repr)
    return answers


@pytest.mark.slow
def test_a_killed_pipeline_continues_as_the_same_run_and_its_queries_answer_as_if_never_killed(flow_harness,
                                                                                               tmp_path):
    from flows.pipeline import pipeline

    shape = dict(stages=("sft", "grpo"), sft=dict(steps=4, batch=4, log_every=1, checkpoint_every=2),
                 grpo=dict(steps=4, batch=2, groups=4, log_every=1, checkpoint_every=2, max_new_tokens=8))
    pipeline(tiny(tmp_path / "whole", **shape))  # the run never killed, in this process: it raises if it fails
    broken = tiny(tmp_path / "broken", **shape)
    code, _, _ = _pipeline_process(broken, "--kill-at", "grpo:3")
    assert code == -signal.SIGKILL
    assert sorted(os.listdir(tmp_path / "broken" / "demo" / "grpo" / "latest" / "checkpoints")) == ["2"]
    code, out, err = _pipeline_process(broken)
    assert code == 0, err[-2000:]
    assert "grpo resumes from its checkpoint at step 2" in err and "continuing run" in err
    columns, rows = Store(str(tmp_path / "broken")).runs()
    stages = {row[columns.index("stage")]: dict(zip(columns, row)) for row in rows}
    assert {(s["run"], s["status"], s["attempts"], s["stage_status"]) for s in stages.values()} == {
        (json.loads(out.strip().splitlines()[-1])["run"], "completed", 2, "completed")}
    # sft finished in the first attempt and keeps that record; grpo was redone from step 2
    assert (stages["sft"]["attempt"], stages["grpo"]["attempt"], stages["eval-start"]["attempt"]) == (1, 2, 1)
    assert query(tmp_path / "broken", "SELECT count(*) - count(DISTINCT (stage, step, name)) FROM metrics") == [(0,)]
    assert _answers(tmp_path / "broken") == _answers(tmp_path / "whole")


def _kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_bad_parameters_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValidationError, match="steps"):
        SFTParams(steps=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        GRPOParams(group=4)
    with pytest.raises(ValidationError, match="does not exist"):
        DataParams(source="files", eval_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValidationError, match="not a Hugging Face checkpoint directory"):
        ModelParams(pretrained=str(tmp_path))
    with pytest.raises(ValidationError, match="pattern"):
        PipelineParams(name="../elsewhere")
    assert DPOParams().beta > 0 and EvalParams().batch > 0


def test_the_command_line_sets_name_root_and_seed_and_checks_them():
    given = command_line(["--name", "mine", "--seed", "3"], PipelineParams(), prog="python -m flows",
                         description="")
    assert (given.name, given.root, given.seed) == ("mine", "runs", 3) and given.sft == SFTParams()
    with pytest.raises(ValidationError, match="pattern"):
        command_line(["--name", "../elsewhere"], PipelineParams(), prog="python -m flows", description="")


@pytest.mark.slow
def test_an_unwritable_store_fails_at_the_start_naming_the_path(flow_harness, tmp_path):
    from flows.pipeline import pipeline

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(Exception, match="a-file"):
        pipeline(tiny(blocker / "runs"))


def test_the_command_line_reads_a_parameters_file_that_name_root_and_seed_override(tmp_path):
    form = tmp_path / "gsm8k.json"  # the UI form's fields
    form.write_text(json.dumps({"name": "gsm8k", "seed": 5, "sft": {"steps": 7},
                                "evaluation": {"limit": 3}}))
    given = command_line(["--params", str(form)], PipelineParams(), prog="python -m flows", description="")
    assert (given.name, given.seed, given.sft.steps, given.sft.batch, given.evaluation.limit) == \
        ("gsm8k", 5, 7, SFTParams().batch, 3)
    wrapped = tmp_path / "deployment.yaml"  # a deployment's {"params": {...}}, in YAML
    wrapped.write_text("params:\n  name: gsm8k\n  sft: {steps: 7}\n")
    given = command_line(["--params", str(wrapped), "--name", "mine", "--root", str(tmp_path), "--seed", "2"],
                         PipelineParams(), prog="python -m flows", description="")
    assert (given.name, given.root, given.seed, given.sft.steps) == ("mine", str(tmp_path), 2, 7)


def test_a_bad_parameters_file_is_refused_naming_the_file_or_the_field(tmp_path, capsys):
    with pytest.raises(SystemExit):
        command_line(["--params", str(tmp_path / "missing.json")], PipelineParams(), prog="python -m flows",
                     description="")
    assert "missing.json" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": "x",')
    with pytest.raises(SystemExit):
        command_line(["--params", str(broken)], PipelineParams(), prog="python -m flows", description="")
    assert "broken.json is not JSON" in capsys.readouterr().err
    listed = tmp_path / "list.yaml"
    listed.write_text("- name: x\n")
    with pytest.raises(SystemExit):
        command_line(["--params", str(listed)], PipelineParams(), prog="python -m flows", description="")
    assert "list.yaml holds a list; a parameters file is a mapping of fields" in capsys.readouterr().err
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"data": {"colums": {"prompt": "question"}}}))
    with pytest.raises(ValidationError, match=r"data.colums\n  Extra inputs are not permitted"):
        command_line(["--params", str(typo)], PipelineParams(), prog="python -m flows", description="")


@pytest.mark.slow
def test_sampled_keys_repeats_the_runs_own_draws_under_its_key(finished, capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import sampled_keys

    from dew_lib.models.pretrained import load_pretrained
    from tasks.data import read_eval

    root, params, outcome = finished
    data, policy = root / "demo" / "data", root / "demo" / "sft" / "latest" / "policy"
    rows = read_eval(str(data / "eval.jsonl"))
    # Key 0 is the run's own evaluation.seed: the same draws, answer for answer.
    drawn = sampled_keys.drawn_answers(*load_pretrained(policy), rows, params.evaluation, key=0)
    stored = query(root, f"SELECT answer FROM evaluations WHERE run = '{outcome['run']}' AND stage = 'eval-sft' "
                         "AND sample > 0 ORDER BY sample, item")
    assert drawn == [answer for answer, in stored]
    assert drawn != sampled_keys.drawn_answers(*load_pretrained(policy), rows, params.evaluation, key=1)
    evaluation = params.evaluation
    assert sampled_keys.main([str(data), str(policy), "--keys", "2", "--samples", str(evaluation.samples),
                              "--batch", str(evaluation.batch),
                              "--max-new-tokens", str(evaluation.max_new_tokens)]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert header == "right draws of 20 prompts x 2 under keys 1..2"
    first, second = (int(n) for n in line.removeprefix(f"{policy}: ").split()[:2])
    assert line.endswith(f"total {first + second} of 80 ({100 * (first + second) / 80:.2f}%)")
