"""Bad input at every public entry point: one test per case, one error each.

Each error is raised before anything compiles where the input allows it, and its message names
where the problem is (file and line or row, field, option), the value, and the fix. The loaders'
cases fail in `load()`, except those that need the chat template to find (listed in docs/data.md),
which fail when the stream reaches the record and still name it.
"""

from __future__ import annotations

import itertools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SHARED_DATA, tiny_model

from dew_lib import Dataset, LMObjective, Trainer, models
from dew_lib.data import ChatMessages, DataError, Partition, PreferencePairs, Prompts, Role
from dew_lib.models import load_pretrained
from dew_lib.models.pretrained.families import UnsupportedCheckpoint
from dew_lib.sampling import _generate, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3")  # 46 tokens, shipped
QWEN3_CHECKPOINT = TOKENIZER
CHATML = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
MODEL = tiny_model()  # vocab_size 32, max_seq_len 32
NO_COMPILATION = {"init": 0, "train_step": 0, "eval_step": 0}


def refused(error_type, call, *parts) -> str:
    """Run `call`, expect `error_type`, check each part (text, or a compiled regex) is in the message."""
    with pytest.raises(error_type) as caught:
        call()
    message = str(caught.value)
    for part in parts:
        found = part.search(message) if isinstance(part, re.Pattern) else part in message
        assert found, f"{part!r} not in {message!r}"
    return message


def jsonl(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def chat(role, content):
    return {"role": role, "content": content}


GOOD = {"messages": [chat("user", "what is two"), chat("assistant", "two")]}


def chats(path, **options):
    options.setdefault("chat_template", CHATML)
    return ChatMessages(path=path, tokenizer=TOKENIZER, seq_len=31, **options)


# ----- ChatMessages: found by load() ----------------------------------------------------------------


def test_chat_a_message_with_text_instead_of_content_fails_at_load(tmp_path):
    path = jsonl(tmp_path, "c.jsonl", [GOOD, {"messages": [{"role": "user", "text": "hi"}]}])
    refused(DataError, lambda: chats(path).load(batch=1),
            "conversation 1 (", "c.jsonl line 2): message 0 (user) has no 'content'",
            "its fields are ['role', 'text']", "rename its 'text' field to 'content'")


def test_chat_parquet_message_without_content_fails_at_load(tmp_path):
    # Arrow gives every message every field of the column: the bad one holds content=None.
    table = pa.table({"messages": [GOOD["messages"], [{"role": "user", "text": "hi"}]]})
    pq.write_table(table, tmp_path / "c.parquet")
    refused(DataError, lambda: chats(str(tmp_path / "c.parquet")).load(batch=1),
            "c.parquet row 1): message 0 (user) has no 'content' (its fields are ['role', 'text'])")


def test_chat_content_that_is_a_number(tmp_path):
    path = jsonl(tmp_path, "c.jsonl", [{"messages": [chat("user", 4), chat("assistant", "x")]}])
    refused(DataError, lambda: chats(path).load(batch=1),
            "line 1): message 0 (user) has content int 4; content must be a string or a list of content parts")


def test_chat_sharegpt_messages_are_named_as_such(tmp_path):
    path = jsonl(tmp_path, "c.jsonl", [{"messages": [{"from": "human", "value": "hi"}]}])
    refused(DataError, lambda: chats(path).load(batch=1),
            "message 0 has unknown role None", "ShareGPT's layout ('from'/'value')")


def test_chat_a_tool_call_without_a_function_name(tmp_path):
    calls = [{"type": "function", "function": {"arguments": {"city": "Oslo"}}}]
    path = jsonl(tmp_path, "c.jsonl", [{"messages": [chat("user", "weather?"),
                                                     {"role": "assistant", "tool_calls": calls}]}])
    refused(DataError, lambda: chats(path).load(batch=1),
            "line 1): message 1 tool call 0 is dict", "{'name': ..., 'arguments': ...}")


def test_chat_a_conversation_that_starts_with_the_assistant(tmp_path):
    path = jsonl(tmp_path, "c.jsonl", [{"messages": [chat("assistant", "hi"), chat("user", "x")]}])
    refused(DataError, lambda: chats(path).load(batch=1),
            "conversation 0 (", "starts with a assistant message; it must start with a system or user message")


def test_chat_a_completion_that_starts_with_the_user(tmp_path):
    path = jsonl(tmp_path, "c.jsonl", [{"prompt": "two?", "completion": [chat("user", "again")]}])
    refused(DataError, lambda: chats(path).load(batch=1),
            "line 1): the completion ('completion') starts with a 'user' message",
            "move earlier messages into the prompt")


def test_chat_a_record_without_its_completion(tmp_path):
    rows = [{"question": "two?", "answer": "two"}, {"question": "three?"}]
    path = jsonl(tmp_path, "qa.jsonl", rows)
    refused(DataError, lambda: chats(path, columns={"prompt": "question", "completion": "answer"}).load(batch=1),
            "conversation 1 (", "qa.jsonl line 2): missing column 'answer' (the completion)")


def test_chat_a_source_with_no_field_it_can_read(tmp_path):
    path = jsonl(tmp_path, "qa.jsonl", [{"question": "two?", "answer": "two"}])
    refused(DataError, lambda: chats(path).load(batch=1),
            "qa.jsonl: missing column 'messages'", "the columns are ['question', 'answer']",
            "columns={'prompt': ..., 'completion': ...}")


def test_chat_columns_with_an_unknown_name():
    refused(ValueError, lambda: chats("x.jsonl", columns={"answer": "completion"}),
            "ChatMessages.columns has the key 'answer'; the names it can map are ['prompt', 'completion', 'tools']")


def test_chat_a_tokenizer_directory_that_does_not_exist(tmp_path):
    path = jsonl(tmp_path, "c.jsonl", [GOOD])
    refused(DataError, lambda: ChatMessages(path=path, tokenizer="no/such/tokenizer", seq_len=31).load(batch=1),
            "tokenizer 'no/such/tokenizer': no such directory")


def test_chat_a_malformed_json_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + '{"messages": [\n', encoding="utf-8")
    refused(DataError, lambda: chats(str(path)).load(batch=1),
            "c.jsonl line 2: not valid JSON", "each line of a .jsonl file must hold one complete JSON object")


