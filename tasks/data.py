"""Preparing a run's data: the embedded arithmetic task, or files a user already has.

The arithmetic task writes everything each stage reads: SFT conversations, DPO pairs (a right
answer against a near miss, as token ids with completion masks), GRPO prompts with ground
truths, held-out evaluation prompts and the byte-level BPE tokenizer they are tokenized with.
"""

from __future__ import annotations

import json
import os
import random

from prefect import get_run_logger, task

from dew_lib.data.arithmetic import Problem, near_misses, problems, solution
from dew_lib.data.byte_bpe import train_byte_bpe
from flows.params import DataParams
from tasks.manifests import DataManifest, fingerprint
from tasks.storage import read_json, write_json, write_lines

GENERATOR_VERSION = 2  # bump when the files below would come out differently


def _prompt_record(problem: Problem) -> dict:
    return {"prompt": problem.messages(False), "ground_truth": str(problem.answer),
            "data_source": "arithmetic", "extra_info": json.dumps({"solution": solution(problem)})}


def _pair(tokenizer, problem: Problem, wrong: int) -> dict:
    """Chosen and rejected renders as token ids; the mask marks what follows the prompt."""
    prompt = tokenizer.apply_chat_template(problem.messages(False), add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    sides = {}
    for side, answer in (("chosen", problem.answer), ("rejected", wrong)):
        reply = tokenizer.encode(solution(problem, answer), add_special_tokens=False)
        ids = list(prompt) + reply + [tokenizer.eos_token_id]
        sides[side] = ids
        sides[f"{side}_mask"] = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    return sides


def generate_arithmetic(params: DataParams, directory: str, seed: int) -> DataManifest:
    """Write the arithmetic task's files under `directory` (or reuse an identical earlier set)."""
    key = fingerprint("arithmetic", GENERATOR_VERSION, params, seed)
    manifest_path = os.path.join(directory, "manifest.json")
    existing = read_json(manifest_path)
    if existing is not None and existing.get("fingerprint") == key:
        return DataManifest(**existing)
    train = problems(params.train_problems, seed=seed)
    seen = {p.question for p in train}
    held_out = [p for p in problems(4 * params.test_problems, seed=seed + 1)
                if p.question not in seen][: params.test_problems]
    rng = random.Random(seed)
    sft, rest = train[: len(train) // 2], train[len(train) // 2:]
    tokenizer_dir = os.path.join(directory, "tokenizer")
    corpus = (f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n{solution(p)}<|im_end|>"
              for p in train[:4000])
    tokenizer = train_byte_bpe(corpus, vocab_size=params.vocab_size, directory=tokenizer_dir)
    paths = {name: os.path.join(directory, f"{name}.jsonl")
             for name in ("chat", "chat_val", "pairs", "prompts", "eval")}
    write_lines(paths["chat"], ({"messages": p.messages()} for p in sft))
    write_lines(paths["chat_val"], ({"messages": p.messages()} for p in held_out[:50]))
    write_lines(paths["pairs"], (_pair(tokenizer, p, near_misses(p, rng)[0]) for p in rest))
    write_lines(paths["prompts"], (_prompt_record(p) for p in rest))
    write_lines(paths["eval"], (_prompt_record(p) for p in held_out))
    manifest = DataManifest(directory=directory, tokenizer=tokenizer_dir, chat_path=paths["chat"],
                            chat_val_path=paths["chat_val"], pairs_path=paths["pairs"],
                            prompts_path=paths["prompts"], eval_path=paths["eval"], fingerprint=key)
    write_json(manifest_path, manifest.model_dump())  # last: its presence means the set is whole
    return manifest


def user_files(params: DataParams) -> DataManifest:
    """A manifest over files the user gave; their size and modification time key reruns."""
    if params.eval_path is None:
        raise ValueError("DataParams(source='files') needs eval_path: every pipeline ends in an "
                         "evaluation on held-out prompts")
    paths = [params.chat_path, params.pairs_path, params.prompts_path, params.eval_path]
    stats = [None if p is None else (os.path.abspath(p), os.path.getsize(p), os.path.getmtime(p))
             for p in paths]
    return DataManifest(directory=os.path.dirname(os.path.abspath(params.eval_path)),
                        tokenizer=params.tokenizer, chat_path=params.chat_path, chat_val_path=None,
                        pairs_path=params.pairs_path, prompts_path=params.prompts_path,
                        eval_path=params.eval_path, fingerprint=fingerprint("files", stats))


@task(retries=1, retry_delay_seconds=1, task_run_name="prepare-{params.source}")
def prepare_data(params: DataParams, directory: str, seed: int) -> DataManifest:
    """Generate or check the run's data and return where each part lives."""
    logger = get_run_logger()
    if params.source == "files":
        manifest = user_files(params)
    else:
        manifest = generate_arithmetic(params, directory, seed)
    logger.info("data ready in %s (fingerprint %s)", manifest.directory, manifest.fingerprint)
    return manifest


def read_eval(path: str) -> list[dict]:
    """The held-out prompts: one JSON object per line with `prompt` and `ground_truth`."""
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    for index, row in enumerate(rows):
        if "prompt" not in row or "ground_truth" not in row:
            raise ValueError(f"{path} line {index + 1}: an evaluation row needs 'prompt' and "
                             "'ground_truth'")
    return rows
