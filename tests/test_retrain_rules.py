"""Which stages a rerun trains: changed inputs retrain the stage and every later one, in a
directory of their own, and never resume a checkpoint written under other inputs.

The fast tests check the directory rule (tasks/storage.py `stage_directory`) on its own; the
slow ones change one input group of one finished TINY pipeline (tests/test_pipeline.py) at a
time, under the same name and root, and read the log and the closing table's `reused` column.
"""

import os

import pytest

pytest.importorskip("prefect")

from conftest import run_log  # noqa: E402, F401 - test_stage_processes imports it from here
from test_pipeline import query, tiny, without_flow_heartbeats  # noqa: E402

from tasks.storage import changes, continue_shorter, read_json, rebased, stage_directory, write_json  # noqa: E402

LINKS = ("policy", "checkpoints", "curves.png")
LABELS = {"params": "sft parameters", "data": "the data", "seed": "seed"}


def inputs(rate=1e-3, data="d1", seed=0):
    return {"params": {"learning_rate": rate, "steps": 4}, "data": data, "seed": seed}


def test_each_input_set_gets_its_own_directory_and_latest_points_at_the_last_started(tmp_path):
    root = str(tmp_path / "sft")
    first = stage_directory(root, "a" * 16, inputs(), LINKS)
    assert first.directory == os.path.join(root, "a" * 12) and first.first and not first.switched
    os.makedirs(os.path.join(first.directory, "checkpoints", "2"))
    assert os.readlink(os.path.join(root, "latest")) == "a" * 12
    assert os.listdir(os.path.join(root, "checkpoints")) == ["2"]  # through latest
    again = stage_directory(root, "a" * 16, inputs(), LINKS)
    assert again.directory == first.directory and not again.first and not again.switched
    assert again.fresh_reason(inputs(), LABELS) == "same inputs as its last start, which left no checkpoint"
    other = stage_directory(root, "b" * 16, inputs(rate=3e-3, seed=1), LINKS)
    assert other.switched and other.previous == inputs()
    assert not os.path.exists(os.path.join(other.directory, "checkpoints"))
    assert not os.path.exists(os.path.join(root, "checkpoints"))  # latest has none yet
    assert os.path.isdir(os.path.join(first.directory, "checkpoints", "2"))  # kept
    assert other.fresh_reason(inputs(rate=3e-3, seed=1), LABELS) == (
        "inputs changed: sft parameters (learning_rate 0.001 -> 0.003); seed 0 -> 1")
    assert changes(inputs(), inputs(data="d2"), LABELS) == ["the data"]


def test_older_input_sets_beyond_the_kept_number_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("DEW_KEEP_INPUTS", "2")
    root = str(tmp_path / "dpo")
    made = [stage_directory(root, key * 16, inputs(data=key), LINKS) for key in "abc"]
    assert made[2].pruned == (made[0].directory,)
    assert sorted(e for e in os.listdir(root) if len(e) == 12) == ["b" * 12, "c" * 12]
    again = stage_directory(root, "b" * 16, inputs(data="b"), LINKS)  # b becomes the newest
    assert again.pruned == () and os.readlink(os.path.join(root, "latest")) == "b" * 12
    monkeypatch.setenv("DEW_KEEP_INPUTS", "0")  # keeps everything
    assert stage_directory(root, "d" * 16, inputs(data="d"), LINKS).pruned == ()


