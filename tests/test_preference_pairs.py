"""PreferencePairs: the spec's rules, its offline DPO example's data, hh-rlhf pairs, refused rows."""

from __future__ import annotations

import gzip
import itertools
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SHARED_DATA

from dew_lib.data import DataError, Loading, Partition, PreferencePairs
from dew_lib.data.tokenizer import load_tokenizer

HH_RLHF = os.path.join(SHARED_DATA, "preference", "hh-rlhf", "harmless-base-test.jsonl.gz")
MINIMIND = os.path.join(SHARED_DATA, "tokenizers", "minimind")


def test_the_offline_dpo_examples_pairs():
    rows = [
        {"chosen": [1, 2, 3, 5], "rejected": [1, 2, 4, 5], "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1]},
        {"chosen": [1, 6, 3, 5], "rejected": [1, 6, 4, 5], "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1]},
    ]
    row_width = 4
    spec = PreferencePairs(
        records=tuple(json.dumps(row) for row in rows * 4),
        seq_len=row_width,
        pad_id=0,
        loading=Loading(workers=0, threads=1, read_buffer=2),
    )
    data = spec.load(batch=8)
    assert data.batch == 8 and data.records == 8
    batch = next(data.stream(Partition()))
    assert batch["input_ids"].shape == batch["completion_mask"].shape == (8, 2, 4)
    assert batch["input_ids"].dtype == np.int32
    seen = sorted(map(tuple, batch["input_ids"].reshape(8, 8).tolist()))
    assert seen == sorted([(1, 2, 3, 5, 1, 2, 4, 5)] * 4 + [(1, 6, 3, 5, 1, 6, 4, 5)] * 4)
    np.testing.assert_array_equal(batch["completion_mask"], np.tile([0, 0, 1, 1], (8, 2, 1)))


def test_missing_masks_count_every_token_and_padding_is_right_with_zero_mask():
    records = (json.dumps({"chosen": [7, 8, 9], "rejected": [7, 8], "rejected_mask": [0, 1]}),)
    batch = next(PreferencePairs(records=records, seq_len=5, pad_id=99).load(batch=1).stream(Partition()))
    assert batch["input_ids"].tolist() == [[[7, 8, 9, 99, 99], [7, 8, 99, 99, 99]]]
    assert batch["completion_mask"].tolist() == [[[1, 1, 1, 0, 0], [0, 1, 0, 0, 0]]]


@pytest.mark.skipif(not os.path.isfile(HH_RLHF), reason="shared data not found")
def test_hh_rlhf_pairs_tokenized_at_known_boundaries(tmp_path):
    tokenizer = load_tokenizer(MINIMIND)
    marker = "\n\nAssistant:"
    with gzip.open(HH_RLHF, "rt", encoding="utf-8") as handle:
        raw = [json.loads(line) for line in itertools.islice(handle, 16)]
    rows = []
    for pair in raw:
        cut = pair["chosen"].rindex(marker) + len(marker)
        prompt = pair["chosen"][:cut]
        assert pair["rejected"].startswith(prompt)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        row = {}
        for side in ("chosen", "rejected"):
            # The prompt and the answer are tokenized apart, so the mask follows token boundaries.
            answer = tokenizer.encode(pair[side][cut:], add_special_tokens=False) + [tokenizer.eos_token_id]
            row[side] = prompt_ids + answer
            row[f"{side}_mask"] = [0] * len(prompt_ids) + [1] * len(answer)
        rows.append(row)
    width = max(len(r[s]) for r in rows for s in ("chosen", "rejected"))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    pairs = PreferencePairs(path=str(tmp_path / "pairs.parquet"), seq_len=width, loading=Loading(seed=None))
    data = pairs.load(batch=4)
    batch = next(data.stream(Partition()))
    for i, row in enumerate(rows[:4]):
        for side, name in enumerate(("chosen", "rejected")):
            n = len(row[name])
            assert batch["input_ids"][i, side, :n].tolist() == row[name]
            assert batch["completion_mask"][i, side, :n].tolist() == row[f"{name}_mask"]
            assert not batch["completion_mask"][i, side, n:].any()
    with pytest.raises(DataError, match=rf"pair \d+ \(.*pairs\.parquet row \d+\): field '\w+' has \d+ ids, "
                                        rf"more than seq_len={width - 1}"):
        PreferencePairs(path=str(tmp_path / "pairs.parquet"), seq_len=width - 1).load(batch=4)


def bad(record, **options):
    with pytest.raises((DataError, ValueError)) as error:
        PreferencePairs(records=(json.dumps(record),), seq_len=options.pop("seq_len", 4), **options).load(batch=1)
    return str(error.value)


def test_refused_records_name_the_row_and_field():
    assert "field 'chosen' has 5 ids, more than seq_len=4" in bad({"chosen": [1, 2, 3, 4, 5], "rejected": [1]})
    assert "field 'rejected' item 1 is -3" in bad({"chosen": [1], "rejected": [1, -3]})
    assert "field 'chosen' item 0 is 1.5 (float); token ids must be integers" in bad({"chosen": [1.5], "rejected": [1]})
    assert "item 0 is True (bool)" in bad({"chosen": [True], "rejected": [1]})
    assert "missing column 'rejected'" in bad({"chosen": [1]})
    short_mask = {"chosen": [1, 2], "rejected": [1], "chosen_mask": [1]}
    assert "'chosen_mask' has 1 entries but its ids have 2" in bad(short_mask)
    assert "'rejected_mask' item 0 is 2" in bad({"chosen": [1], "rejected": [1], "rejected_mask": [2]})
    assert "field 'chosen' is empty" in bad({"chosen": [], "rejected": [1]})
    assert bad({"chosen": [1], "rejected": [1]}, seq_len=1).startswith("PreferencePairs.seq_len must be")
    with pytest.raises(DataError, match=r"PreferencePairs.records\[1\]: not valid JSON"):
        PreferencePairs(records=(json.dumps({"chosen": [1], "rejected": [2]}), "{oops"), seq_len=2).load(batch=1)


def test_exactly_one_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one source.*not both"):
        PreferencePairs(records=("{}",), path="x.parquet", seq_len=4)
    with pytest.raises(ValueError, match="exactly one source.*not neither"):
        PreferencePairs(seq_len=4)
    pq.write_table(pa.table({"chosen": [[1, 2]]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: missing column 'rejected'"):
        PreferencePairs(path=str(tmp_path / "p.parquet"), seq_len=4).load(batch=1)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="holds no records"):
        PreferencePairs(path=str(tmp_path / "empty.jsonl"), seq_len=4).load(batch=1)