# ----- ChatMessages: found when the stream reaches the record (it needs the template) ---------------


def test_chat_a_conversation_too_long_with_overflow_raise_names_the_record(tmp_path):
    long = {"messages": [chat("user", "what is two " * 20), chat("assistant", "two")]}
    data = chats(jsonl(tmp_path, "c.jsonl", [GOOD, long]), overflow="raise").load(batch=1)
    stream = data.stream(Partition())
    refused(DataError, lambda: list(itertools.islice(stream, 3)),
            "conversation 1 (", "c.jsonl line 2): the conversation has", "more than seq_len + 1 = 32",
            "overflow='truncate'")


# ----- PreferencePairs ------------------------------------------------------------------------------


def test_pairs_text_without_a_tokenizer():
    records = ({"prompt": "two?", "chosen": "two", "rejected": "three"},)
    refused(DataError, lambda: PreferencePairs(records=records, seq_len=16).load(batch=1),
            "pair 0 (PreferencePairs.records item 0): the answers are text, which needs a tokenizer",
            "PreferencePairs(tokenizer=...)")


def test_pairs_text_without_a_prompt():
    records = ({"chosen": "Human: two? Assistant: two", "rejected": "Human: two? Assistant: three"},)
    refused(DataError, lambda: PreferencePairs(records=records, seq_len=64, tokenizer=TOKENIZER,
                                               chat_template=CHATML).load(batch=1),
            "pair 0 (PreferencePairs.records item 0): missing column 'prompt'",
            "give token ids with chosen_mask and rejected_mask instead")


