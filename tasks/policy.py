"""Policies move between stages as Hugging Face checkpoint directories (`Pretrained.save`), so
each stage's output is also what transformers, vLLM and SGLang load."""

from __future__ import annotations

import glob
import os

import jax
from prefect import get_run_logger, task

from dew_lib import models
from dew_lib.data.tokenizer import load_tokenizer
from dew_lib.models import Pretrained, load_pretrained
from tasks.manifests import DataManifest, PolicyRef, fingerprint, keyed
from tasks.params import ModelParams
from tasks.refusals import RunRefused, retry_unless_refused
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


def experts_of(params: ModelParams) -> dict:
    """The decoder options of a mixture-of-experts MLP, or none for a dense one."""
    if not params.experts:
        return {}
    return dict(experts=params.experts, experts_per_token=params.experts_per_token,
                expert_features=params.expert_features)


@task(retries=1, retry_delay_seconds=1, retry_condition_fn=retry_unless_refused)
def initial_policy(params: ModelParams, data: DataManifest, directory: str, seed: int) -> PolicyRef:
    """The policy the first stage starts from: the given checkpoint, or a fresh small decoder."""
    logger = get_run_logger()
    if params.pretrained is not None:
        logger.info("starting from the checkpoint %s", params.pretrained)
        return PolicyRef(path=params.pretrained, fingerprint=checkpoint_fingerprint(params.pretrained))
    key = fingerprint("init", keyed(params), data.fingerprint, seed)
    existing = read_json(os.path.join(directory, "dew_policy.json"))
    if existing is not None and existing.get("fingerprint") == key:
        return PolicyRef(path=directory, fingerprint=key)
    tokenizer = load_tokenizer(data.tokenizer)
    model = models.build("causal_transformer", vocab_size=len(tokenizer),
                         emb_features=params.emb_features, num_layers=params.num_layers,
                         num_heads=params.num_heads, mlp_features=params.mlp_features,
                         max_seq_len=params.max_seq_len, **experts_of(params))
    variables = jax.jit(model.init)(jax.random.key(seed), jax.numpy.zeros((1, 8), "int32"))
    count = sum(x.size for x in jax.tree.leaves(variables))
    logger.info("a fresh decoder with %.2fM parameters, vocabulary %d", count / 1e6, len(tokenizer))
    return save_policy(Pretrained.from_model(model, tokenizer=tokenizer), variables, directory, key)
