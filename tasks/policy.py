"""Policies move between stages as Hugging Face checkpoint directories (`Pretrained.save`), so
each stage's output is also what transformers, vLLM and SGLang load. Saving and loading them
needs no Prefect (a stage job's processes do both); the task that makes the first policy is
tasks/initial_policy.py."""

from __future__ import annotations

import glob
import os

from dew_lib.data.tokenizer import load_tokenizer
from dew_lib.models import Pretrained, load_pretrained
from tasks.manifests import PolicyRef, fingerprint
from tasks.refusals import RunRefused
from tasks.storage import read_json, write_json


def checkpoint_fingerprint(directory: str) -> str:
    """Identify a checkpoint by its config and its weight files' sizes and times."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    return fingerprint(read_json(os.path.join(directory, "config.json")),
                       [(os.path.basename(f), os.path.getsize(f), os.path.getmtime(f)) for f in files])


def save_policy(pretrained: Pretrained, variables, directory: str, key: str, *, write: bool = True) -> PolicyRef:
    """Save float32 weights with config and tokenizer; the fingerprint names what made them.

    Variables split over a mesh are gathered a tensor at a time as they are written; split
    across processes, every process calls this together and all but one pass `write=False`
    (they take part in the gathers and write nothing)."""
    pretrained.save(variables, directory, dtype=None, write=write)
    if write:
        write_json(os.path.join(directory, "dew_policy.json"), {"fingerprint": key})
    return PolicyRef(path=directory, fingerprint=key)


def load_policy(policy: PolicyRef, tokenizer_dir: str | None = None):
    """`(pretrained, variables)` of a saved policy; a separate tokenizer may replace its own."""
    pretrained, variables = load_pretrained(policy.path)
    if tokenizer_dir is not None and pretrained.tokenizer is None:
        pretrained = Pretrained(pretrained.model, pretrained.config, load_tokenizer(tokenizer_dir),
                                pretrained.generation_config)
    if pretrained.tokenizer is None:
        raise RunRefused(f"the policy at {policy.path} has no tokenizer and the data names none; "
                         "save one beside the checkpoint or set DataParams.tokenizer")
    return pretrained, variables