def test_a_stage_directory_of_the_unkeyed_layout_moves_into_the_directory_of_its_result(tmp_path):
    root = str(tmp_path / "sft")
    os.makedirs(os.path.join(root, "policy"))
    os.makedirs(os.path.join(root, "checkpoints", "4"))
    recorded = {"stage": "sft", "directory": root, "policy": {"path": os.path.join(root, "policy")}}
    write_json(os.path.join(root, "result.json"), {"fingerprint": "c" * 16, "result": recorded})
    place = stage_directory(root, "c" * 16, inputs(), LINKS)
    assert sorted(os.listdir(place.directory)) == ["checkpoints", "inputs.json", "policy", "result.json"]
    assert os.path.islink(os.path.join(root, "policy")) and os.path.isdir(os.path.join(root, "policy"))
    moved = rebased(read_json(os.path.join(place.directory, "result.json"))["result"], place.directory)
    assert moved["policy"]["path"] == os.path.join(place.directory, "policy")
    # An unfinished one (no result.json) goes to legacy/: its inputs are unknown, it is never resumed.
    other = str(tmp_path / "dpo")
    os.makedirs(os.path.join(other, "checkpoints", "2"))
    place = stage_directory(other, "d" * 16, inputs(), LINKS)
    assert os.listdir(os.path.join(other, "legacy")) == ["checkpoints"]
    assert not os.path.exists(os.path.join(place.directory, "checkpoints"))
    assert place.fresh_reason(inputs(), LABELS) == "inputs changed: the earlier ones were not recorded"


def test_only_a_longer_run_of_the_same_inputs_continues_a_shorter_runs_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("DEW_KEEP_INPUTS", "0")
    root = str(tmp_path / "grpo")
    short = stage_directory(root, "a" * 16, {"params": {"steps": 3, "learning_rate": 2e-5}}, LINKS)
    os.makedirs(os.path.join(short.directory, "checkpoints", "3"))
    open(os.path.join(short.directory, "checkpoints", "3", "state"), "w").write("step 3")
    for key, params in (("b", {"steps": 4, "learning_rate": 4e-5}), ("c", {"steps": 2, "learning_rate": 2e-5})):
        other = stage_directory(root, key * 16, {"params": params}, LINKS)  # other rate; fewer steps
        assert continue_shorter(other, {"params": params}, params["steps"],
                                os.path.join(other.directory, "checkpoints")) is None
    longer = stage_directory(root, "d" * 16, {"params": {"steps": 4, "learning_rate": 2e-5}}, LINKS)
    mine = os.path.join(longer.directory, "checkpoints")
    assert continue_shorter(longer, {"params": {"steps": 4, "learning_rate": 2e-5}}, 4, mine) == (
        os.path.join(short.directory, "checkpoints"), 3, 3)
    assert os.listdir(mine) == ["3"] and open(os.path.join(mine, "3", "state")).read() == "step 3"
    assert os.path.exists(os.path.join(short.directory, "checkpoints", "3", "state"))  # left as it was


# ----- the pipeline ---------------------------------------------------------------------------

STAGES = ("sft", "dpo", "grpo")


@pytest.fixture(scope="module")
def harness(prefect_harness):
    """The harness, its flow runs without heartbeats (test_pipeline.py `without_flow_heartbeats`)."""
    with without_flow_heartbeats():
        yield


@pytest.fixture(scope="module")
def base(harness, tmp_path_factory):
    from flows.pipeline import pipeline

    root = tmp_path_factory.mktemp("runs")
    params = tiny(root)
    return root, params, pipeline(params)


def rerun(root, **changed):
    """The TINY pipeline under the base run's name and root with `changed`; (outcome, log)."""
    from flows.pipeline import pipeline

    with run_log() as lines:
        outcome = pipeline(tiny(root, **changed))
    return outcome, lines


def said(lines, stage, *fragments):
    """The log lines about `stage` that contain every fragment."""
    return [line for line in lines if line.startswith(f"{stage} ") and all(f in line for f in fragments)]


