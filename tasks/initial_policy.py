"""The policy a pipeline's first stage starts from: the checkpoint the run names, or a fresh small
decoder made (once per model parameters, data and seed) and saved as a Hugging Face checkpoint."""

from __future__ import annotations

import os

import jax
from prefect import get_run_logger, task

from dew_lib import models
from dew_lib.data.tokenizer import load_tokenizer
from dew_lib.models import Pretrained
from tasks.manifests import DataManifest, PolicyRef, fingerprint, keyed
from tasks.params import ModelParams
from tasks.policy import checkpoint_fingerprint, save_policy
from tasks.refusals import retry_unless_refused
from tasks.storage import read_json


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
