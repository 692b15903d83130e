"""Prompts: ids, strings and messages; left padding; UTF-8 reward metadata; verl's parquet."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SHARED_DATA

from dew_lib.data import DataError, Loading, Partition, Prompts, text_field
from dew_lib.data.tokenizer import load_tokenizer

MINIMIND = os.path.join(SHARED_DATA, "tokenizers", "minimind")
GSM8K = os.path.join(SHARED_DATA, "gsm8k", "train.jsonl")
ORDERED = Loading(seed=None)

needs_data = pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="shared data not found")


def first(prompts: Prompts, batch: int):
    return next(prompts.load(batch=batch).stream(Partition()))


def test_id_prompts_are_left_padded_and_keep_their_end_without_a_tokenizer():
    records = (
        json.dumps({"prompt": [5, 6, 7], "data_source": "toy", "ground_truth": "42", "extra_info": {"n": 1}}),
        json.dumps({"prompt": [1, 2, 3, 4, 5, 6], "ground_truth": 7}),
    )
    # The tokenizer path does not exist: id prompts never load one.
    prompts = Prompts(records=records, max_prompt_len=4, pad_id=9, tokenizer="/nonexistent/tok", loading=ORDERED)
    batch = first(prompts, 2)
    assert batch["prompt"].tolist() == [[9, 5, 6, 7], [3, 4, 5, 6]]
    assert batch["prompt_length"].tolist() == [3, 4]
    assert batch["prompt"].dtype == batch["prompt_length"].dtype == np.int32
    assert text_field(batch["data_source"]) == ["toy", ""]
    assert text_field(batch["ground_truth"]) == ["42", "7"]  # non-strings travel as JSON text
    assert text_field(batch["extra_info"]) == ['{"n": 1}', ""]
    assert batch["data_source"].shape == (2, 3) and batch["data_source"].dtype == np.int32
    np.testing.assert_array_equal(batch["data_source"][0], np.frombuffer(b"toy", np.uint8))


def test_metadata_is_utf8_with_one_width_per_field_for_the_whole_data():
    records = tuple(json.dumps({"prompt": [1], "ground_truth": g}) for g in ["é", "naïve café", "x"])
    data = Prompts(records=records, max_prompt_len=2, loading=ORDERED).load(batch=1)
    batches = list(itertools.islice(data.stream(Partition()), 3))
    assert {b["ground_truth"].shape for b in batches} == {(1, len("naïve café".encode()))}
    assert [text_field(b["ground_truth"])[0] for b in batches] == ["é", "naïve café", "x"]
    assert batches[0]["extra_info"].shape == (1, 0)


@needs_data
def test_string_and_message_prompts_use_the_tokenizer():
    tokenizer = load_tokenizer(MINIMIND)
    messages = [{"role": "system", "content": "Solve."}, {"role": "user", "content": "1+1?"}]
    records = (json.dumps({"prompt": "Once upon a time"}), json.dumps({"prompt": messages}))
    batch = first(Prompts(records=records, max_prompt_len=64, tokenizer=MINIMIND, loading=ORDERED), 2)
    expected = [tokenizer("Once upon a time")["input_ids"],
                tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]]
    for row, ids in enumerate(expected):
        assert batch["prompt_length"][row] == len(ids)
        assert batch["prompt"][row, 64 - len(ids):].tolist() == ids


@needs_data
def test_verl_gsm8k_parquet(tmp_path):
    with open(GSM8K, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in itertools.islice(handle, 8)]
    table = pa.Table.from_pylist([{
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": "You are a math expert."},
                   {"role": "user", "content": r["question"]}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": r["answer"].split("#### ")[-1]},
        "extra_info": {"split": "train", "index": i, "need_tools_kwargs": True,
                       "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "x"}}}},
    } for i, r in enumerate(rows)])
    pq.write_table(table, tmp_path / "train.parquet")
    data = Prompts(path=str(tmp_path / "train.parquet"), max_prompt_len=256, tokenizer=MINIMIND,
                   loading=ORDERED).load(batch=4)
    batch = next(data.stream(Partition()))
    assert set(batch) == {"prompt", "prompt_length", "data_source", "ground_truth", "extra_info"}
    assert text_field(batch["data_source"]) == ["openai/gsm8k"] * 4
    assert text_field(batch["ground_truth"]) == [r["answer"].split("#### ")[-1] for r in rows[:4]]
    extra = [json.loads(t) for t in text_field(batch["extra_info"])]
    assert [e["index"] for e in extra] == [0, 1, 2, 3]
    assert extra[0]["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "x"}}}
    decoded = load_tokenizer(MINIMIND).decode(batch["prompt"][0, 256 - batch["prompt_length"][0]:])
    assert decoded.startswith("<|im_start|>system\nYou are a math expert.") and rows[0]["question"] in decoded


def test_a_top_level_tools_kwargs_column_moves_into_extra_info():
    records = (json.dumps({"prompt": [1], "extra_info": {"a": 1}, "tools_kwargs": {"t": {}}}),)
    batch = first(Prompts(records=records, max_prompt_len=2), 1)
    assert json.loads(text_field(batch["extra_info"])[0]) == {"a": 1, "tools_kwargs": {"t": {}}}


def refused(prompt, **options):
    with pytest.raises(DataError) as error:
        Prompts(records=(json.dumps({"prompt": [3]}), json.dumps({"prompt": prompt})), max_prompt_len=4,
                **options).load(batch=1)
    return str(error.value)


def test_refused_prompts_name_the_row_and_field(tmp_path):
    assert refused({"text": "hi"}).startswith("prompt 1 (Prompts.records item 1): the prompt is neither token ids, "
                                              "a string nor a list of messages")
    assert "neither token ids" in refused(17)
    assert "neither token ids" in refused([1, "two"])
    assert "field 'prompt' item 1 is -2" in refused([1, -2])
    assert "field 'prompt' item 0 is 2.5 (float); token ids must be integers" in refused([2.5])
    assert "item 0 is False (bool)" in refused([False])
    assert "the prompt is an empty list" in refused([])
    assert "is a string, which needs a tokenizer; pass Prompts(tokenizer=...)" in refused("hello")
    assert "message 0 has unknown role 'bot'" in refused([{"role": "bot", "content": "x"}], tokenizer=MINIMIND)
    pq.write_table(pa.table({"question": ["q"]}), tmp_path / "q.parquet")
    with pytest.raises(DataError, match=r"q\.parquet: missing column 'prompt'"):
        Prompts(path=str(tmp_path / "q.parquet"), max_prompt_len=4).load(batch=1)
    with pytest.raises(ValueError, match="Prompts.max_prompt_len must be a positive integer"):
        Prompts(records=("{}",), max_prompt_len=0)
