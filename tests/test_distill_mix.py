"""On-policy distillation's mix with the data's completions (`lmbda < 1`, TRL GKD's lmbda): Prompts'
completion column (ids and strings, cut, refused), conversations split at their last answer, and
build_distill training on the mix: every step on the data at lmbda=0 (the loss is the JSD on those
exact rows), both kinds of step at lmbda=0.5. The pipeline stage (its key, and a run at lmbda=0.5)
is in tests/test_pipeline_distill.py."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHARED_DATA, tiny_model

from dew_lib import recipes
from dew_lib.data import ChatMessages, DataError, Loading, Partition, Prompts
from dew_lib.data.arithmetic import problems, solution
from dew_lib.data.byte_bpe import train_byte_bpe
from dew_lib.data.chat import Role
from dew_lib.data.prompts import last_turns
from dew_lib.data.template import Conversation
from dew_lib.data.tokenizer import load_tokenizer
from dew_lib.objectives.distill import generalized_jsd
from dew_lib.recipes import DistillOptions, build_distill
from dew_lib.train.sinks import MemorySink
from dew_lib.train.trainer import Trainer

MINIMIND = os.path.join(SHARED_DATA, "tokenizers", "minimind")
needs_data = pytest.mark.skipif(not os.path.isdir(MINIMIND), reason=f"no MiniMind tokenizer at {MINIMIND}; "
                                "set DEW_SHARED_DATA")
ORDERED = Loading(seed=None, workers=0)


def first(prompts: Prompts, batch: int):
    return next(prompts.load(batch=batch).stream(Partition()))


# ----- Prompts' completion column ---------------------------------------------------------------

def test_id_completions_are_right_padded_and_keep_their_start_without_a_tokenizer():
    records = (json.dumps({"prompt": [5, 6, 7], "answer": [1, 2]}),
               json.dumps({"prompt": [8], "answer": [3, 4, 5, 6, 7]}),  # cut to its first 4
               json.dumps({"prompt": [1, 2, 3, 4, 5], "answer": [9]}))
    # The tokenizer path does not exist: id prompts and id completions never load one.
    spec = Prompts(records=records, max_prompt_len=4, pad_id=0, tokenizer="/nonexistent/tok", completion="answer",
                   max_completion_len=4, loading=ORDERED)
    batch = first(spec, 3)
    assert batch["prompt"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 8], [2, 3, 4, 5]]
    assert batch["completion"].tolist() == [[1, 2, 0, 0], [3, 4, 5, 6], [9, 0, 0, 0]]
    assert batch["completion_length"].tolist() == [2, 4, 1]
    assert batch["completion"].dtype == batch["completion_length"].dtype == np.int32
    # Without the column the batch is what it always was: no completion fields.
    plain = first(Prompts(records=records, max_prompt_len=4, loading=ORDERED), 3)
    assert "completion" not in plain and "completion_length" not in plain
    assert plain["prompt"].tolist() == batch["prompt"].tolist()


@needs_data
def test_string_completions_are_tokenized_without_special_tokens_and_end_in_eos():
    tokenizer = load_tokenizer(MINIMIND)
    eos = tokenizer.eos_token_id
    messages = [{"role": "user", "content": "1+1?"}]
    records = (json.dumps({"prompt": messages, "completion": "It is 2."}),
               json.dumps({"prompt": "Once upon a time", "completion": [7, 8, 9]}),  # ids as they are
               json.dumps({"prompt": [4, 5], "completion": " there was a long and winding story to tell"}))
    spec = Prompts(records=records, max_prompt_len=64, tokenizer=MINIMIND, completion="completion",
                   max_completion_len=6, completion_eos=eos, pad_id=0, loading=ORDERED)
    batch = first(spec, 3)
    short = tokenizer("It is 2.", add_special_tokens=False)["input_ids"] + [eos]
    long = tokenizer(" there was a long and winding story to tell", add_special_tokens=False)["input_ids"]
    assert len(short) <= 6 < len(long)
    expected = [short + [0] * (6 - len(short)), [7, 8, 9, 0, 0, 0], long[:6]]  # the long one is cut: no eos
    assert batch["completion"].tolist() == expected
    assert batch["completion_length"].tolist() == [len(short), 3, 6]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert batch["prompt"][0, 64 - len(prompt):].tolist() == prompt and batch["prompt_length"][0] == len(prompt)
    # A worker process tokenizes them the same way.
    pooled = first(dataclasses.replace(spec, loading=Loading(seed=None, workers=1)), 3)
    assert all(np.array_equal(pooled[name], batch[name]) for name in batch)


@needs_data
def test_a_missing_or_malformed_completion_is_refused_naming_the_record_and_the_column():
    def load(*records, **options):
        options = {"max_completion_len": 4, "completion": "answer", **options}
        return Prompts(records=tuple(json.dumps(r) for r in records), max_prompt_len=4, loading=ORDERED,
                       **options).load(batch=1)

    with pytest.raises(DataError, match=r"prompt 1 \(Prompts.records item 1\): missing column 'answer'"):
        load({"prompt": [1], "answer": [2]}, {"prompt": [1]})
    with pytest.raises(DataError, match=r"prompt 0 .*'answer'.* empty list of ids"):
        load({"prompt": [1], "answer": []})
    with pytest.raises(DataError, match=r"prompt 0 .*'answer'.* neither token ids nor a string"):
        load({"prompt": [1], "answer": {"text": "2"}})
    with pytest.raises(DataError, match=r"prompt 0 .*'answer' item 1 is -2"):
        load({"prompt": [1], "answer": [2, -2]})
    with pytest.raises(DataError, match=r"prompt 0 .*'answer'.* is a string.*completion_eos.*empty"):
        load({"prompt": [1], "answer": "two"}, tokenizer=MINIMIND)
    with pytest.raises(DataError, match=r"prompt 0 .*'answer'.* is a string, which needs a tokenizer"):
        load({"prompt": [1], "answer": "two"}, completion_eos=2)
    # The options: a width without the column, the column without a width.
    with pytest.raises(ValueError, match="Prompts.max_completion_len=4 is set and completion is empty"):
        Prompts(records=('{"prompt": [1]}',), max_prompt_len=4, max_completion_len=4)
    with pytest.raises(ValueError, match="Prompts.completion='answer' needs max_completion_len"):
        Prompts(records=('{"prompt": [1]}',), max_prompt_len=4, completion="answer")


def test_conversations_split_at_their_last_answer_give_what_sft_trains_up_to_eos(tmp_path):
    """The arithmetic demo's ChatML tokenizer: the prompt (messages before the last answer, with
    the generation prompt) and the completion (the answer's text, then eos) are, joined, the SFT
    render of the whole conversation up to its eos, and the completion is its assistant span."""
    train = problems(200, seed=0)
    corpus = (f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n{solution(p)}<|im_end|>"
              for p in train)
    directory = str(tmp_path / "tokenizer")
    tokenizer = train_byte_bpe(corpus, vocab_size=320, directory=directory)
    system = [{"role": "system", "content": "Be brief."}]
    files = {"chat.jsonl": [{"messages": train[0].messages()},
                            {"messages": system + train[1].messages() + train[2].messages()}],
             "pairs.jsonl": [{"prompt": train[3].question, "completion": solution(train[3])}]}  # prompt-completion
    conversations = []
    for name, rows in files.items():
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        chat = ChatMessages(path=str(tmp_path / name), tokenizer=directory, seq_len=96)
        conversations += chat.conversations()
    records = last_turns(conversations)
    assert records[1] == {"prompt": system + train[1].messages() + train[2].messages(False),
                          "completion": solution(train[2])}
    spec = Prompts(records=tuple(records), max_prompt_len=96, tokenizer=directory, completion="completion",
                   max_completion_len=32, completion_eos=tokenizer.eos_token_id, loading=ORDERED)
    batch = first(spec, 3)
    for row, conversation in enumerate(conversations):
        ids, roles = chat.tokenize(conversation.messages, context=conversation.context)
        prompt_length, length = int(batch["prompt_length"][row]), int(batch["completion_length"][row])
        joined = batch["prompt"][row, 96 - prompt_length:].tolist() + batch["completion"][row, :length].tolist()
        assert ids[:len(joined)].tolist() == joined and joined[-1] == tokenizer.eos_token_id
        assert batch["completion"][row, length - 1] == tokenizer.eos_token_id  # ends as a sampled one stops
        assert (roles[prompt_length:prompt_length + length] == Role.ASSISTANT).all()  # what SFT trains
        assert roles[prompt_length - 1] != Role.ASSISTANT
        # What the template renders after eos (ChatML's newline) is all that SFT's row has beyond it.
        assert tokenizer.decode(ids[len(joined):]) == "\n"


def test_last_turns_refuse_a_conversation_whose_last_answer_is_not_text():
    user = {"role": "user", "content": "hi"}
    with pytest.raises(DataError, match="c0: the conversation has no assistant message"):
        last_turns([Conversation([user], None, "c0")])
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    with pytest.raises(DataError, match=r"c1: its last assistant message \(message 1\) calls tools"):
        last_turns([Conversation([user, call], None, "c1")])
    tools = [{"type": "function", "function": {"name": "f"}}]
    answer = {"role": "assistant", "content": "4"}
    assert last_turns([Conversation([user, answer, user], tools, "c2")]) == [
        {"prompt": [user], "completion": "4", "tools": tools}]  # what follows the last answer is dropped


# ----- build_distill on the mix -------------------------------------------------------------------

P, R, VOCAB = 4, 6, 16
STUDENT = tiny_model(vocab_size=VOCAB, num_layers=1, max_seq_len=16)
TEACHER = tiny_model(vocab_size=VOCAB, emb_features=32, num_layers=2, max_seq_len=16)


def id_records(count: int, seed: int = 0) -> tuple[dict, ...]:
    rng = np.random.default_rng(seed)
    return tuple({"prompt": rng.integers(1, VOCAB, int(rng.integers(2, P + 1))).tolist(),
                  "answer": rng.integers(1, VOCAB, int(rng.integers(1, R + 1))).tolist()} for _ in range(count))


def variables(model, seed: int, scale: float = 1.0):
    init = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
    head = init["params"]["lm_head"]  # a sharp teacher, far from the fresh student
    return {"params": {**init["params"], "lm_head": jax.tree.map(lambda w: w * scale, head)}}


def distil(records, lmbda: float, steps: int, batch: int = 4):
    spec = Prompts(records=records, max_prompt_len=P, completion="answer", max_completion_len=R, loading=ORDERED)
    options = DistillOptions(lmbda=lmbda, batch=batch, max_new_tokens=R, learning_rate=1e-2, steps=steps)
    student, teacher = variables(STUDENT, 0), variables(TEACHER, 7, scale=20.0)
    built = build_distill(STUDENT, student, spec, options, teacher=(TEACHER, teacher))
    sink = MemorySink()
    trainer = Trainer(built.objective, recipes.optimizer(options), key=jax.random.key(0), rollout=built.rollout)
    trainer.fit(built.dataset, steps=steps, log_every=1, sinks=[sink])
    built.close()
    return sink, student, teacher


@pytest.mark.slow  # about 13 s on two idle cores: the update compiles
def test_lmbda_zero_trains_every_step_on_the_data_and_its_loss_is_the_jsd_of_those_rows():
    records = id_records(8)
    sink, student, teacher = distil(records, lmbda=0.0, steps=2)
    assert [metrics["on_policy"] for _, metrics in sink.history] == [0.0, 0.0]
    # Step 1's loss, at the starting weights, from each record's own ids with nothing packed.
    total, count = 0.0, 0
    for record in records[:4]:
        ids = jnp.asarray([record["prompt"] + record["answer"]], jnp.int32)
        inputs = ids[:, :-1]
        segments, positions = jnp.ones_like(inputs), jnp.arange(inputs.shape[1])[None]
        s, t = (model.apply(v, inputs, segments, positions) for model, v in ((STUDENT, student), (TEACHER, teacher)))
        answered = slice(len(record["prompt"]) - 1, None)  # the positions that predict the answer's ids
        total += float(generalized_jsd(s[0, answered], t[0, answered], 0.5).sum())
        count += len(record["answer"])
    step, metrics = sink.history[0]
    assert step == 1 and metrics["tokens"] == count
    np.testing.assert_allclose(metrics["loss"], total / count, rtol=1e-4)


@pytest.mark.slow  # about 20 s on two idle cores: the sampler and the update compile
def test_lmbda_half_mixes_the_students_samples_with_the_data():
    sink, _, _ = distil(id_records(24, seed=1), lmbda=0.5, steps=6)
    on_policy = [metrics["on_policy"] for _, metrics in sink.history]
    assert set(on_policy) == {0.0, 1.0} and 0 < np.mean(on_policy) < 1, on_policy
    assert all(np.isfinite(metrics["loss"]) for _, metrics in sink.history)


def test_build_distill_takes_lmbda_below_one_only_with_a_completion_column():
    prompts = Prompts(records=('{"prompt": [1]}',), max_prompt_len=P)
    with pytest.raises(ValueError, match=r"lmbda=0.5.*Prompts.completion is empty.*"
                                         r"Prompts\(completion=..., max_completion_len=...\).*lmbda=1.0"):
        build_distill(None, None, prompts, DistillOptions(lmbda=0.5))
    wide = Prompts(records=('{"prompt": [1], "a": [2]}',), max_prompt_len=P, completion="a", max_completion_len=9)
    with pytest.raises(ValueError, match="Prompts.max_completion_len=9 is more than DistillOptions.max_new_tokens=8"):
        build_distill(None, None, wide, DistillOptions(lmbda=0.5, max_new_tokens=8))
    with pytest.raises(ValueError, match="loss='reverse_kl' is a policy gradient"):  # still the options' own refusal
        DistillOptions(loss="reverse_kl", lmbda=0.5)
