"""The pipeline's tool task (data.source="tools"): two-digit products answered with a calculator
worker process. The calculator's arithmetic, an episode's context equal to the chat template's
render of the same conversation, the worker through SubprocessEnvironment, and the pipeline's
GRPO and evaluation running tool episodes, synchronous and asynchronous, into the run store."""

import json

import numpy as np
import pytest

from dew_lib.records.episodes import Action, EpisodeId
from dew_lib.records.sessions import Task
from dew_lib.tools.calculator import Calculator, calculate, call_text, called, tool_turn
from tasks.params import DataParams, PipelineParams, ToolParams

TINY = dict(
    data=dict(source="tools", train_problems=400, test_problems=10),
    model=dict(emb_features=32, num_layers=1, num_heads=2, mlp_features=64),
    sft=dict(steps=4, batch=4, log_every=2, checkpoint_every=2),
    grpo=dict(steps=2, batch=2, groups=4, log_every=1, checkpoint_every=1),
    evaluation=dict(batch=10, samples=2),
    stages=("sft", "grpo"),
)


def test_the_calculator_computes_calls_and_names_what_it_cannot_read():
    assert calculate("37 * 48") == ("1776", "ok")
    assert calculate(" 90 - 99 ") == ("-9", "ok")
    assert calculate("84 / 12") == ("7", "ok")
    assert calculate("7 / 2") == ("7/2", "ok")
    assert calculate("7 / 0") == ("error: division by zero", "division by zero")
    assert calculate("37 * ")[1] == calculate("2 ** 8")[1] == calculate("1 + 2 + 3")[1] == "malformed"
    assert called(call_text("37 * 48")) == "37 * 48"
    assert called("37 * 48 = \\boxed{1776}") is None


@pytest.fixture(scope="module")
def tool_data(tmp_path_factory):
    from tasks.tool_task import generate_tools

    return generate_tools(DataParams(source="tools", train_problems=400, test_problems=10),
                          str(tmp_path_factory.mktemp("tools")), seed=3)


@pytest.fixture(scope="module")
def tokenizer(tool_data):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_data.tokenizer)


def test_the_data_teaches_both_ways_to_answer_and_holds_out_its_own_problems(tool_data):
    rows = lambda path: [json.loads(line) for line in open(path)]  # noqa: E731
    chats = [r["messages"] for r in rows(tool_data.chat_path)]
    called_share = np.mean([len(c) == 4 for c in chats])
    assert 0.4 < called_share < 0.6  # DataParams.tool_share
    call = next(c for c in chats if len(c) == 4)
    a, b = map(int, call[1]["content"].removeprefix("calc: ").split(" * "))
    assert call[2] == {"role": "tool", "content": str(a * b)}
    assert call[3]["content"] == f"{a} * {b} = \\boxed{{{a * b}}}"
    held_out = rows(tool_data.eval_path)
    assert len(held_out) == 10 and {r["data_source"] for r in held_out} == {"calculator"}
    trained = {c[0]["content"] for c in chats} | {r["prompt"][0]["content"] for r in rows(tool_data.prompts_path)}
    assert not trained & {r["prompt"][0]["content"] for r in held_out}
    assert tool_data.tool == "calculator" and tool_data.pairs_path is None


def worker_task(tokenizer, question):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    prompt = np.array([0] * 4 + list(ids), np.int32)
    return Task("7", {"prompt": prompt, "prompt_length": np.int32(len(ids))}), ids


def calls(tokenizer, context, text):
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Action(context=context, tokens=tokens, terminated=True, step=0)


