"""Code tasks in the pipeline: MBPP and HumanEval files become prompts and evaluation rows, each
row's data_source picks its reward, and every program CodeReward runs lands in the run store
beside its GRPO session or its evaluated answer.

The flows run against Prefect's test harness with a tiny decoder and a couple of GRPO steps. A
tiny model never writes Python, so the tests choose the text the rewards read (the reference
solutions, a broken one, no code at all) and let everything else run as it would.
"""

import json
import os
import threading

import pytest
from pydantic import ValidationError

from dew_lib.records.sessions import Call, Session
from dew_lib.rewards import CodeReward
from dew_lib.sandbox import ProcessRunner, SandboxFleet, SandboxLimits, SandboxUnavailable
from dew_lib.store import Evaluation, Store
from dew_lib.store import Verdict as VerdictRow
from tasks.data import code_answer, code_layout, code_splits, prepare_code, read_code_rows
from tasks.params import DataParams, PipelineParams, RewardParams
from tasks.rewards import TaskReward, output_tail, reward_kind, score_all, verdicts


def mbpp_path(shared_data):
    return os.path.join(shared_data, "mbpp", "mbpp.jsonl")


def humaneval_path(shared_data):
    return os.path.join(shared_data, "humaneval", "HumanEval.jsonl.gz")


def held_out(params: DataParams):
    rows = read_code_rows(params.code_path)
    layout = code_layout(rows, "auto", params.code_path)
    train, held = code_splits(rows, layout, params)
    return layout, train, held


def lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ----- data -------------------------------------------------------------------------------------

def test_mbpp_uses_its_published_splits_and_keeps_its_tests_as_ground_truth(shared_data, tmp_path):
    params = DataParams(source="code", code_path=mbpp_path(shared_data), code_test_problems=3,
                        code_train_problems=4)
    manifest = prepare_code(params, str(tmp_path), seed=0)
    evaluation, prompts, chats = (lines(manifest.eval_path), lines(manifest.prompts_path),
                                  lines(manifest.chat_path))
    assert [r["task_id"] for r in evaluation] == ["mbpp/11", "mbpp/12", "mbpp/13"]  # test split
    assert [r["task_id"] for r in prompts] == ["mbpp/601", "mbpp/602", "mbpp/603", "mbpp/604"]  # train
    assert {r["data_source"] for r in evaluation + prompts} == {"mbpp"}
    first = json.loads(evaluation[0]["ground_truth"])
    assert first["test_list"][0] == 'assert remove_Occ("hello","l") == "heo"'
    assert first["test_list"][0] in evaluation[0]["prompt"][0]["content"]  # the tests are shown
    assert manifest.pairs_path is None and os.path.isdir(manifest.tokenizer)
    # SFT answers the training prompts with the reference solution, in the asked-for block.
    assert chats[0]["messages"][0] == prompts[0]["prompt"][0]
    assert chats[0]["messages"][1]["content"].startswith("```python\nclass Pair(object):")
    assert prepare_code(params, str(tmp_path), seed=0) == manifest  # reused when nothing changed


def test_humaneval_holds_out_its_first_rows_and_trains_on_the_rest(shared_data, tmp_path):
    params = DataParams(source="code", code_path=humaneval_path(shared_data), code_test_problems=2)
    manifest = prepare_code(params, str(tmp_path), seed=0)
    evaluation, prompts = lines(manifest.eval_path), lines(manifest.prompts_path)
    assert [r["task_id"] for r in evaluation] == ["HumanEval/0", "HumanEval/1"]
    assert len(prompts) == 164 - 2 and prompts[0]["task_id"] == "HumanEval/2"
    truth = json.loads(evaluation[0]["ground_truth"])
    assert set(truth) == {"test", "entry_point"} and truth["entry_point"] == "has_close_elements"
    assert "def has_close_elements" in evaluation[0]["prompt"][0]["content"]


