"""Record shapes read directly: prompt-completion, question/answer columns, text preference pairs.

Checked against TRL 1.12 (tests/fixtures/chat/trl_qwen3_formats.json, from tools/parity_chat.py),
against the real Qwen3 and MiniMind tokenizers and GSM8K rows, and for the rows they refuse.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
from conftest import SHARED_DATA  # noqa: E402

from dew_lib.data import ChatMessages, DataError, Loading, Partition, PreferencePairs, Role  # noqa: E402
from dew_lib.data.tokenizer import load_tokenizer  # noqa: E402

QWEN3 = os.path.join(SHARED_DATA, "tokenizers", "qwen3")
MINIMIND = os.path.join(SHARED_DATA, "tokenizers", "minimind")
GSM8K = os.path.join(SHARED_DATA, "gsm8k", "train.jsonl")
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "chat", "trl_qwen3_formats.json")
ORDERED = Loading(seed=None)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="shared data not found")


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


def gsm8k(count):
    with open(GSM8K, encoding="utf-8") as handle:
        return [json.loads(next(handle)) for _ in range(count)]


def documents(batch):
    """(ids, roles) of every packed conversation, in row-major order."""
    out = []
    for row in range(batch["text"].shape[0]):
        segments = batch["text_segment_ids"][row]
        for segment in range(1, segments.max() + 1):
            where = segments == segment
            out.append((batch["text"][row][where].tolist(), batch["text_roles"][row][where].tolist()))
    return out


def render_ids(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


# ----- parity with TRL ----------------------------------------------------------------------------


def test_prompt_completion_ids_and_trained_tokens_equal_trl_sft_trainer(tmp_path):
    fixture = json.load(open(FIXTURE, encoding="utf-8"))
    assert fixture["trl_version"] == "1.12.0"
    rows = fixture["prompt_completions"]
    path = write_jsonl(tmp_path / "pc.jsonl", [{k: r[k] for k in ("prompt", "completion", "tools")} for r in rows])
    chats = ChatMessages(path=path, val_path=path, tokenizer=QWEN3, seq_len=511,
                         chat_template=fixture["sft_chat_template"])
    for row in rows:
        ids, roles = chats.tokenize(row["prompt"] + row["completion"], row["tools"], context=len(row["prompt"]))
        assert ids.tolist() == row["input_ids"]
        assert (roles == Role.ASSISTANT).astype(int).tolist() == row["trained"]
    packed = [doc for batch in chats.load(batch=2).val(Partition()) for doc in documents(batch)]
    assert sorted(ids for ids, _ in packed) == sorted(r["input_ids"] for r in rows)
    for ids, roles in packed:
        (match,) = [r for r in rows if r["input_ids"] == ids]
        assert [int(role == Role.ASSISTANT) for role in roles] == match["trained"]


def test_conversational_preference_ids_and_masks_equal_trl_dpo_trainer():
    fixture = json.load(open(FIXTURE, encoding="utf-8"))
    pairs = fixture["preferences"]
    records = [{k: p[k] for k in ("prompt", "chosen", "rejected", "tools")} for p in pairs]
    batch = next(PreferencePairs(records=records, tokenizer=QWEN3, seq_len=192, pad_id=7,
                                 loading=ORDERED).load(batch=len(pairs)).stream(Partition()))
    for row, pair in enumerate(pairs):
        for side, name in enumerate(("chosen", "rejected")):
            expected = pair["prompt_ids"] + pair[f"{name}_ids"]
            ids, mask = batch["input_ids"][row, side], batch["completion_mask"][row, side]
            assert ids[:len(expected)].tolist() == expected
            assert (ids[len(expected):] == 7).all()
            assert mask.tolist() == [0] * len(pair["prompt_ids"]) + [1] * len(pair[f"{name}_ids"]) + \
                [0] * (192 - len(expected))


# ----- prompt-completion and column mapping ----------------------------------------------------------


def test_gsm8k_question_answer_columns_train_only_the_answer(tmp_path):
    rows = gsm8k(6)
    chats = ChatMessages(path=GSM8K, tokenizer=QWEN3, seq_len=1023, loading=ORDERED,
                         columns={"prompt": "question", "completion": "answer"})
    tokenizer = load_tokenizer(QWEN3)
    conversations = chats.conversations()
    assert len(conversations) == 7473
    for row, conversation in zip(rows, conversations[:6]):
        assert conversation.context == 1 and conversation.where.endswith("train.jsonl line "
                                                                         f"{rows.index(row) + 1})")
        ids, roles = chats.tokenize(conversation.messages, context=1)
        messages = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
        assert ids.tolist() == render_ids(tokenizer, messages)
        assert tokenizer.decode(ids[roles == Role.ASSISTANT]) == \
            "<think>\n\n</think>\n\n" + row["answer"] + "<|im_end|>\n"
        assert tokenizer.decode(ids[roles == Role.USER]) == "<|im_start|>user\n" + row["question"] + "<|im_end|>\n"


def test_plain_strings_equal_the_same_messages(tmp_path):
    pairs = [("What is 2 + 2?", "4"), ("Name a colour.", "Blue.")]
    strings = write_jsonl(tmp_path / "s.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    messages = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": p}],
                                                   "completion": [{"role": "assistant", "content": c}]}
                                                  for p, c in pairs])
    conversations = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]} for p, c in pairs]
    whole = write_jsonl(tmp_path / "c.jsonl", conversations)
    loaded = []
    for path in (strings, messages, whole):
        data = ChatMessages(path=path, tokenizer=MINIMIND, seq_len=63, loading=ORDERED).load(batch=2)
        loaded.append(next(data.stream(Partition())))
    for other in loaded[1:]:
        for name in loaded[0]:
            np.testing.assert_array_equal(loaded[0][name], other[name])


def test_a_multi_turn_prompt_is_context_under_a_template_that_rewrites_history(tmp_path):
    # Qwen3's own template drops the think block of earlier assistant turns, so prefixes inside the
    # prompt are not append-only; only the whole prompt must prefix the completion, as in TRL.
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
              {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}]
    completion = [{"role": "assistant", "content": "Blue."}]
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": completion}])
    chats = ChatMessages(path=path, tokenizer=QWEN3, seq_len=255)
    tokenizer = load_tokenizer(QWEN3)
    (conversation,) = chats.conversations()
    ids, roles = chats.tokenize(conversation.messages, context=conversation.context)
    head = render_ids(tokenizer, prompt, add_generation_prompt=True)
    assert ids.tolist() == render_ids(tokenizer, prompt + completion)
    assert (roles[:len(head)] == Role.NONE).all()  # the history, header included: context
    assert tokenizer.decode(ids[roles == Role.ASSISTANT]) == "<think>\n\n</think>\n\nBlue.<|im_end|>\n"
    with pytest.raises(DataError, match="rewrites earlier tokens"):  # the same as one conversation
        chats.tokenize(prompt + completion)


def test_prompt_completion_from_parquet_with_tools_as_json(tmp_path):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    table = pa.table({"q": ["What is 2 + 2?", "And 3 + 3?"], "a": ["4", "6"],
                      "schemas": [json.dumps([tool]), None]})
    pq.write_table(table, tmp_path / "qa.parquet")
    chats = ChatMessages(path=str(tmp_path / "qa.parquet"), tokenizer=QWEN3, seq_len=511, loading=ORDERED,
                         columns={"prompt": "q", "completion": "a", "tools": "schemas"})
    first, second = chats.conversations()
    assert first.tools == [tool] and second.tools is None
    assert first.where == f"conversation 0 ({tmp_path / 'qa.parquet'} row 0)"
    docs = documents(next(chats.load(batch=2).stream(Partition())))
    tokenizer = load_tokenizer(QWEN3)
    assert docs[0][0] == render_ids(tokenizer, first.messages, tools=[tool])
    assert "add" in tokenizer.decode(docs[0][0])


# ----- text preference pairs ------------------------------------------------------------------------


def test_text_pairs_mask_everything_after_the_generation_prompt():
    tokenizer = load_tokenizer(MINIMIND)
    record = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "It is 5."}
    batch = next(PreferencePairs(records=(json.dumps(record),), tokenizer=MINIMIND, seq_len=64)
                 .load(batch=1).stream(Partition()))
    user = [{"role": "user", "content": record["prompt"]}]
    head = render_ids(tokenizer, user, add_generation_prompt=True)
    for side, name in enumerate(("chosen", "rejected")):
        full = render_ids(tokenizer, user + [{"role": "assistant", "content": record[name]}])
        ids, mask = batch["input_ids"][0, side], batch["completion_mask"][0, side]
        assert ids[:len(full)].tolist() == full and mask.sum() == len(full) - len(head)
        assert mask[:len(head)].sum() == 0 and mask[len(head):len(full)].all()
        assert record[name] in tokenizer.decode(ids[mask == 1])


def test_text_pairs_with_mapped_columns_from_parquet(tmp_path):
    table = pa.table({"instruction": ["Say hi.", "Say bye."], "good": ["Hi!", "Bye!"], "bad": ["No.", "Hi!"]})
    pq.write_table(table, tmp_path / "p.parquet")
    pairs = PreferencePairs(path=str(tmp_path / "p.parquet"), tokenizer=MINIMIND, seq_len=48, loading=ORDERED,
                            columns={"prompt": "instruction", "chosen": "good", "rejected": "bad"})
    batch = next(pairs.load(batch=2).stream(Partition()))
    tokenizer = load_tokenizer(MINIMIND)
    answers = [[tokenizer.decode(batch["input_ids"][r, s][batch["completion_mask"][r, s] == 1]) for s in (0, 1)]
               for r in (0, 1)]
    assert [[a.split("<")[0].strip() for a in row] for row in answers] == [["Hi!", "No."], ["Bye!", "Hi!"]]


BROKEN_BOUNDARY = (  # the generation prompt opens a think block that a rendered answer never has
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def test_a_template_whose_prompt_is_not_a_prefix_is_refused_naming_the_pair():
    records = ({"prompt": "Hi", "chosen": "Hello", "rejected": "Go away"},) * 2
    with pytest.raises(DataError) as caught:
        PreferencePairs(records=records, tokenizer=QWEN3, chat_template=BROKEN_BOUNDARY, seq_len=64).load(batch=2)
    message = str(caught.value)
    assert message.startswith("pair 0 (PreferencePairs.records item 0): the prompt rendered with the "
                              "generation prompt is not a token prefix of the prompt followed by the chosen answer")
    assert "'<think>'" in message and "give token ids with masks" in message