def test_pairs_text_with_a_mask():
    records = ({"prompt": "two?", "chosen": "two", "rejected": "three", "chosen_mask": [1]},)
    refused(DataError, lambda: PreferencePairs(records=records, seq_len=64, tokenizer=TOKENIZER,
                                               chat_template=CHATML).load(batch=1),
            "pair 0 (PreferencePairs.records item 0): field 'chosen_mask' is given with text answers")


def test_pairs_text_longer_than_seq_len():
    records = ({"prompt": "what is two", "chosen": "two", "rejected": "three"},)
    refused(DataError, lambda: PreferencePairs(records=records, seq_len=8, tokenizer=TOKENIZER,
                                               chat_template=CHATML).load(batch=1),
            "pair 0 (PreferencePairs.records item 0): field 'chosen' has", "more than seq_len=8",
            "raise seq_len or drop the pair")


def test_pairs_ids_with_a_float(tmp_path):
    path = jsonl(tmp_path, "p.jsonl", [{"chosen": [1, 2], "rejected": [1, 2.5]}])
    refused(DataError, lambda: PreferencePairs(path=path, seq_len=8).load(batch=1),
            "pair 0 (", "p.jsonl line 1): field 'rejected' item 1 is 2.5 (float); token ids must be integers")


# ----- Prompts --------------------------------------------------------------------------------------


def test_prompts_a_prompt_that_is_a_number():
    refused(DataError, lambda: Prompts(records=({"prompt": 7},), max_prompt_len=8).load(batch=1),
            "prompt 0 (Prompts.records item 0): the prompt is neither token ids, a string nor a list of messages",
            "got int 7")


def test_prompts_messages_without_content():
    records = ({"prompt": [{"role": "user", "text": "hi"}]},)
    refused(DataError, lambda: Prompts(records=records, max_prompt_len=8, tokenizer=TOKENIZER).load(batch=1),
            "prompt 0 (Prompts.records item 0): message 0 (user) has no 'content'")


# ----- Trainer.fit: refused on the host before anything compiles ------------------------------------


def fit_refused(error_type, batch, *parts, objective=None, **fit_options):
    trainer = Trainer(objective or LMObjective(MODEL, seq_len=8, ema_decay=None), optax.sgd(0.1),
                      key=jax.random.key(0))
    data = Dataset(train=lambda partition: itertools.repeat(batch), batch=4)
    fit_options.setdefault("steps", 2)
    refused(error_type, lambda: trainer.fit(data, sinks=[], **fit_options), *parts)
    assert trainer.compilations == NO_COMPILATION


def rows(high=31, dtype=np.int32, width=9):
    text = np.tile(np.arange(1, width + 1), (4, 1))
    text[:, -1] = high
    return text.astype(dtype)


def test_fit_an_id_past_the_vocabulary():
    fit_refused(ValueError, {"text": rows(high=40)}, "batch field 'text' holds token id 40",
                "the model's vocab_size is 32", "vocab_size >= 41", "len(tokenizer)")


QWEN3 = os.path.join(SHARED_DATA, "tokenizers", "qwen3")


@pytest.mark.skipif(not os.path.isdir(QWEN3), reason="shared data not found")
def test_fit_sft_on_qwen3_chats_with_a_model_sized_by_tokenizer_vocab_size(tmp_path):
    # The trap of the issue: tokenizer.vocab_size (151,643) leaves out the added tokens.
    from dew_lib.data.tokenizer import load_tokenizer

    path = jsonl(tmp_path, "c.jsonl", [GOOD] * 4)
    data = ChatMessages(path=path, tokenizer=QWEN3, seq_len=31).load(batch=4)
    model = tiny_model(vocab_size=load_tokenizer(QWEN3).vocab_size)
    trainer = Trainer(LMObjective(model, seq_len=31, loss_role=Role.ASSISTANT), optax.sgd(0.1),
                      key=jax.random.key(0))
    refused(ValueError, lambda: trainer.fit(data, steps=2, sinks=[]),
            "batch field 'text' holds token id 151668, but the model's vocab_size is 151643",
            "vocab_size >= 151669", "len(tokenizer)")
    assert trainer.compilations == NO_COMPILATION


