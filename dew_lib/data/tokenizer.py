"""Tokenizers and chat templates, loaded offline and once per process.

`load_tokenizer` goes through `AutoTokenizer` with `local_files_only=True`: a Hub name works only
when the tokenizer is already in the local Hugging Face cache. Dew never downloads at load time,
so a training job cannot stall or change under it because of the network. `TokenizerSpec` is the
picklable description a loader hands to its worker processes, and `shipment` sends them the
training process's own tokenizer, so every process encodes with the very same object state.

`Renderer` renders conversations with the tokenizer's chat template (or one given in its place)
through `apply_chat_template(tokenize=False)` and encodes the text exactly as
`apply_chat_template(tokenize=True)` does, so ids match what transformers and TRL compute.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dew_lib.data.errors import DataError
from dew_lib.options import integer

_TOKENIZERS: dict[str, Any] = {}
_LOCK = threading.Lock()
# transformers sets truncation and padding on the Rust tokenizer before each call, which fails
# ("Already borrowed") when two threads encode at once, e.g. a training and a validation stream.
_ENCODE = threading.Lock()


def load_tokenizer(name: str | os.PathLike) -> Any:
    """A Hugging Face tokenizer from a local directory or the local Hub cache; cached per process."""
    key = os.fspath(name)
    with _LOCK:
        if key in _TOKENIZERS:
            return _TOKENIZERS[key]
    path = Path(key).expanduser()
    looks_local = path.exists() or key.startswith((".", "/", "~")) or key.count("/") > 1
    if looks_local and not path.is_dir():
        raise DataError(f"tokenizer {key!r}: no such directory; give a directory with tokenizer files")
    import transformers  # slow to import; only processes that tokenize need it

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path) if path.is_dir() else key, local_files_only=True
        )
    except (OSError, ValueError) as error:
        raise DataError(
            f"tokenizer {key!r} could not be loaded offline ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}); give a local directory with tokenizer files, or fetch the "
            "tokenizer into the Hugging Face cache first (Dew does not download at load time)"
        ) from None
    with _LOCK:
        return _TOKENIZERS.setdefault(key, tokenizer)


def vocab_size_for(tokenizer: Any, multiple: int = 128) -> int:
    """The smallest model `vocab_size` that holds every id `tokenizer` produces, rounded up.

    `tokenizer` is a loaded Hugging Face tokenizer or a directory (loaded with `load_tokenizer`).
    The count is `len(tokenizer)`, which includes added special tokens such as `<|im_end|>`, or
    one past the largest id in the vocabulary when that is larger; `tokenizer.vocab_size` leaves
    the added tokens out (151,643 for Qwen3, whose ids reach 151,668). `multiple` rounds the size
    up (128: 151,680 for Qwen3), which keeps the embedding and output matmuls on aligned shapes;
    pass 1 for the exact count.
    """
    multiple = integer("vocab_size_for(multiple=...)", multiple)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    if not hasattr(tokenizer, "get_vocab"):
        raise TypeError(f"vocab_size_for needs a Hugging Face tokenizer or its directory, got "
                        f"{type(tokenizer).__name__}")
    count = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    return -(-count // multiple) * multiple


_ADDED: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, starters, spans); holds the tokenizer


def _added_tokens(tokenizer: Any) -> tuple[tuple[str, ...], list[tuple[int, Any]]]:
    """(added tokens that can start an exact split, [(length, regex of the added tokens of that
    length)]) for one tokenizer, cached."""
    key = id(tokenizer)
    if key not in _ADDED:
        added = list(tokenizer.added_tokens_decoder.values())
        starters = tuple(a.content for a in added if a.content and not (a.lstrip or a.single_word or a.normalized))
        by_length: dict[int, list[str]] = {}
        for a in added:
            if len(a.content) > 1:
                by_length.setdefault(len(a.content), []).append(re.escape(a.content))
        spans = [(length, re.compile("|".join(contents))) for length, contents in sorted(by_length.items())]
        _ADDED[key] = (tokenizer, starters, spans)  # keeping the tokenizer keeps its id unique
    return _ADDED[key][1:]


def install_tokenizer(argument: tuple[str, bytes]) -> None:
    """Worker side of `shipment`: put a pickled tokenizer in this process's cache under its name."""
    name, blob = argument
    with _LOCK:
        _TOKENIZERS[name] = pickle.loads(blob)


