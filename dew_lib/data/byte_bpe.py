"""A small byte-level BPE tokenizer that Dew trains itself, saved with a chat template.

The demo and the tests need a tokenizer that ships with nothing from outside. This trains one
with the `tokenizers` library on text you hand it (digits are split one per token, so arithmetic
stays learnable) and wraps it as a transformers `PreTrainedTokenizerFast` with ChatML special
tokens and a ChatML chat template, so `apply_chat_template` works on it like on any Hub model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END)

# ChatML: each message is <|im_start|>role\ncontent<|im_end|>\n; the generation prompt opens an
# assistant turn. The `generation` markers let transformers report assistant token spans.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_byte_bpe(texts: Iterable[str], *, vocab_size: int = 512, directory: str | None = None,
                   chat_template: str = CHATML_TEMPLATE):
    """Train a byte-level BPE on `texts` and return it as a transformers tokenizer.

    Special tokens take ids 0-3 (pad, end of text, im_start, im_end). When `directory` is given
    the tokenizer is also saved there in the Hugging Face layout.
    """
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} to hold every "
                         f"byte and the special tokens, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, eos_token=IM_END, bos_token=None,
        unk_token=None, additional_special_tokens=[IM_START, EOS],
    )
    wrapped.chat_template = chat_template
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
        wrapped.save_pretrained(directory)
    return wrapped
