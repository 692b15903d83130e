"""The tokenizer Dew trains for itself: offline, reloadable, with a working chat template."""

import pytest

from dew_lib.data.arithmetic import graded, problems, solution
from dew_lib.data.byte_bpe import IM_END, IM_START, train_byte_bpe


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    texts = [f"{IM_START}user\n{p.question}{IM_END}\n{IM_START}assistant\n{solution(p)}{IM_END}"
             for p in problems(500, seed=0)]
    return train_byte_bpe(texts, vocab_size=300, directory=str(directory)), directory


def test_special_tokens_have_fixed_ids_and_digits_stay_single(trained):
    tokenizer, _ = trained
    assert tokenizer.convert_tokens_to_ids(["<|pad|>", "<|endoftext|>", IM_START, IM_END]) == [0, 1, 2, 3]
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 3
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("1234 + 56", add_special_tokens=False))
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["1", "2", "3", "4", "5", "6"]


def test_reloads_offline_with_the_same_ids_and_template(trained):
    from transformers import AutoTokenizer

    tokenizer, directory = trained
    again = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    text = "What is 17 + 25? 17 + 25 = 42"
    assert again.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]
    assert again.apply_chat_template(messages, tokenize=False) == (
        f"{IM_START}user\nWhat is 1 + 2?{IM_END}\n{IM_START}assistant\n3{IM_END}\n")


def test_chat_template_marks_exactly_the_assistant_answer(trained):
    tokenizer, _ = trained
    messages = [{"role": "user", "content": "What is 1 + 2?"},
                {"role": "assistant", "content": "1 + 2 = 3"}]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(marked) == f"1 + 2 = 3{IM_END}"
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(f"{IM_START}assistant\n")


def test_vocabulary_too_small_for_bytes_is_refused():
    with pytest.raises(ValueError, match="vocab_size must be at least 260"):
        train_byte_bpe(["abc"], vocab_size=100)


def test_grading_reads_the_last_integer():
    assert graded("12 + 30 = 42", 42)
    assert not graded("12 + 30 = 41", 42)
    assert graded("50 - 60 = -10", -10)
    assert not graded("no number", 0)