def check_retrained(root, outcome, lines, retrained):
    """`retrained` stages trained from step 0 and say why; the others were reused; the closing
    table's `reused` column (and the printed table) says the same. A rerun that retrains is a new
    run, whose metrics are those of the stages it trained."""
    assert {s: outcome["reused"][s] for s in STAGES} == {s: s not in retrained for s in STAGES}
    summary = next(line for line in lines if "| stage | held-out accuracy" in line)
    for stage in STAGES:
        row = next(r for r in summary.splitlines() if r.startswith(f"| {stage} |"))
        assert row.endswith("| yes |") == (stage not in retrained)
        assert not said(lines, stage, "resumes")  # never from a checkpoint of other inputs
        if stage in retrained:
            assert said(lines, stage, "trains from scratch (inputs changed:") and not said(lines, stage, "reused")
        else:
            assert said(lines, stage, "reused: it finished with these inputs before")
    if retrained:
        trained = query(root, f"SELECT stage, min(step), max(step) FROM metrics WHERE run = '{outcome['run']}' "
                              "AND name = 'loss' GROUP BY stage")
        logged = {"sft": (2, 4), "dpo": (1, 2), "grpo": (1, 2)}  # (first logged step, steps)
        assert sorted(trained) == sorted((s, *logged[s]) for s in retrained)  # from the start, not resumed


@pytest.mark.slow
def test_a_rerun_with_the_same_inputs_reuses_every_stage_and_says_so(base):
    root, params, first = base
    recorded = query(root, f"SELECT count(*) FROM metrics WHERE run = '{first['run']}'")
    outcome, lines = rerun(root)
    check_retrained(root, outcome, lines, retrained=())
    assert outcome["run"] == first["run"]  # the same run, its next attempt, which records nothing twice
    assert query(root, f"SELECT count(*) FROM metrics WHERE run = '{first['run']}'") == recorded
    assert outcome["reused"]["start"] and outcome["policy"] == first["policy"]
    for stage in STAGES:
        keyed = [e for e in os.listdir(os.path.join(root, "demo", stage)) if len(e) == 12]
        assert len(keyed) == 1 and os.readlink(os.path.join(root, "demo", stage, "latest")) == keyed[0]


@pytest.mark.slow
def test_a_changed_sft_parameter_retrains_sft_and_every_later_stage(base):
    root, params, first = base
    outcome, lines = rerun(root, sft={**params.sft.model_dump(), "learning_rate": 1e-3})
    check_retrained(root, outcome, lines, retrained=STAGES)
    assert said(lines, "sft", "inputs changed: sft parameters (learning_rate 0.003 -> 0.001)")
    assert said(lines, "dpo", "inputs changed: the starting policy)")
    assert said(lines, "grpo", "inputs changed: the starting policy)")
    assert outcome["policy"] != first["policy"] and os.path.isdir(first["policy"])  # the old one kept
    assert os.path.realpath(os.path.join(root, "demo", "grpo", "policy")) == os.path.realpath(outcome["policy"])


@pytest.mark.slow
def test_a_changed_dpo_parameter_retrains_dpo_and_grpo_and_reuses_sft(base):
    root, params, _ = base
    outcome, lines = rerun(root, dpo={**params.dpo.model_dump(), "learning_rate": 2e-5})
    check_retrained(root, outcome, lines, retrained=("dpo", "grpo"))
    assert said(lines, "dpo", "dpo parameters (learning_rate 1e-05 -> 2e-05)")


@pytest.mark.slow
def test_a_changed_grpo_parameter_retrains_grpo_only(base):
    root, params, _ = base
    outcome, lines = rerun(root, grpo={**params.grpo.model_dump(), "learning_rate": 1e-5})
    check_retrained(root, outcome, lines, retrained=("grpo",))
    assert said(lines, "grpo", "grpo parameters (learning_rate 5e-05 -> 1e-05)")


@pytest.mark.slow
def test_changed_data_retrains_every_stage(base):
    root, params, _ = base
    outcome, lines = rerun(root, data={**params.data.model_dump(), "train_problems": 300})
    check_retrained(root, outcome, lines, retrained=STAGES)
    assert said(lines, "sft", "inputs changed: the data; the starting policy)")
    assert not outcome["reused"]["start"]  # a new tokenizer and initial policy
