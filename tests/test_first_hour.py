"""What a newcomer meets first: vocabulary sizing, fit telling what it did, build's option list,
and no torch notice from transformers."""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import SHARED_DATA, tiny_model

from dew_lib import Dataset, LMObjective, Trainer
from dew_lib.data import vocab_size_for
from dew_lib.train.sinks import LineLog, MemorySink, ProgressBar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = os.path.join(SHARED_DATA, "tokenizers", "qwen3")
FIXTURE_QWEN3 = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3")
MODEL = tiny_model()  # vocab_size 32


def repeating(batch, rows=4):
    return Dataset(train=lambda partition: itertools.repeat(batch), batch=rows)


def trainer():
    return Trainer(LMObjective(MODEL, seq_len=8, ema_decay=None), optax.sgd(0.1), key=jax.random.key(0))


def text(high=31, dtype=np.int32):
    row = np.arange(9) % 31 + 1
    row[-1] = high
    return np.tile(row, (4, 1)).astype(dtype)


# ----- item 1: sizing the vocabulary (refusals are in test_bad_input.py) ---------------------------


def test_the_largest_valid_id_trains():
    run = trainer()
    state = run.fit(repeating({"text": text(high=31)}), steps=1, sinks=[])
    assert int(state.step) == 1 and run.compilations["train_step"] == 1


@pytest.mark.skipif(not os.path.isdir(QWEN3), reason="shared data not found")
def test_vocab_size_for_counts_added_tokens_and_rounds_up():
    from dew_lib.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(QWEN3)
    assert tokenizer.vocab_size == 151_643  # the trap: added tokens are left out
    assert vocab_size_for(tokenizer, multiple=1) == len(tokenizer) == 151_669
    assert tokenizer.convert_tokens_to_ids("</think>") == 151_668  # the largest id
    assert vocab_size_for(QWEN3) == 151_680 == 1185 * 128
    assert vocab_size_for(FIXTURE_QWEN3, multiple=64) == 64  # 46 tokens


def test_vocab_size_for_refuses_a_bad_multiple():
    with pytest.raises(ValueError, match=r"multiple=...\) must be a positive integer, got 0"):
        vocab_size_for(FIXTURE_QWEN3, multiple=0)


# ----- item 5: fit says what it did (build's option list is in test_bad_input.py) ------------------


def test_fit_with_zero_steps_says_there_is_nothing_to_train():
    sink, stream = MemorySink(), io.StringIO()
    state = trainer().fit(repeating({"text": text()}), steps=0, sinks=[sink, LineLog(stream)])
    assert int(state.step) == 0 and sink.history == []
    assert sink.notes == [(0, "nothing to train: steps=0 and the state is at step 0; returning it unchanged")]
    assert stream.getvalue() == sink.notes[0][1] + "\n"


def test_a_rerun_of_a_finished_run_says_so_and_a_longer_one_resumes(tmp_path):
    data = repeating({"text": text()})
    trainer().fit(data, steps=2, directory=str(tmp_path), sinks=[])
    finished = MemorySink()
    state = trainer().fit(data, steps=2, directory=str(tmp_path), sinks=[finished])
    assert int(state.step) == 2 and finished.history == []
    ((step, note),) = finished.notes
    assert step == 2 and note.startswith(f"nothing to train: the checkpoint {tmp_path}/2 is already at "
                                         "step 2 of steps=2")
    longer = MemorySink()
    state = trainer().fit(data, steps=3, log_every=1, directory=str(tmp_path), sinks=[longer])
    assert int(state.step) == 3 and [s for s, _ in longer.history] == [3]
    assert longer.notes == [(2, f"resuming from the checkpoint {tmp_path}/2: steps 3..3 remain")]


def test_the_progress_bar_prints_no_blank_line_when_nothing_trains():
    stream = io.StringIO()
    trainer().fit(repeating({"text": text()}), steps=0, sinks=[ProgressBar(stream)])
    assert stream.getvalue() == "nothing to train: steps=0 and the state is at step 0; returning it unchanged\n"


# ----- item 6: transformers' torch notice -----------------------------------------------------------


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


@pytest.mark.slow  # a fresh interpreter imports JAX and transformers
def test_importing_dew_and_tokenizing_prints_no_torch_notice_but_other_warnings_still_show():
    code = (
        "import logging, dew_lib\n"
        "from dew_lib.data.tokenizer import load_tokenizer\n"
        f"load_tokenizer({FIXTURE_QWEN3!r})\n"
        "from transformers.utils import logging as hf_logging\n"
        "log = hf_logging.get_logger('transformers')\n"
        # the notice itself, as transformers words it, and two messages that must still print
        "log.warning_advice(\"PyTorch was not found. Models won't be available.\")\n"
        "log.warning_advice('an advisory warning')\n"
        "hf_logging.get_logger('transformers.tokenization_utils_base').warning('a module warning')\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert "PyTorch was not found" not in done.stderr
    assert "an advisory warning" in done.stderr and "a module warning" in done.stderr


@pytest.mark.slow  # a fresh interpreter imports JAX and transformers
def test_loader_workers_print_no_torch_notice(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(
        '{"messages": [{"role": "user", "content": "what is two"}, '
        '{"role": "assistant", "content": "two"}]}\n' for _ in range(8)), encoding="utf-8")
    template = "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    template += "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    code = (
        "from dew_lib.data import ChatMessages, Loading, Partition\n"
        f"data = ChatMessages(path={str(path)!r}, tokenizer={FIXTURE_QWEN3!r}, seq_len=31, "
        f"chat_template={template!r}, loading=Loading(workers=2)).load(batch=2)\n"
        "next(data.stream(Partition()))\n"
        "print('batch read')\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert "batch read" in done.stdout and "PyTorch was not found" not in done.stderr