@pytest.mark.skipif(not os.path.isdir(QWEN3), reason="shared data not found")
def test_fit_dpo_on_qwen3_text_pairs_with_a_model_sized_by_tokenizer_vocab_size():
    from dew_lib.data.tokenizer import load_tokenizer
    from dew_lib.objectives import DPOObjective

    records = ({"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"},) * 4
    data = PreferencePairs(records=records, tokenizer=QWEN3, seq_len=32).load(batch=4)
    model = tiny_model(vocab_size=load_tokenizer(QWEN3).vocab_size)
    trainer = Trainer(DPOObjective(model, seq_len=31), optax.sgd(0.1), key=jax.random.key(0))
    refused(ValueError, lambda: trainer.fit(data, steps=2, sinks=[]),
            "batch field 'input_ids' holds token id 151668, but the model's vocab_size is 151643")
    assert trainer.compilations == NO_COMPILATION


def test_fit_a_negative_id():
    fit_refused(ValueError, {"text": rows(high=-1)}, "batch field 'text' holds a negative token id (-1)")


def test_fit_float_ids():
    fit_refused(TypeError, {"text": rows(dtype=np.float32)}, "batch field 'text' holds float32 values",
                ".astype(np.int32)")


def test_fit_a_batch_without_text():
    fit_refused(KeyError, {"tokens": rows()}, "LMObjective needs a 'text' field [B, 9]", "tokens: (4, 9) int32")


def test_fit_a_row_width_that_does_not_match_seq_len():
    fit_refused(ValueError, {"text": rows(width=12)}, "batch field 'text' has shape (4, 12)",
                "expected [B, seq_len + 1] = [B, 9]", "LMObjective(seq_len=...)")


def test_fit_loss_role_without_roles():
    objective = LMObjective(MODEL, seq_len=8, loss_role=Role.ASSISTANT, ema_decay=None)
    fit_refused(KeyError, {"text": rows()}, "LMObjective(loss_role=ASSISTANT) needs 'text_roles'",
                objective=objective)


def test_fit_roles_of_another_shape():
    fit_refused(ValueError, {"text": rows(), "text_roles": np.zeros((4, 5), np.int8)},
                "batch field 'text_roles' has shape (4, 5), but 'text' has (4, 9)")


def test_fit_negative_steps():
    fit_refused(ValueError, {"text": rows()}, "fit(steps=...) must be >= 0, got -1", steps=-1)


def test_fit_eval_every_without_validation_data():
    fit_refused(ValueError, {"text": rows()}, "fit(eval_every=...) needs a positive interval and a Dataset with val",
                eval_every=1)


def test_fit_a_stream_that_ends_before_steps():
    trainer = Trainer(LMObjective(MODEL, seq_len=8, ema_decay=None), optax.sgd(0.1), key=jax.random.key(0))
    data = Dataset(train=lambda partition: iter([{"text": rows()}]), batch=4)
    refused(ValueError, lambda: trainer.fit(data, steps=3, sinks=[]),
            "the training stream ended after 1 batches, before steps=3", "itertools.cycle")


# ----- models.build ---------------------------------------------------------------------------------

SIZES = dict(vocab_size=32, emb_features=16, num_layers=1, num_heads=4, mlp_features=32, max_seq_len=16)


def test_build_an_unknown_model():
    refused(ValueError, lambda: models.build("gpt2", **SIZES),
            "unknown model 'gpt2'; registered models: ['causal_transformer']")


def test_build_a_misspelt_option():
    message = refused(TypeError, lambda: models.build("causal_transformer", **SIZES, num_kv_head=2),
                      "models.build('causal_transformer'): unknown option 'num_kv_head' (did you mean "
                      "'num_kv_heads'?)", "the required options are vocab_size, emb_features")
    for name in ("head_dim", "qk_norm", "tie_embeddings", "rope_scaling", "param_dtype"):
        assert name in message


def test_build_a_missing_option():
    options = {k: v for k, v in SIZES.items() if k != "num_layers"}
    refused(TypeError, lambda: models.build("causal_transformer", **options),
            "missing required option num_layers")


