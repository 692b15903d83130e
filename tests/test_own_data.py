"""Your own data through the pipeline: GSM8K as published (question/answer) read through
DataParams.columns, the reference answer after "####", a refusal naming the field to set when no
tokenizer is known, lengths counted before training (and refused past data.max_truncated), and
an end-to-end run on the first rows of GSM8K with the Qwen3 tokenizer (slow).
"""

import json
import logging
import os
import re

import pytest

pytest.importorskip("prefect")

from conftest import SHARED_DATA  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from tasks.params import DataParams, EvalParams, PipelineParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = {"prompt": "question", "completion": "answer", "ground_truth": "answer"}
QWEN3 = os.path.join(SHARED_DATA, "tokenizers", "qwen3")


def gsm8k_like(path, count: int, long_every: int = 0) -> str:
    """Rows in GSM8K's published layout; every `long_every`-th answer is a long worked answer."""
    with open(path, "w", encoding="utf-8") as out:
        for i in range(count):
            steps = 30 if long_every and i % long_every == 0 else 1
            work = "\n".join(f"{i} + {k} = <<{i}+{k}={i + k}>>{i + k}" for k in range(steps))
            out.write(json.dumps({"question": f"What is {i} + {steps - 1}?",
                                  "answer": f"{work}\n#### {i + steps - 1}"}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A small byte-level BPE with a ChatML template, trained on GSM8K-like text."""
    from dew_lib.data.byte_bpe import train_byte_bpe

    directory = tmp_path_factory.mktemp("tokenizer")
    corpus = [f"What is {i} + {k}? {i} + {k} = <<{i}+{k}={i + k}>>{i + k} #### {i + k}"
              for i in range(40) for k in range(5)]
    train_byte_bpe(corpus, vocab_size=300, directory=str(directory))
    return str(directory)


def files(tmp_path, tokenizer, count=40, long_every=0, **data) -> dict:
    train = gsm8k_like(tmp_path / "train.jsonl", count, long_every)
    test = gsm8k_like(tmp_path / "test.jsonl", 10)
    return dict(source="files", chat_path=train, prompts_path=train, eval_path=test,
                tokenizer=tokenizer, columns=GSM8K, ground_truth_after="####", **data)


def prepared(tmp_path, params: PipelineParams):
    """What the pipeline's data_prep makes of mapped files (prepare_data, without Prefect)."""
    from tasks.data import mapped_files

    return mapped_files(params.data, str(tmp_path / "runs" / params.name / "data"))


class Log(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def check(data, params):
    from tasks.lengths import check_lengths_now

    logger, log = logging.getLogger("test_own_data"), Log()
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        check_lengths_now(data, params, logger)
    finally:
        logger.removeHandler(log)
    return log.lines


# ----- the parameters ---------------------------------------------------------------------------

def test_a_column_the_pipeline_does_not_read_is_refused_naming_the_fix():
    with pytest.raises(ValidationError, match=r"DataParams.columns has the key 'question', which is not "
                       r"a name the pipeline reads.*did you mean \{'prompt': 'question'\}"):
        DataParams(source="files", columns={"question": "prompt"})
    with pytest.raises(ValidationError, match=r"DataParams.columns\['prompt'\] is empty"):
        DataParams(source="files", columns={"prompt": ""})
    with pytest.raises(ValidationError, match="applies to source='files' only"):
        DataParams(columns=GSM8K)
    with pytest.raises(ValidationError, match="applies to source='files' only"):
        DataParams(ground_truth_after="####")
    with pytest.raises(ValidationError, match="max_truncated"):
        DataParams(max_truncated=1.5)
    with pytest.raises(ValidationError, match="limit"):
        EvalParams(limit=0)
    assert DataParams().max_truncated == 0.01 and EvalParams().limit is None


def test_files_without_a_tokenizer_are_refused_naming_the_field(tmp_path):
    test = gsm8k_like(tmp_path / "test.jsonl", 4)
    with pytest.raises(ValidationError, match=r"data.source='files' needs a tokenizer.*set "
                       r"data.tokenizer to a tokenizer directory"):
        PipelineParams(data=dict(source="files", eval_path=test, columns=GSM8K))
    bare = tmp_path / "bare"  # a checkpoint without tokenizer files
    bare.mkdir()
    (bare / "config.json").write_text(open(os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3",
                                                        "config.json")).read())
    with pytest.raises(ValidationError, match=r"model.pretrained='.*bare' ships no tokenizer files"):
        PipelineParams(data=dict(source="files", eval_path=test), model=dict(pretrained=str(bare)))
    # Either a tokenizer or a checkpoint with one is enough.
    PipelineParams(data=dict(source="files", eval_path=test, tokenizer=str(bare.parent)))
    PipelineParams(data=dict(source="files", eval_path=test),
                   model=dict(pretrained=os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3")))


def test_the_gsm8k_recipe_in_the_docs_is_valid_parameters():
    text = open(os.path.join(ROOT, "docs", "pipeline.md"), encoding="utf-8").read()
    section = text[text.index("## Your own data"):]
    recipe = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    if not os.path.isdir(os.path.join(ROOT, "..", "shared", "data", "gsm8k")):
        pytest.skip("the recipe's paths are ../shared/data; that directory is absent")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the recipe's paths are relative to the repository root
    try:
        params = PipelineParams(**recipe)
    finally:
        os.chdir(cwd)
    assert params.data.columns == GSM8K and params.data.ground_truth_after == "####"


# ----- preparing the files ----------------------------------------------------------------------

def test_gsm8k_as_published_is_rewritten_in_the_pipelines_layout(tmp_path, tokenizer):
    params = PipelineParams(root=str(tmp_path / "runs"), data=files(tmp_path, tokenizer))
    data = prepared(tmp_path, params)
    assert data.directory == str(tmp_path / "runs" / "demo" / "data")
    with open(data.eval_path) as handle:
        first = json.loads(handle.readline())
    assert first == {"prompt": [{"role": "user", "content": "What is 0 + 0?"}], "ground_truth": "0"}
    with open(data.prompts_path) as handle:
        row = json.loads(handle.readline())
    assert row["ground_truth"] == "0"  # after "####"; the solution is the whole worked answer
    assert json.loads(row["extra_info"]) == {"solution": "0 + 0 = <<0+0=0>>0\n#### 0"}
    with open(data.chat_path) as handle:
        chat = json.loads(handle.readline())
    assert chat == {"prompt": "What is 0 + 0?", "completion": "0 + 0 = <<0+0=0>>0\n#### 0"}
    # SFT reads it as a prompt and a completion and trains on the completion.
    from dew_lib.data import ChatMessages, Role

    spec = ChatMessages(path=data.chat_path, tokenizer=tokenizer, seq_len=63)
    conversation = spec.conversations()[0]
    ids, roles = spec.tokenize(conversation.messages, context=conversation.context)
    from dew_lib.data.tokenizer import load_tokenizer

    assert load_tokenizer(tokenizer).decode(ids[roles == Role.ASSISTANT]).startswith("0 + 0 = <<0+0=0>>0")
    # The same inputs reuse the prepared files.
    assert prepared(tmp_path, params) == data


def test_a_mapped_field_the_files_lack_is_refused_naming_it(tmp_path, tokenizer):
    params = PipelineParams(data=files(tmp_path, tokenizer) | {"columns": {**GSM8K, "prompt": "questions"}})
    with pytest.raises(ValueError, match=r"chat_path .*train.jsonl has no field 'questions' "
                       r"\(DataParams.columns\['prompt'\]\); its fields are \['question', 'answer'\]"):
        prepared(tmp_path, params)
    eval_only = {"prompt": "question", "ground_truth": "answer"}  # no completion: a chat file needs one
    params = PipelineParams(data=files(tmp_path, tokenizer) | {"columns": eval_only})
    with pytest.raises(ValueError, match=r"chat_path .* has neither the field 'completion' .* nor the "
                       r"field 'messages'"):
        prepared(tmp_path, params)


def test_a_reference_answer_without_the_marker_is_refused_naming_the_row(tmp_path, tokenizer):
    params = PipelineParams(data=files(tmp_path, tokenizer) | {"ground_truth_after": "The answer is"})
    with pytest.raises(ValueError, match=r"train.jsonl line 1: the field 'answer' "
                       r"\(DataParams.columns\['ground_truth'\]\) has no 'The answer is' "
                       r"\(DataParams.ground_truth_after\)"):
        prepared(tmp_path, params)


# ----- lengths ----------------------------------------------------------------------------------

def test_lengths_that_cut_more_than_max_truncated_are_refused_with_the_length_that_fits(tmp_path, tokenizer):
    # One answer in ten is a 30-line worked answer, far longer than 96 ids.
    params = PipelineParams(root=str(tmp_path / "runs"), data=files(tmp_path, tokenizer, long_every=10),
                            stages=("sft",))
    data = prepared(tmp_path, params)
    with pytest.raises(ValueError) as refused:
        check(data, params)
    message = str(refused.value)
    found = re.search(r"sft.max_length=97 cuts 4 of 40 SFT conversations \(10.0%\) in \S+/chat.jsonl, more "
                      r"than data.max_truncated=0.01 allows. sft.max_length=(\d+) cuts none of them \(the "
                      r"longest has (\d+) ids\); model.max_seq_len=128 must hold sft.max_length - 1 too. Raise "
                      r"sft.max_length, or accept the cut with data.max_truncated=0.1$", message)
    assert found, message
    fits, longest = int(found.group(1)), int(found.group(2))
    assert fits == longest  # a row holds max_length ids
    # The length it names fits every conversation; a larger share lets the cut through, logged.
    fitted = params.model_copy(update={"sft": params.sft.model_copy(update={"max_length": fits}),
                                       "model": params.model.model_copy(update={"max_seq_len": fits})})
    assert any(line.startswith(f"sft.max_length={fits} cuts 0 of 40 SFT conversations")
               for line in check(data, fitted))
    allowed = params.model_copy(update={"data": params.data.model_copy(update={"max_truncated": 0.1})})
    assert any(line.startswith("sft.max_length=97 cuts 4 of 40 SFT conversations (10.0%)")
               for line in check(data, allowed))


def test_grpo_prompts_dpo_pairs_and_held_out_prompts_are_counted_too(tmp_path, tokenizer):
    params = PipelineParams(root=str(tmp_path / "runs"),
                            data=files(tmp_path, tokenizer, long_every=10, max_truncated=0.1),
                            sft=dict(max_length=128), grpo=dict(max_prompt_len=4, max_new_tokens=8),
                            dpo=dict(max_length=24), evaluation=dict(max_new_tokens=120))
    data = prepared(tmp_path, params)
    with pytest.raises(ValueError) as refused:
        check(data, params)
    message = str(refused.value)
    assert "sft.max_length" not in message  # it cuts the 4 long answers of 40, which 0.1 allows
    assert re.search(r"grpo.max_prompt_len=4 cuts the start of 40 of 40 GRPO prompts \(100.0%\)", message)
    assert re.search(r"dpo.max_length=24 drops \d+ of 40 DPO pairs from the policy", message)
    assert re.search(r"model.max_seq_len=128 cannot hold \d+ of the 10 held-out prompts in .*eval.jsonl "
                     r"with their answers \(evaluation.max_new_tokens=120\)", message)
    assert "or evaluate fewer rows with evaluation.limit" in message


def test_distill_prompts_are_counted_where_the_stage_reads_them(tmp_path, tokenizer):
    """With lmbda < 1 the distill stage's prompts are the SFT conversations' (each before its last
    answer), so those are counted and named; at lmbda 1 the GRPO prompts file is."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")
    for lmbda, read in ((0.5, "chat"), (1.0, "prompts")):
        params = PipelineParams(root=str(tmp_path / "runs"), data=files(tmp_path, tokenizer, max_truncated=0.1),
                                stages=("distill",), distill=dict(teacher=str(teacher), lmbda=lmbda, max_prompt_len=4))
        data = prepared(tmp_path, params)
        with pytest.raises(ValueError) as refused:
            check(data, params)
        assert re.search(rf"distill.max_prompt_len=4 cuts the start of 40 of 40 distill prompts \(100.0%\) in "
                         rf"\S+/{read}.jsonl", str(refused.value)), str(refused.value)


def test_a_grpo_budget_longer_than_the_context_is_refused_before_training(tmp_path, tokenizer):
    params = PipelineParams(root=str(tmp_path / "runs"), data=files(tmp_path, tokenizer),
                            stages=("grpo",), grpo=dict(max_prompt_len=64, max_new_tokens=100))
    with pytest.raises(ValueError, match=r"grpo.max_prompt_len \+ grpo.max_new_tokens = 64 \+ 100 is longer "
                       r"than model.max_seq_len=128; raise model.max_seq_len to at least 164"):
        check(prepared(tmp_path, params), params)


# ----- GSM8K end to end ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def harness(prefect_harness):
    yield


def gsm8k_params(tmp_path) -> PipelineParams:
    """The first 64 rows of GSM8K's train and test files, as published, with the Qwen3 tokenizer
    and a tiny decoder (its vocabulary is the tokenizer's: 151,669 ids)."""
    if not os.path.isdir(os.path.join(SHARED_DATA, "gsm8k")) or not os.path.isdir(QWEN3):
        pytest.skip(f"GSM8K and the Qwen3 tokenizer are not under {SHARED_DATA}; set DEW_SHARED_DATA")
    paths = {}
    for split in ("train", "test"):
        with open(os.path.join(SHARED_DATA, "gsm8k", f"{split}.jsonl"), encoding="utf-8") as handle:
            rows = [line for _, line in zip(range(64), handle, strict=False)]
        paths[split] = tmp_path / f"{split}.jsonl"
        paths[split].write_text("".join(rows), encoding="utf-8")
    return PipelineParams(
        name="gsm8k", root=str(tmp_path / "runs"),
        data=dict(source="files", chat_path=str(paths["train"]), prompts_path=str(paths["train"]),
                  eval_path=str(paths["test"]), tokenizer=QWEN3, columns=GSM8K, ground_truth_after="####"),
        model=dict(emb_features=8, num_layers=1, num_heads=2, mlp_features=16, max_seq_len=512),
        sft=dict(steps=2, batch=2, max_length=448, log_every=1, checkpoint_every=100),
        dpo=dict(steps=1, batch=2, max_length=128, pair_prompts=2, log_every=1, checkpoint_every=100),
        grpo=dict(steps=1, batch=2, groups=2, max_prompt_len=128, max_new_tokens=8, log_every=1,
                  checkpoint_every=100),
        evaluation=dict(limit=8, batch=8, max_new_tokens=8, samples=1))


@pytest.mark.slow
@pytest.mark.optimized  # its 151,669-id head runs twice as long compiled plainly (tests/conftest.py)
def test_gsm8k_as_published_runs_through_every_stage(harness, tmp_path):
    from prefect import flow

    from dew_lib.store import Store
    from flows.data_prep import data_prep
    from flows.pipeline import pipeline
    from tasks.lengths import check_lengths

    params = gsm8k_params(tmp_path)

    @flow
    def prepare_and_check():
        data = data_prep(params.data, str(tmp_path / "runs" / "gsm8k" / "data"), params.seed)
        return check_lengths(data, params)

    # The lengths fit the first 64 rows: nothing is cut or dropped.
    assert prepare_and_check() == {"sft.max_length": 0, "grpo.max_prompt_len": 0, "dpo.max_length": 0}
    outcome = pipeline(params)
    assert list(outcome["accuracy"]) == ["start", "sft", "dpo", "grpo"]
    run = outcome["run"]

    def rows(sql):
        return Store(str(tmp_path / "runs")).rows(sql)[1]

    stages = dict(rows(f"SELECT stage, status FROM stages WHERE run = '{run}'"))
    assert stages == {s: "completed" for s in ("sft", "dpo", "grpo", "eval-start", "eval-sft",
                                               "eval-dpo", "eval-grpo")}
    sessions = rows(f"SELECT count(*) FROM sessions WHERE run = '{run}'")
    assert sessions == [(1 * 2 * 2,)]  # steps x prompts x groups
    # Only the first 8 held-out rows (evaluation.limit), each answered greedily and once drawn,
    # against GSM8K's final number.
    answers = rows(f"SELECT stage, count(*), count(DISTINCT item) FROM evaluations "
                   f"WHERE run = '{run}' GROUP BY stage ORDER BY stage")
    assert answers == [(f"eval-{s}", 16, 8) for s in ("dpo", "grpo", "sft", "start")]
    references = [r for (r,) in rows(f"SELECT reference FROM evaluations WHERE run = '{run}' AND "
                                     "stage = 'eval-start' AND sample = 0 ORDER BY item")]
    with open(os.path.join(SHARED_DATA, "gsm8k", "test.jsonl"), encoding="utf-8") as handle:
        published = [json.loads(line)["answer"].split("####")[-1].strip()
                     for _, line in zip(range(8), handle, strict=False)]
    assert references == published
    steps = dict(rows(f"SELECT stage, max(step) FROM metrics WHERE run = '{run}' GROUP BY stage"))
    assert steps == {"sft": 2, "dpo": 1, "grpo": 1}
