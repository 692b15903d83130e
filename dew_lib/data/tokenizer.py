"""Tokenizers and chat templates, loaded offline and once per process.

`TokenizerSpec` is the picklable description a loader hands to its worker processes; each process
loads the tokenizer itself (through `AutoTokenizer` with `local_files_only=True`) and caches it.
A Hub name works only when the tokenizer is already in the local Hugging Face cache: Dew never
downloads at load time, so a training job cannot stall or change under it because of the network.

`Renderer` renders conversations with the tokenizer's chat template (or one given in its place)
through `apply_chat_template(tokenize=False)` and encodes the text exactly as
`apply_chat_template(tokenize=True)` does, so ids match what transformers and TRL compute.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dew_lib.data.readers import DataError

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


__all__ = ["Renderer", "TokenizerSpec", "load_tokenizer", "resolve_template"]