def test_build_heads_that_do_not_group():
    refused(ValueError, lambda: models.build("causal_transformer", **{**SIZES, "num_heads": 3}, num_kv_heads=2),
            "models.build('causal_transformer'): num_heads=3 must be a multiple of num_kv_heads=2")


def test_build_a_width_that_does_not_split_into_heads():
    refused(ValueError, lambda: models.build("causal_transformer", **{**SIZES, "num_heads": 3}),
            "emb_features=16 does not divide into num_heads=3", "set head_dim explicitly")


def test_build_a_size_that_is_not_a_positive_integer():
    refused(ValueError, lambda: models.build("causal_transformer", **{**SIZES, "vocab_size": 0}),
            "vocab_size must be a positive integer, got 0")


def test_build_an_unknown_dtype_name():
    refused(ValueError, lambda: models.build("causal_transformer", **SIZES, dtype="fp8"),
            "dtype='fp8' is not a known dtype; use one of ['bf16', 'bfloat16', 'f32', 'float32']")


# ----- load_pretrained ------------------------------------------------------------------------------


def test_load_pretrained_a_directory_that_does_not_exist(tmp_path):
    refused(FileNotFoundError, lambda: load_pretrained(str(tmp_path / "Qwen3-0.6B")),
            "Qwen3-0.6B: no such directory", "download the checkpoint there first")


def test_load_pretrained_a_directory_without_config(tmp_path):
    refused(FileNotFoundError, lambda: load_pretrained(str(tmp_path)),
            f"{tmp_path}/config.json not found; a Hugging Face checkpoint needs one")


def test_load_pretrained_an_unsupported_architecture(tmp_path):
    for name in os.listdir(QWEN3_CHECKPOINT):
        (tmp_path / name).symlink_to(os.path.join(QWEN3_CHECKPOINT, name))
    config = json.load(open(os.path.join(QWEN3_CHECKPOINT, "config.json")))
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    refused(UnsupportedCheckpoint, lambda: load_pretrained(str(tmp_path)), "GPT2LMHeadModel",
            "Qwen3ForCausalLM")


# ----- generate: refused on the host before compiling -----------------------------------------------


@pytest.fixture(scope="module")
def variables():
    return jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def generate_refused(error_type, variables, prompt, lengths, *parts, **options):
    options.setdefault("max_new_tokens", 4)
    before = _generate._cache_size()
    refused(error_type, lambda: generate(MODEL, variables, prompt, lengths, key=jax.random.key(0), **options),
            *parts)
    assert _generate._cache_size() == before


def test_generate_a_prompt_id_past_the_vocabulary(variables):
    generate_refused(ValueError, variables, np.array([[1, 2, 99]], np.int32), np.array([3]),
                     "'prompt' holds token id 99, but the model's vocab_size is 32")


def test_generate_float_prompt_ids(variables):
    generate_refused(TypeError, variables, np.array([[1.0, 2.0]], np.float32), np.array([2]),
                     "'prompt' holds float32 values; token ids must be integers")


def test_generate_float_prompt_ids_on_the_device(variables):
    generate_refused(TypeError, variables, jnp.array([[1.0, 2.0]]), np.array([2]),
                     "prompt holds float32 values; token ids must be integers")


def test_generate_a_prompt_length_of_zero(variables):
    generate_refused(ValueError, variables, np.array([[1, 2]], np.int32), np.array([0]),
                     "prompt_length must be in [1, 2], got [0]")


def test_generate_a_budget_past_max_seq_len(variables):
    generate_refused(ValueError, variables, np.array([[1, 2]], np.int32), np.array([2]),
                     "prompt width 2 + max_new_tokens 40 exceeds the model's max_seq_len=32",
                     max_new_tokens=40)


def test_generate_a_flat_prompt(variables):
    generate_refused(ValueError, variables, np.array([1, 2], np.int32), np.array([2]),
                     "generate needs prompt [B, P] and prompt_length [B]")