def test_an_episode_reads_exactly_what_the_chat_template_renders(tool_data, tokenizer):
    """The calculator's answer extends the context with the template's own tool message, so a
    policy reads in an episode the very ids SFT trained it on."""
    from tokenizers import Tokenizer

    calculator = Calculator(Tokenizer.from_file(f"{tool_data.tokenizer}/tokenizer.json"), **tool_turn(tokenizer))
    question = "What is 37 * 48?"
    task, prompt = worker_task(tokenizer, question)
    context, status, _ = calculator.reset({}, {"id": task.id, "data": {k: np.asarray(v).tolist()
                                                                       for k, v in task.data.items()}})
    assert context == prompt and status == "running"
    action = calls(tokenizer, context, "calc: 37 * 48")
    answered, status, detail = calculator.step({"context": context, "tokens": action.tokens.tolist()})
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": "calc: 37 * 48"},
         {"role": "tool", "content": "1776"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert answered == expected and (status, detail) == ("running", "calc ok")
    wrong = calls(tokenizer, context, "calc: 37 *")
    _, status, detail = calculator.step({"context": context, "tokens": wrong.tokens.tolist()})
    assert (status, detail) == ("running", "calc malformed")
    reply = calls(tokenizer, answered, "37 * 48 = \\boxed{1776}")
    assert calculator.step({"context": answered, "tokens": reply.tokens.tolist()})[1:] == ("completed", "answered")


def test_the_calculator_worker_process_answers_like_the_class(tool_data, tokenizer):
    from tasks.tool_task import calculator_environment

    factory = calculator_environment(tokenizer, tool_data.tokenizer, ToolParams(wall_seconds=30))
    task, prompt = worker_task(tokenizer, "What is 12 * 34?")
    identity = EpisodeId(task="7", group=0, sample=0, attempt=0, seed=1)
    with factory(task, identity) as environment:
        first = environment.reset()
        assert first.context.tolist() == prompt
        answered = environment.step(calls(tokenizer, first.context, "calc: 12 * 34"))
        assert tokenizer.decode(answered.context[len(prompt):]).endswith("<|im_start|>tool\n408<|im_end|>\n"
                                                                        "<|im_start|>assistant\n")
        done = environment.step(calls(tokenizer, answered.context, "12 * 34 = \\boxed{408}"))
        assert (done.status.value, done.detail) == ("completed", "answered")


def test_a_template_without_a_tool_role_is_refused(tokenizer):
    import copy

    plain = copy.copy(tokenizer)
    plain.chat_template = ("{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] + '<|im_end|>' }}"
                           "{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="tool"):
        tool_turn(plain)


def test_the_tool_task_has_no_dpo_and_its_episodes_must_fit_the_model():
    with pytest.raises(ValueError, match="no preference pairs"):
        PipelineParams(data=dict(source="tools"))
    with pytest.raises(ValueError, match="max_seq_len"):
        PipelineParams(data=dict(source="tools"), stages=("sft", "grpo"), tools=dict(max_prompt_len=120))


@pytest.fixture(scope="module")
def runs(prefect_harness, tmp_path_factory):
    from flows.pipeline import pipeline

    root = tmp_path_factory.mktemp("runs")
    return root, {mode: pipeline(PipelineParams(root=str(root), name=f"tools-{mode}",
                                                **{**TINY, "grpo": {**TINY["grpo"], "mode": mode}}))
                  for mode in ("sync", "async")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_and_evaluation_run_tool_episodes_into_the_store(runs, mode):
    from dew_lib.store import Store

    root, outcomes = runs
    run = outcomes[mode]["run"]
    store = Store(str(root))
    stages = store.rows("SELECT stage, status FROM stages WHERE run = ? ORDER BY stage", [run])[1]
    assert stages == [(s, "completed") for s in ("eval-grpo", "eval-sft", "eval-start", "grpo", "sft")]
    sessions = store.rows("SELECT count(*), count(DISTINCT task) FROM sessions WHERE run = ? AND stage = 'grpo'",
                          [run])[1][0]
    assert sessions[0] >= 2 * 2 * 4 and sessions[1] >= 2  # two updates of two prompts, four episodes each
    # every evaluated answer is the last reply of an episode, its transcript the detail
    answers = store.rows("SELECT stage, sample, answer, detail FROM evaluations WHERE run = ?", [run])[1]
    assert len(answers) == 3 * 10 * 3
    assert all(detail.endswith(answer + "<|im_end|>") or not detail.endswith("<|im_end|>")
               for _, _, answer, detail in answers)
    # a row per turn, each of an episode's session; what the calculator said when it was asked
    said = store.rows("SELECT DISTINCT coalesce(t.detail, 'not asked') FROM turns t JOIN sessions s "
                      "USING (session_uid) WHERE t.run = ? AND t.stage = 'grpo'", [run])[1]
    assert said and {d for (d,) in said} <= {"calc ok", "calc malformed", "calc division by zero",
                                             "answered", "not asked"}


@pytest.mark.slow
def test_each_evaluation_publishes_its_greedy_transcripts(runs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.ui import artifact_key

    _, outcomes = runs
    run = outcomes["sync"]["run"]
    keys = [artifact_key(run, stage, "transcripts") for stage in ("start", "sft", "grpo")]
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    assert sorted({a.key for a in found}) == sorted(keys)
    shown = next(a for a in found if a.key == keys[-1]).data
    assert shown.count("What is") == 3 and "```" in shown


def test_ppo_needs_episodes_drawn_in_step():
    with pytest.raises(ValueError, match="rl='ppo'"):
        PipelineParams(rl="ppo", data=dict(source="tools"), stages=("sft", "grpo"), grpo=dict(mode="async"))


@pytest.mark.slow
def test_a_ppo_stage_trains_policy_and_critic_on_tool_episodes(runs):
    """The synchronous GRPO run again with only rl='ppo' changed: its SFT is reused, its RL
    stage trains anew with a critic (its two steps are two epochs over one collection)."""
    from dew_lib.store import Store
    from flows.pipeline import pipeline

    root, _ = runs
    params = PipelineParams(root=str(root), name="tools-sync", rl="ppo", ppo=dict(epochs=2), **TINY)
    outcome = pipeline(params)
    assert outcome["reused"] == {"start": True, "sft": True, "ppo": False}
    store = Store(str(root))
    metrics = dict(store.rows("SELECT name, count(*) FROM metrics WHERE run = ? AND stage = 'ppo' GROUP BY name",
                              [outcome["run"]])[1])
    # Episodes cut at their budget are masked; the losses have a value only when a token trained.
    answered = store.rows("SELECT count(*) FROM sessions WHERE run = ? AND stage = 'ppo' AND status = 'completed'",
                          [outcome["run"]])[1][0][0]
    assert metrics["grad_norm"] == 2
    if answered:
        assert metrics["critic/vf_loss"] == metrics["critic/vf_explained_var"] == metrics["pg_loss"] == 2
    else:
        assert not {"critic/vf_loss", "pg_loss"} & set(metrics)
    updates = store.rows("SELECT DISTINCT update FROM sessions WHERE run = ? AND stage = 'ppo' ORDER BY 1",
                         [outcome["run"]])[1]
    assert updates == [(0,)]  # one collection for both updates, recorded once
    stage = store.rows("SELECT params FROM stages WHERE run = ? AND stage = 'ppo'", [outcome["run"]])[1]
    assert stage and outcome["accuracy"]["ppo"] >= 0.0
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(outcome["policy"]).model_type  # the policy alone, in HF format


def test_ppo_params_give_the_critic_its_own_rate():
    """Adam's first step moves each weight by about its rate: the critic's by
    `critic_learning_rate`, the policy's by the stage's `learning_rate`."""
    import jax.numpy as jnp

    from dew_lib.recipes import optimizer
    from tasks.params import GRPOParams

    params = {"policy": {"w": jnp.ones(3)}, "critic": {"w": jnp.ones(3)}}
    grads = {"policy": {"w": jnp.full(3, 1e-3)}, "critic": {"w": jnp.full(3, 1e-3)}}
    for critic_rate, expected in ((None, 1e-4), (1e-3, 1e-3)):
        chosen = optimizer(GRPOParams(learning_rate=1e-4), critic_learning_rate=critic_rate)
        updates, _ = chosen.update(grads, chosen.init(params), params)
        np.testing.assert_allclose(-updates["policy"]["w"], 1e-4 * (1 + 1e-4), rtol=1e-3)
        np.testing.assert_allclose(-updates["critic"]["w"], expected * (1 + 1e-4), rtol=1e-3)
