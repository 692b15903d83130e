"""The small, serializable values tasks hand each other: where things are and what they scored."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from dew_lib.recipes.options import Options


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataManifest(Manifest):
    """Where a prepared dataset lives. `fingerprint` changes whenever its content would."""

    directory: str
    tokenizer: str | None
    chat_path: str | None
    chat_val_path: str | None
    pairs_path: str | None
    prompts_path: str | None
    eval_path: str
    fingerprint: str
    tool: str | None = None  # the tool its prompts are episodes with ("calculator"), or None


class PolicyRef(Manifest):
    """A policy saved as a Hugging Face checkpoint directory, and what produced it."""

    path: str
    fingerprint: str


class StageResult(Manifest):
    """A finished training stage: its final policy, metrics and whether this run trained it."""

    stage: str
    kind: str
    policy: PolicyRef
    metrics: dict[str, float]
    directory: str
    steps: int | None = None  # optimizer steps trained (DPO may cut its own); None: a result.json from before
    cached: bool = False


class EvalResult(Manifest):
    stage: str
    accuracy: float  # greedy answers
    answered: int
    sampled_accuracy: float | None = None  # mean over EvalParams.samples draws per prompt
    cached: bool = False


class ImageManifest(Manifest):
    """Training images as one .npz (`images`: uint8 [N, H, W, C]) and what they are."""

    path: str
    shape: tuple[int, int, int]
    count: int
    fingerprint: str


class DiTRef(Manifest):
    """A SimpleDiT saved by `tasks.images.save_dit` (config.json + model.safetensors)."""

    path: str
    fingerprint: str


class ImageStageResult(Manifest):
    """A finished image stage: its saved model, metrics, preview PNGs and whether this run trained it."""

    stage: str
    kind: str
    model: DiTRef
    metrics: dict[str, float]
    directory: str
    previews: list[str]
    cached: bool = False


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (pydantic models are dumped first, options with
    renamed fields under their earlier names, so a rename changes no key)."""
    def plain(value):
        if isinstance(value, Options):
            return value.key_fields()
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else value

    text = json.dumps([plain(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def keyed(params: BaseModel) -> dict:
    """A stage's parameters as its fingerprint reads them: every field but those added since
    stages were first keyed (the options' `LATER`) while they keep their defaults, `processes`
    only above 1 (each process reads its own share, so the data order changes), never `mesh`,
    `tensor_parallel_size` or `device_memory` (where the state or the rollout server lives, not
    what it computes: a stage resumes under another mesh), and
    renamed fields under their earlier names (`Options.key_fields`); so a stage's key is what
    it was before those fields existed or were renamed."""
    fields = type(params).model_fields
    later = getattr(type(params), "LATER", frozenset()) | {"processes"}
    unset = {name for name in later if name in fields
             and getattr(params, name) == fields[name].get_default(call_default_factory=True)}
    unset |= {"mesh", "tensor_parallel_size", "device_memory"} & fields.keys()
    if isinstance(params, Options):
        return params.key_fields(exclude=unset)
    return params.model_dump(mode="json", exclude=unset)
