"""Resuming a data stream from its saved state tokenizes only what it reads next.

A stream's `state()` names the record its next batch starts at; a checkpoint keeps it, so a
resumed run costs the same at batch 3 as at batch 30 instead of tokenizing every record before
its position to find its place.
"""

from __future__ import annotations

import itertools
import json
import os

import jax
import numpy as np
import optax
import pytest
from conftest import SHARED_DATA

from dew_lib import LMObjective, Trainer, models
from dew_lib.data import ChatMessages, Loading, Partition, Role
from dew_lib.data.encoders import ChatEncoder
from dew_lib.data.loader import CHUNK

MINIMIND = os.path.join(SHARED_DATA, "tokenizers", "minimind")
needs_data = pytest.mark.skipif(not os.path.isdir(MINIMIND), reason="shared data not found")


@pytest.fixture(scope="module")
def sums_file(tmp_path_factory):
    """400 short conversations: several pack into each 128-token row."""
    path = tmp_path_factory.mktemp("sums") / "sums.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for i in range(400):
            out.write(json.dumps({"messages": [{"role": "user", "content": f"{i} + {i % 7}?"},
                                               {"role": "assistant", "content": str(i + i % 7)}]}) + "\n")
    return str(path)


@pytest.fixture
def tokenized(monkeypatch):
    """Records passed to the chat encoder in this process (workers=0 encodes here)."""
    counted = []
    original = ChatEncoder.__call__

    def counting(self, records):
        counted.append(len(records))
        return original(self, records)

    monkeypatch.setattr(ChatEncoder, "__call__", counting)
    return counted


def load(path):
    return ChatMessages(path=path, tokenizer=MINIMIND, seq_len=127,
                        loading=Loading(read_buffer=1)).load(batch=2)


def assert_same(first, second):
    for a, b in zip(first, second, strict=True):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@needs_data
def test_a_saved_stream_state_resumes_without_tokenizing_earlier_records(sums_file, tokenized):
    stream = load(sums_file).stream(Partition())
    batches, states = [], [stream.state()]
    for batch in itertools.islice(stream, 34):
        batches.append(dict(batch))
        states.append(stream.state())
    assert states[30]["batch"] == 30 and states[30]["record"] > 200  # about 8 records a batch

    def resume(position, state):
        tokenized.clear()
        resumed = load(sums_file).stream(Partition(), position, state)
        got = [dict(b) for b in itertools.islice(resumed, 2)]
        resumed.close()  # stop reading ahead before counting
        return got, sum(tokenized)

    early, early_count = resume(3, states[3])
    late, late_count = resume(30, states[30])
    assert_same(early, batches[3:5])
    assert_same(late, batches[30:32])
    # Two batches, the prefetched one and the chunk being encoded: the same bound at any position.
    assert early_count <= 3 * CHUNK and late_count <= 3 * CHUNK
    _, replayed = resume(30, None)  # without the state: the records before batch 30 are tokenized
    assert replayed >= states[30]["record"]


@needs_data
@pytest.mark.slow
def test_a_trainer_checkpoint_keeps_the_stream_state(sums_file, tokenized, tmp_path):
    model = models.build("causal_transformer", vocab_size=6400, emb_features=16, num_layers=1,
                         num_heads=2, mlp_features=32, max_seq_len=127)

    def fit(steps, directory=None):
        objective = LMObjective(model, 127, loss_role=Role.ASSISTANT, ema_decay=None)
        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
        return trainer.fit(load(sums_file), steps=steps, log_every=10, directory=directory,
                           checkpoint_every=30, sinks=[])

    whole = fit(32)
    fit(30, str(tmp_path / "run"))
    tokenized.clear()
    resumed = fit(32, str(tmp_path / "run"))
    assert sum(tokenized) <= 3 * CHUNK  # not the ~240 records before step 30
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