def shipment(name: str | os.PathLike) -> tuple[Any, tuple[str, bytes]]:
    """`(install_tokenizer, argument)` that gives a worker this process's tokenizer.

    Unpickling a tokenizer is faster than building it from its files, and unlike AutoTokenizer it
    does not import PyTorch where PyTorch is installed: it halves a worker's start-up.
    """
    key = os.fspath(name)
    return install_tokenizer, (key, pickle.dumps(load_tokenizer(key), protocol=pickle.HIGHEST_PROTOCOL))


def resolve_template(chat_template: str | os.PathLike | None) -> str | None:
    """Template text from text itself or from a `.jinja` file path; None keeps the tokenizer's."""
    if chat_template is None:
        return None
    if isinstance(chat_template, os.PathLike) or (
        isinstance(chat_template, str) and "{{" not in chat_template and "{%" not in chat_template
    ):
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise DataError(
                f"chat_template={os.fspath(chat_template)!r} is neither Jinja template text nor a file; "
                "pass the template's text or the path of a .jinja file"
            )
        return path.read_text(encoding="utf-8")
    if not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a string or path, got {type(chat_template).__name__}")
    return chat_template


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """What a worker process needs to rebuild a Renderer: tokenizer name, template, template kwargs."""

    name: str
    chat_template: str | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    def renderer(self) -> Renderer:
        return Renderer(load_tokenizer(self.name), self.chat_template, dict(self.template_kwargs))


class Renderer:
    """Renders conversations with one chat template and encodes text like apply_chat_template."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.template = chat_template if chat_template is not None else tokenizer.chat_template
        self.kwargs = dict(template_kwargs or {})
        name = getattr(tokenizer, "name_or_path", "the tokenizer")
        if not self.template:
            raise DataError(
                f"{name} has no chat template, so message boundaries and roles cannot be rendered; "
                "pass chat_template= with the model's template"
            )
        if isinstance(self.template, dict):
            raise DataError(f"{name} has several named chat templates; pass chat_template= to pick one")

    def render(self, messages: Sequence[Mapping], tools: Sequence | None = None,
               generation: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, chat_template=self.template, add_generation_prompt=generation,
            tokenize=False, **self.kwargs,
        )

    def render_many(self, conversations: Sequence[Sequence[Mapping]], generation: bool = False) -> list[str]:
        """`render` for several conversations without tools, in one apply_chat_template call."""
        if not conversations:
            return []
        return self.tokenizer.apply_chat_template(
            [list(c) for c in conversations], chat_template=self.template, add_generation_prompt=generation,
            tokenize=False, **self.kwargs,
        )

    def splits_at(self, text: str, at: int) -> bool:
        """Whether encoding `text` equals encoding `text[:at]` and `text[at:]` apart and joining.

        Tokenizers cut their input at added tokens (`<|im_start|>` ...) before normalizing,
        pre-tokenizing or merging, and encode the pieces between them independently. So the split is
        exact when an added token starts at `at` that takes nothing from its left (no lstrip, no
        word-boundary rule, matched on raw text) and no added token spans `at`.
        """
        starters, spans = _added_tokens(self.tokenizer)
        if not text.startswith(starters, at):
            return False
        for length, pattern in spans:
            if pattern.search(text, max(0, at - length + 1), at + length - 1):
                return False  # any match in that window covers both sides of `at`
        return True

    def encode_extending(self, texts: Sequence[str], bases: Sequence[int | None]) -> list[list[int]]:
        """Ids of each text, as `encode`; a text that extends an earlier one (`bases[i] = j < i`)
        at an exact split is encoded as the earlier text's ids plus the ids of its new part."""
        pieces: list[str] = []
        plan: list[tuple[int | None, int]] = []
        for text, base in zip(texts, bases, strict=True):
            if base is not None:
                head = texts[base]
                if text.startswith(head) and self.splits_at(text, len(head)):
                    plan.append((base, len(pieces)))
                    pieces.append(text[len(head):])
                    continue
            plan.append((None, len(pieces)))
            pieces.append(text)
        encoded = self.encode(pieces)
        out: list[list[int]] = []
        for base, piece in plan:
            out.append(encoded[piece] if base is None else out[base] + encoded[piece])
        return out

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text with no special tokens added, as apply_chat_template(tokenize=True)."""
        with _ENCODE:
            return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def encode_plain(self, text: str) -> list[int]:
        """Ids of a plain prompt string, with the tokenizer's own special tokens (e.g. BOS)."""
        with _ENCODE:
            return self.tokenizer(text)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


__all__ = ["Renderer", "TokenizerSpec", "install_tokenizer", "load_tokenizer", "resolve_template", "shipment",
           "vocab_size_for"]
