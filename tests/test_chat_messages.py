"""ChatMessages: roles from chat templates, TRL parity, packing, sources, and refused input."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
from conftest import SHARED_DATA  # noqa: E402

from dew_lib import LMObjective, Trainer, models  # noqa: E402
from dew_lib.data import ChatMessages, DataError, HFOptions, Loading, Partition, Role, TemplateRewrite  # noqa: E402
from dew_lib.data.tokenizer import load_tokenizer  # noqa: E402
from dew_lib.train.sinks import MemorySink  # noqa: E402

QWEN3 = os.path.join(SHARED_DATA, "tokenizers", "qwen3")
MINIMIND = os.path.join(SHARED_DATA, "tokenizers", "minimind")
GSM8K = os.path.join(SHARED_DATA, "gsm8k", "train.jsonl")
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "chat", "trl_qwen3.json")
ORDERED = Loading(seed=None)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="shared data not found")


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


def gsm8k_chats(count):
    with open(GSM8K, encoding="utf-8") as handle:
        rows = [json.loads(next(handle)) for _ in range(count)]
    return [{"messages": [{"role": "user", "content": r["question"]},
                          {"role": "assistant", "content": r["answer"]}]} for r in rows]


def documents(batch):
    """(ids, roles) of every packed conversation, in row-major order."""
    out = []
    for row in range(batch["text"].shape[0]):
        segments = batch["text_segment_ids"][row]
        for segment in range(1, segments.max() + 1):
            where = segments == segment
            out.append((batch["text"][row][where].tolist(), batch["text_roles"][row][where].tolist()))
            np.testing.assert_array_equal(batch["text_positions"][row][where], np.arange(where.sum()))
    return out


# ----- parity with TRL ----------------------------------------------------------------------------


def test_ids_and_assistant_masks_equal_trl_sft_trainer(tmp_path):
    fixture = json.load(open(FIXTURE, encoding="utf-8"))
    assert fixture["trl_version"] == "1.12.0"
    path = write_jsonl(tmp_path / "c.jsonl", fixture["conversations"])
    chats = ChatMessages(path=path, val_path=path, tokenizer=QWEN3, seq_len=511,
                         chat_template=fixture["chat_template"])
    for conversation in fixture["conversations"]:
        ids, roles = chats.tokenize(conversation["messages"], conversation["tools"])
        assert ids.tolist() == conversation["input_ids"]
        assert (roles == Role.ASSISTANT).astype(int).tolist() == conversation["assistant_masks"]
    # The same through the loader: one validation pass packs each conversation once.
    packed = [doc for batch in chats.load(batch=4).val(Partition()) for doc in documents(batch)]
    assert sorted(ids for ids, _ in packed) == sorted(c["input_ids"] for c in fixture["conversations"])
    for ids, roles in packed:
        (match,) = [c for c in fixture["conversations"] if c["input_ids"] == ids]
        assert [int(r == Role.ASSISTANT) for r in roles] == match["assistant_masks"]


def test_generation_header_is_outside_the_assistant_span():
    fixture = json.load(open(FIXTURE, encoding="utf-8"))
    chats = ChatMessages(path="unused.jsonl", tokenizer=QWEN3, seq_len=64, chat_template=fixture["chat_template"])
    ids, roles = chats.tokenize([{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "2+2?"},
                                 {"role": "assistant", "content": "4"}])
    pieces = load_tokenizer(QWEN3).convert_ids_to_tokens(ids.tolist())
    labelled = list(zip(pieces, roles.tolist(), strict=True))
    start = pieces.index("<|im_start|>", 10)  # the assistant turn's header
    assert labelled[start:start + 3] == [("<|im_start|>", Role.NONE), ("assistant", Role.NONE), ("Ċ", Role.NONE)]
    answer = ["<think>", "ĊĊ", "</think>", "ĊĊ", "4", "<|im_end|>", "Ċ"]
    assert [p for p, r in labelled if r == Role.ASSISTANT] == answer
    assert {r for p, r in labelled[:start]} == {Role.SYSTEM, Role.USER}
    assert labelled[0][1] == Role.SYSTEM


# ----- the tokenizers' own templates --------------------------------------------------------------


def test_minimind_template_spans_for_plain_reasoning_and_tool_turns():
    tokenizer = load_tokenizer(MINIMIND)
    schema = {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}
    tools = [{"type": "function", "function": schema}]
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "(checked)"},
        {"role": "assistant", "content": "It is 3.", "reasoning_content": "The tool said 3."},
    ]
    chats = ChatMessages(path="unused.jsonl", tokenizer=MINIMIND, seq_len=512)
    ids, roles = chats.tokenize(messages, tools)
    assert ids.tolist() == tokenizer.apply_chat_template(messages, tools=tools)["input_ids"]
    spans = "".join(tokenizer.decode([i]) if r == Role.ASSISTANT else "\0" for i, r in zip(ids, roles))
    parts = [p for p in spans.split("\0") if p]
    assert parts[0] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
    # The generation prompt opens an empty think block; the shared "<think>\n" stays in the header.
    assert parts[1] == "The tool said 3.\n</think>\n\nIt is 3.<|im_end|>\n"
    text = tokenizer.decode(ids[roles == Role.TOOL])
    assert "<tool_response>\n3\n</tool_response>\n<tool_response>\n(checked)" in text
    assert '"name": "add"' in tokenizer.decode(ids[roles == Role.SYSTEM])  # the tool schema survives


def test_native_qwen3_template_trains_single_turns_and_refuses_rewritten_history():
    chats = ChatMessages(path="unused.jsonl", tokenizer=QWEN3, seq_len=256)
    ids, roles = chats.tokenize([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    answer = load_tokenizer(QWEN3).decode(ids[roles == Role.ASSISTANT])
    assert answer == "<think>\n\n</think>\n\nHello!<|im_end|>\n"
    # Qwen3 drops the empty think block of a finished turn from history: refused, with the place.
    with pytest.raises(TemplateRewrite, match=r"conversation: .*when message 2 \(user\) is added: token 9 is 151667 "
                                              r"\('<think>'\)"):
        chats.tokenize([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}])
    # A reasoning turn followed by a tool-role observation is append-only, so it trains.
    ids, roles = chats.tokenize([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Done."},
    ])
    assert (roles == Role.ASSISTANT).sum() > 0 and (roles == Role.TOOL).sum() > 0


def test_rewrite_errors_name_the_conversation_index_in_the_file(tmp_path):
    rows = gsm8k_chats(2)
    rows[1]["messages"] += [{"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Sure."}]
    data = ChatMessages(path=write_jsonl(tmp_path / "c.jsonl", rows), tokenizer=QWEN3, seq_len=1023,
                        loading=ORDERED).load(batch=2)
    with pytest.raises(TemplateRewrite, match=r"conversation 1 \(.*c\.jsonl line 2\): .*token \d+ is 151667"):
        next(data.stream(Partition()))


# ----- packing and training -----------------------------------------------------------------------


def test_gsm8k_packs_into_fixed_rows_that_lm_objective_reads(tmp_path):
    chats = ChatMessages(path=write_jsonl(tmp_path / "g.jsonl", gsm8k_chats(48)), tokenizer=MINIMIND,
                         seq_len=255, loading=ORDERED)
    data = chats.load(batch=4)
    assert data.records == 48 and data.batch == 4
    stream = data.stream(Partition())
    batch = next(stream)
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "text": ((4, 256), "int32"), "text_roles": ((4, 256), "int8"),
        "text_segment_ids": ((4, 256), "int32"), "text_positions": ((4, 256), "int32")}
    assert batch["text_segment_ids"].max() > 1  # several conversations share a row
    padding = batch["text_segment_ids"] == 0
    assert (batch["text_roles"][padding] == Role.NONE).all() and (batch["text"][padding] == 0).all()
    first = documents(batch)[0]
    expected_ids, expected_roles = chats.tokenize(gsm8k_chats(1)[0]["messages"])
    assert first == (expected_ids.tolist(), expected_roles.tolist())

    model = models.build("causal_transformer", vocab_size=6400, emb_features=16, num_layers=1, num_heads=2,
                         mlp_features=32, max_seq_len=255)
    objective = LMObjective(model, 255, loss_role=Role.ASSISTANT, ema_decay=None)
    sink = MemorySink()
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    state = trainer.fit(data, steps=3, log_every=1, sinks=[sink])
    assert int(state.step) == 3
    losses = [metrics["loss"] for _, metrics in sink.history]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_long_conversations_are_cut_or_refused(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", gsm8k_chats(3))
    batch = next(ChatMessages(path=path, tokenizer=MINIMIND, seq_len=15, loading=ORDERED).load(batch=3)
                 .stream(Partition()))
    assert (batch["text_segment_ids"] == 1).all()  # each cut to exactly L + 1 = 16 tokens
    refusing = ChatMessages(path=path, tokenizer=MINIMIND, seq_len=15, overflow="raise", loading=ORDERED)
    with pytest.raises(DataError, match=r"conversation 0 \(.*g\.jsonl line 1\): .* tokens, more than seq_len \+ 1"):
        next(refusing.load(batch=3).stream(Partition()))


# ----- sources ------------------------------------------------------------------------------------


def test_verl_prompt_column_and_tools_column_from_parquet(tmp_path):
    schema = {"name": "calc_gsm8k_reward", "description": "Grade.", "parameters": {"type": "object", "properties": {}}}
    tools = [{"type": "function", "function": schema}]
    table = pa.table({
        "prompt": [[{"role": "user", "content": "What is two plus two?"},
                    {"role": "assistant", "content": "Four."}]],
        "tools": [json.dumps(tools)],
        "data_source": ["demo"],
    })
    pq.write_table(table, tmp_path / "verl.parquet")
    chats = ChatMessages(path=str(tmp_path / "verl.parquet"), tokenizer=MINIMIND, seq_len=255, loading=ORDERED)
    (ids, roles), = documents(next(chats.load(batch=1).stream(Partition())))
    tokenizer = load_tokenizer(MINIMIND)
    assert "calc_gsm8k_reward" in tokenizer.decode([i for i, r in zip(ids, roles) if r == Role.USER])
    assert tokenizer.decode([i for i, r in zip(ids, roles) if r == Role.ASSISTANT]) == "Four.<|im_end|>\n"


def test_hugging_face_datasets_saved_locally(tmp_path):
    import datasets

    rows = gsm8k_chats(6)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "repo" / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet"))
    reference = next(ChatMessages(path=write_jsonl(tmp_path / "g.jsonl", rows), tokenizer=MINIMIND, seq_len=255,
                                  loading=ORDERED).load(batch=2).stream(Partition()))
    for path, options in ((tmp_path / "saved", None), (tmp_path / "repo", HFOptions(data_dir="data"))):
        batch = next(ChatMessages(path=str(path), split="train", options=options, tokenizer=MINIMIND, seq_len=255,
                                  loading=ORDERED).load(batch=2).stream(Partition()))
        for name in reference:
            np.testing.assert_array_equal(batch[name], reference[name])
    with pytest.raises(DataError, match="no split 'test'"):
        ChatMessages(path=str(tmp_path / "saved"), split="test", tokenizer=MINIMIND, seq_len=8).load(batch=1)


# ----- refused input ------------------------------------------------------------------------------


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(gsm8k_chats(1)[0]) + "\n\n" + '{"messages": [{"role": "user"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 3: not valid JSON"):
        ChatMessages(path=str(path), tokenizer=MINIMIND, seq_len=8).load(batch=1)


def test_missing_column_unknown_role_and_empty_file(tmp_path):
    pq.write_table(pa.table({"text": ["hello"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: missing column 'messages'.*columns are \['text'\]"):
        ChatMessages(path=str(tmp_path / "t.parquet"), tokenizer=MINIMIND, seq_len=8).load(batch=1)
    rows = gsm8k_chats(2) + [{"conversation": []}]
    with pytest.raises(DataError, match=r"conversation 2 \(.*m\.jsonl line 3\): missing column 'messages'"):
        ChatMessages(path=write_jsonl(tmp_path / "m.jsonl", rows), tokenizer=MINIMIND, seq_len=8).load(batch=1)
    rows = gsm8k_chats(1) + [{"messages": [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}]}]
    with pytest.raises(DataError, match=r"conversation 1 \(.*r\.jsonl line 2\): message 1 has unknown role 'narrator'"):
        ChatMessages(path=write_jsonl(tmp_path / "r.jsonl", rows), tokenizer=MINIMIND, seq_len=8).load(batch=1)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file holds no records"):
        ChatMessages(path=str(tmp_path / "empty.jsonl"), tokenizer=MINIMIND, seq_len=8).load(batch=1)


def test_conversations_must_start_with_system_or_user(tmp_path):
    rows = [{"messages": [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}]}]
    with pytest.raises(DataError, match=r"line 1\): the conversation starts with a assistant message"):
        ChatMessages(path=write_jsonl(tmp_path / "a.jsonl", rows), tokenizer=MINIMIND, seq_len=8).load(batch=1)


def test_template_without_assistant_boundaries_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", gsm8k_chats(1))
    for template in ("{% for m in messages %}{{ m.content }}\n{% endfor %}",
                     "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"):
        with pytest.raises(DataError, match="has no assistant boundaries"):
            ChatMessages(path=path, tokenizer=MINIMIND, seq_len=8, chat_template=template).load(batch=1)


def test_options_are_checked_with_the_field_name():
    with pytest.raises(ValueError, match="ChatMessages.seq_len"):
        ChatMessages(path="x.jsonl", tokenizer=MINIMIND, seq_len=0)
    with pytest.raises(ValueError, match="ChatMessages.overflow must be one of"):
        ChatMessages(path="x.jsonl", tokenizer=MINIMIND, seq_len=8, overflow="wrap")
    with pytest.raises(DataError, match="tokenizer '/nonexistent/tok': no such directory"):
        ChatMessages(path="x.jsonl", tokenizer="/nonexistent/tok", seq_len=8).renderer()


# ----- encoding a longer render from a shorter one ------------------------------------------------


def test_extending_an_earlier_render_encodes_exactly_as_encoding_it_whole():
    fixture = json.load(open(FIXTURE, encoding="utf-8"))
    conversations = [(c["messages"], c["tools"]) for c in fixture["conversations"]]
    conversations += [(c["messages"], None) for c in gsm8k_chats(20)]
    for name, template in ((QWEN3, fixture["chat_template"]), (MINIMIND, None)):
        renderer = ChatMessages(path="unused.jsonl", tokenizer=name, seq_len=8, chat_template=template).renderer()
        for messages, tools in conversations:
            texts, bases = [], []
            for count in range(1, len(messages) + 1):
                for generation in (True, False):
                    texts.append(renderer.render(messages[:count], tools, generation))
                    bases.append(len(texts) - 2 if len(texts) > 1 else None)
            assert renderer.encode_extending(texts, bases) == renderer.encode(texts)


def test_splits_at_needs_an_added_token_that_nothing_spans():
    from dew_lib.data.tokenizer import Renderer

    class Added:
        def __init__(self, content):
            self.content, self.lstrip, self.single_word, self.normalized = content, False, False, False

    class Fake:
        chat_template = "{{ messages }}"
        added_tokens_decoder = {0: Added("<s>"), 1: Added("x<s>")}

    renderer = Renderer(Fake())
    assert renderer.splits_at("ab<s>c", 2)
    assert not renderer.splits_at("ab<s>c", 1)  # no added token starts there
    assert not renderer.splits_at("ax<s>c", 2)  # "x<s>" spans the split