def test_code_data_is_refused_with_what_to_change(shared_data, tmp_path):
    with pytest.raises(ValidationError, match="needs code_path"):
        DataParams(source="code")
    with pytest.raises(ValidationError, match="has no preference pairs for DPO"):
        PipelineParams(data=dict(source="code", code_path=mbpp_path(shared_data)))
    wrong = DataParams(source="code", code_path=mbpp_path(shared_data), code_layout="humaneval")
    with pytest.raises(ValueError, match="does not have the columns of code_layout='humaneval'"):
        prepare_code(wrong, str(tmp_path), seed=0)


# ----- rewards ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def process_reward():
    with TaskReward(RewardParams(runner="process", workers=2, wall_seconds=10)) as reward:
        yield reward


def test_each_data_source_gets_its_reward(process_reward):
    assert reward_kind("arithmetic") == "math" and reward_kind("") == "math"
    assert reward_kind("mbpp") == "code" and reward_kind("humaneval") == "code"
    assert process_reward("arithmetic", "7 + 5 = 12\n#### 12", "12") == 1.0
    assert process_reward.last_runs() == ()  # math runs no program
    truth = json.dumps({"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]})
    assert process_reward("mbpp", "```python\ndef add(a, b):\n    return a + b\n```", truth) == 0.5
    (run,) = process_reward.last_runs()
    assert (run.name, run.passed, run.total, run.outcome.verdict.value) == ("tests", 1, 2, "completed")
    assert "test 1 failed: AssertionError" in run.outcome.stderr
    with pytest.raises(ValueError, match="no reward is registered for data_source 'apps'.*tasks.rewards.SOURCES"):
        process_reward("apps", "```python\nprint(1)\n```", truth)


def test_verdict_rows_carry_the_outcome_and_the_end_of_the_output(process_reward):
    truth = json.dumps([{"stdin": "", "stdout": "ok"}, {"stdin": "", "stdout": "no"}])
    loud = "```python\nimport sys\nprint('x' * 5000)\nprint('ok')\nsys.exit(3)\n```"
    assert process_reward("code", loud, truth) == 0.0
    rows = verdicts(process_reward.last_runs())
    assert [(r.program, r.name, r.status, r.exit_code, r.passed, r.score) for r in rows] == [
        (0, "case 0", "failed", 3, False, 0.0), (1, "case 1", "failed", 3, False, 0.0)]
    assert rows[0].detail.startswith("exit 3; passed 0 of 1\nstdout: ...x") and rows[0].detail.endswith("ok\n")
    assert len(rows[0].detail) <= 1000 and rows[0].seconds > 0
    assert len(output_tail(process_reward.last_runs()[0], limit=200)) == 200


def test_last_runs_belong_to_the_calling_thread():
    with SandboxFleet(ProcessRunner(), limits=SandboxLimits(wall_seconds=10), workers=4) as fleet:
        reward = CodeReward(fleet)
        seen = {}

        def score(n):
            cases = json.dumps([{"stdin": "", "stdout": str(n)}] * (1 + n % 3))
            value = reward("code", f"```python\nprint({n})\n```", cases)
            runs = reward.last_runs()
            seen[n] = (value, len(runs), {r.outcome.stdout for r in runs})

        threads = [threading.Thread(target=score, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert seen == {n: (1.0, 1 + n % 3, {f"{n}\n"}) for n in range(8)}


def test_a_missing_bubblewrap_is_an_error_naming_the_fix(monkeypatch):
    from dew_lib.sandbox import launcher

    real = launcher.tool

    def without_bwrap(name, package):
        if name == "bwrap":
            raise SandboxUnavailable("bwrap was not found on PATH; install the bubblewrap package")
        return real(name, package)

    monkeypatch.setattr(launcher, "tool", without_bwrap)
    with TaskReward(RewardParams()) as reward:
        assert reward("arithmetic", "#### 4", "4") == 1.0  # math needs no sandbox
        with pytest.raises(SandboxUnavailable, match="runner='namespace' cannot run code here.*"
                                                     "apt-get install bubblewrap.*'process'"):
            reward("mbpp", "```python\nx = 1\n```", json.dumps(["assert x == 1"]))


def test_humaneval_canonical_solutions_score_one_through_the_namespace_runner(shared_data):
    params = DataParams(source="code", code_path=humaneval_path(shared_data), code_test_problems=4)
    layout, _, held = held_out(params)
    try:
        reward = TaskReward(RewardParams(workers=2))
        reward.code()
    except SandboxUnavailable as error:
        pytest.skip(f"NamespaceRunner cannot run here: {error}")
    from tasks.data import code_prompt

    rows = [code_prompt(r, layout) for r in held]
    with reward:
        scores, runs = score_all(reward, rows, [code_answer(r, layout) for r in held])
        broken, _ = score_all(reward, rows[:1], ["```python\ndef has_close_elements(n, t):\n    return True\n```"])
    assert scores == [1.0] * 4 and [len(r) for r in runs] == [1] * 4
    assert broken == [0.0]


# ----- the store --------------------------------------------------------------------------------

def test_verdicts_land_beside_their_sessions_and_evaluations(tmp_path):
    store = Store(tmp_path)
    call = Call(prompt_ids=[1, 2], sampled_ids=[3], behavior_log_probs=[-0.5], version=0)
    sessions = [Session(task="0", group=0, sample=s, calls=(call,), reward=float(s)) for s in range(3)]
    ran = [[VerdictRow(program=0, status="completed", passed=False, score=0.0)], [],
           [VerdictRow(program=0, name="case 0", status="completed", passed=True, score=1.0),
            VerdictRow(program=1, name="case 1", status="timeout", score=0.0)]]
    with store.writer("run") as run:
        with run.stage("grpo", kind="grpo") as stage:
            stage.sessions(sessions, update=3, truncation="score", verdicts=ran)
            with pytest.raises(ValueError, match="verdicts has 2 entries for 3 sessions"):
                stage.sessions(sessions, update=4, verdicts=ran[:2])
        with run.stage("eval-grpo", kind="evaluate") as stage:
            answers = [Evaluation(item=i, prompt="p", answer="a", score=float(i), task=f"t{i}") for i in range(2)]
            stage.evaluations(answers, step=3, verdicts=[[], ran[2]])
    joined = store.rows("SELECT s.sample, v.program, v.status FROM sessions s JOIN verdicts v USING (session_uid) "
                        "ORDER BY s.sample, v.program")[1]
    assert joined == [(0, 0, "completed"), (2, 0, "completed"), (2, 1, "timeout")]
    answered = store.rows("SELECT e.item, e.task, v.name, v.passed FROM evaluations e JOIN verdicts v "
                          "ON v.run = e.run AND v.stage = e.stage AND v.update = e.step AND v.group_id = e.item "
                          "ORDER BY v.program")[1]
    assert answered == [(1, "t1", "case 0", True), (1, "t1", "case 1", False)]


# ----- the flows --------------------------------------------------------------------------------

# The shapes of test_pipeline.py's tiny run, so the compilation cache serves both.
TINY = dict(model=dict(emb_features=32, num_layers=1, num_heads=2, mlp_features=64),
            grpo=dict(steps=2, batch=2, groups=4, log_every=1, checkpoint_every=1, max_new_tokens=8),
            evaluation=dict(batch=4, max_new_tokens=8, samples=0), reward=dict(workers=2))


@pytest.fixture(scope="module")
def harness(prefect_harness):
    yield


@pytest.fixture(scope="module")
def namespace_available():
    try:
        TaskReward(RewardParams()).code()
    except SandboxUnavailable as error:
        pytest.skip(f"NamespaceRunner cannot run here: {error}")


def query(root, sql):
    return Store(str(root)).rows(sql)[1]


@pytest.mark.slow
def test_grpo_and_evaluation_on_mbpp_record_a_verdict_per_program(
        harness, namespace_available, shared_data, tmp_path, monkeypatch):
    from flows.pipeline import pipeline
    from tasks import evaluate, stage_run

    params = PipelineParams(root=str(tmp_path), name="mbpp", stages=("grpo",),
                            **{**TINY, "model": {**TINY["model"], "max_seq_len": 1024},
                               "grpo": {**TINY["grpo"], "max_prompt_len": 576}},
                            data=dict(source="code", code_path=mbpp_path(shared_data),
                                      code_test_problems=3, code_train_problems=4))
    layout, train_rows, held = held_out(params.data)
    # Completions: every training solution at once (passes every prompt's tests) when the first
    # sampled id is even, else a program that defines nothing (fails them all).
    everything = "\n\n".join(code_answer(r, layout)[len("```python\n"):-len("\n```")] for r in train_rows)
    monkeypatch.setattr(stage_run, "completion_text", lambda tokenizer: lambda ids: (
        f"```python\n{everything}\n```" if len(ids) and ids[0] % 2 == 0 else "```python\nanswer = None\n```"))
    # Answers: the reference, a wrong function, and prose without code.
    wrong = f"```python\ndef {held[1]['test_list'][0].split()[1].split('(')[0]}(*args):\n    return None\n```"
    monkeypatch.setattr(evaluate, "answer_all", lambda *args: [code_answer(held[0], layout), wrong, "no code"])

    outcome = pipeline(params)
    run = outcome["run"]
    assert outcome["accuracy"] == {"start": pytest.approx(1 / 3, abs=1e-3), "grpo": pytest.approx(1 / 3, abs=1e-3)}
    rewards = query(tmp_path, f"SELECT reward FROM sessions WHERE run = '{run}'")
    assert len(rewards) == 2 * 2 * 4 and all(0.0 <= r <= 1.0 for (r,) in rewards)  # steps x prompts x groups
    # One program per session (assert-style tests run in one harness), joined on session_uid, and
    # its score is the session's reward.
    pairs = query(tmp_path, f"SELECT s.reward, v.score, v.status, v.program FROM sessions s "
                            f"JOIN verdicts v USING (session_uid) WHERE s.run = '{run}'")
    assert len(pairs) == len(rewards) and all(r == s and st == "completed" and p == 0 for r, s, st, p in pairs)
    assert {r for r, *_ in pairs} == {0.0, 1.0}
    # Evaluations: a verdict for each answer that had code, beside its row.
    for stage in ("eval-start", "eval-grpo"):
        rows = query(tmp_path, f"SELECT e.item, e.task, e.score, v.passed, v.exit_code FROM evaluations e "
                               f"LEFT JOIN verdicts v ON v.run = e.run AND v.stage = e.stage "
                               f"AND v.update = e.step AND v.group_id = e.item "
                               f"WHERE e.run = '{run}' AND e.stage = '{stage}' ORDER BY e.item")
        assert rows == [(0, "mbpp/11", 1.0, True, 0), (1, "mbpp/12", 0.0, False, 0),
                        (2, "mbpp/13", 0.0, None, None)]


@pytest.mark.slow
def test_humaneval_canonical_solutions_evaluate_to_accuracy_one(
        harness, namespace_available, shared_data, tmp_path, monkeypatch):
    from flows.pipeline import pipeline
    from tasks import evaluate

    params = PipelineParams(root=str(tmp_path), name="humaneval", stages=(),
                            **{**TINY, "model": {**TINY["model"], "max_seq_len": 1024}},
                            data=dict(source="code", code_path=humaneval_path(shared_data),
                                      code_test_problems=5))
    layout, _, held = held_out(params.data)
    monkeypatch.setattr(evaluate, "answer_all", lambda *args: [code_answer(r, layout) for r in held])
    outcome = pipeline(params)
    assert outcome["accuracy"] == {"start": 1.0}
    rows = query(tmp_path, f"SELECT v.task, v.name, v.status, v.passed, v.score FROM verdicts v "
                           f"WHERE v.run = '{outcome['run']}' ORDER BY v.group_id")
    assert rows == [(f"HumanEval/{i}", "tests", "completed", True, 1.0) for i in range(5)]
    assert query(tmp_path, "SELECT bool_and(seconds > 0 AND exit_code = 0) FROM verdicts") == [(True,)]
