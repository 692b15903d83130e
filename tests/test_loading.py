"""The loading engine: order, shuffling, partitions, workers, prefetch, seek and resume."""

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
from dew_lib.data import ChatMessages, Dataset, Loading, Partition, PreferencePairs, Role
from dew_lib.data.loader import Order, Planner

MINIMIND = os.path.join(SHARED_DATA, "tokenizers", "minimind")
GSM8K = os.path.join(SHARED_DATA, "gsm8k", "train.jsonl")

needs_data = pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="shared data not found")


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    """60 GSM8K rows as chat JSONL, split over two files."""
    folder = tmp_path_factory.mktemp("gsm8k")
    with open(GSM8K, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in itertools.islice(handle, 60)]
    for part in range(2):
        with open(folder / f"part{part}.jsonl", "w", encoding="utf-8") as out:
            for r in rows[part * 30:(part + 1) * 30]:
                out.write(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                                   {"role": "assistant", "content": r["answer"]}]}) + "\n")
    return sorted(str(p) for p in folder.glob("*.jsonl"))


def chats(paths, **loading):
    return ChatMessages(path=paths, tokenizer=MINIMIND, seq_len=127, loading=Loading(**loading))


def take(stream, count):
    return [dict(b) for b in itertools.islice(stream, count)]


def assert_same(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def pair_records(count):
    return tuple(json.dumps({"chosen": [i + 1, 1], "rejected": [i + 1, 2]}) for i in range(count))


# ----- order ------------------------------------------------------------------------------------


def test_epochs_are_seeded_permutations_and_partitions_are_disjoint():
    one = Order(10, 7, Partition(0, 1))
    assert sorted(one.epoch(0)) == list(range(10))
    assert list(one.epoch(0)) != list(one.epoch(1))  # reshuffled every epoch
    assert list(Order(10, 7, Partition(0, 1)).epoch(3)) == list(one.epoch(3))  # same seed, same order
    assert list(Order(10, None, Partition(0, 1)).epoch(5)) == list(range(10))  # seed None: file order
    shares = [Order(10, 7, Partition(i, 3)).epoch(2) for i in range(3)]
    assert all(len(s) == 3 for s in shares)  # equal shares; one record waits for the next epoch
    assert len(set(np.concatenate(shares))) == 9
    with pytest.raises(ValueError, match="fewer than the 4 processes"):
        Order(3, 0, Partition(0, 4))


def test_first_fit_planner():
    planner = Planner(2, 10)
    assert planner.place(6) == (0, 0)
    assert planner.place(6) == (1, 0)
    assert planner.place(4) == (0, 6)
    assert planner.place(5) is None  # closes the batch
    planner.reset()
    assert planner.place(10) == (0, 0)


def test_pair_batches_walk_the_epochs_without_dropping_records():
    data = PreferencePairs(records=pair_records(10), seq_len=2, loading=Loading(seed=None)).load(batch=4)
    batches = take(data.stream(Partition()), 5)
    firsts = [int(x) for b in batches for x in b["input_ids"][:, 0, 0]]
    assert firsts == [i % 10 + 1 for i in range(20)]  # batch 2 spans the epoch boundary


# ----- seek and resume --------------------------------------------------------------------------


@needs_data
def test_seek_equals_reading_through_mid_epoch_and_across_epochs(gsm8k_file):
    data = chats(gsm8k_file).load(batch=4)
    through = take(data.stream(Partition()), 14)  # 60 conversations make about 8 batches an epoch
    for position in (3, 9, 13):
        assert_same(take(data.stream(Partition(), position), 14 - position), through[position:])
    stream = data.train(Partition())
    take(stream, 2)
    stream.seek(11)  # seek on a stream that has been read, past its prefetch
    assert_same(take(stream, 3), through[11:14])
    # Fixed-size records seek arithmetically.
    pairs = PreferencePairs(records=pair_records(10), seq_len=2).load(batch=4)
    through = take(pairs.stream(Partition()), 6)
    assert_same(take(pairs.stream(Partition(), 4), 2), through[4:])


@needs_data
def test_training_resumed_from_a_checkpoint_equals_uninterrupted(gsm8k_file, tmp_path):
    data = chats(gsm8k_file).load(batch=2)
    model = models.build("causal_transformer", vocab_size=6400, emb_features=16, num_layers=1, num_heads=2,
                         mlp_features=32, max_seq_len=127)

    def fit(steps, directory=None):
        objective = LMObjective(model, 127, loss_role=Role.ASSISTANT, ema_decay=None)
        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
        return trainer.fit(data, steps=steps, log_every=1, directory=directory, checkpoint_every=3, sinks=[])

    whole = fit(5)
    fit(3, str(tmp_path / "run"))
    resumed = fit(5, str(tmp_path / "run"))
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----- workers, threads, partitions, validation ---------------------------------------------------


@needs_data
def test_batches_do_not_depend_on_workers_threads_or_prefetch(gsm8k_file):
    reference = take(chats(gsm8k_file).load(batch=4).stream(Partition()), 10)
    data = chats(gsm8k_file, workers=2, threads=2, read_buffer=1).load(batch=4)
    assert_same(take(data.stream(Partition()), 10), reference)
    assert_same(take(data.stream(Partition(), 6), 4), reference[6:])  # seeking computes lengths on workers


@needs_data
def test_each_process_reads_its_own_share(gsm8k_file):
    data = chats(gsm8k_file, seed=None).load(batch=4)
    shares = [take(data.train(Partition(i, 2)), 1)[0] for i in range(2)]
    assert all(s["text"].shape == (2, 128) for s in shares)
    whole = ChatMessages(path=gsm8k_file, tokenizer=MINIMIND, seq_len=127, loading=Loading(seed=None))
    first = whole.tokenize(json.loads(open(gsm8k_file[0]).readline())["messages"])[0][:128]
    second = whole.tokenize(json.loads(open(gsm8k_file[0]).readlines()[1])["messages"])[0][:128]
    assert shares[0]["text"][0, :first.size].tolist() == first.tolist()  # record 0 goes to process 0
    assert shares[1]["text"][0, :second.size].tolist() == second.tolist()  # record 1 to process 1
    with pytest.raises(ValueError, match="batch=4 rows do not divide across 3 processes"):
        next(data.train(Partition(0, 3)))


@needs_data
def test_validation_is_one_ordered_pass_with_a_padded_last_batch(gsm8k_file):
    data = ChatMessages(path=gsm8k_file[0], val_path=gsm8k_file[1], tokenizer=MINIMIND, seq_len=127,
                        loading=Loading(seed=3)).load(batch=4)
    batches = list(data.val(Partition()))
    assert sum(int(b["text_segment_ids"].max(axis=1).sum()) for b in batches) == 30
    assert all(b["text"].shape == (4, 128) for b in batches)
    assert_same(list(data.val(Partition())), batches)  # the same every evaluation
    halves = [list(data.val(Partition(i, 2))) for i in range(2)]
    assert len(halves[0]) == len(halves[1]) == len(batches)  # processes evaluate in step
    for whole, first, second in zip(batches, *halves, strict=True):
        np.testing.assert_array_equal(np.concatenate([first["text"], second["text"]]), whole["text"])


def test_errors_in_the_producer_reach_the_consumer():
    def broken(partition):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Dataset(train=broken, batch=1).stream(Partition())
    data = PreferencePairs(records=pair_records(4), seq_len=2).load(batch=2)
    stream = data.stream(Partition())
    next(stream)
    stream.close()  # stops the producer; reading again restarts it where the stream is
    assert_same(take(stream, 1), take(data.stream(Partition(), 1), 1))
