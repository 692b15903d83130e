"""Preparing a run's data: the embedded arithmetic task, code tasks, or files a user already has.

The arithmetic task writes everything each stage reads: SFT conversations, DPO pairs (a right
answer against a near miss, as token ids with completion masks), GRPO prompts with ground
truths, held-out evaluation prompts and the byte-level BPE tokenizer they are tokenized with.

Code tasks (source "code") read an MBPP or HumanEval file as published and write GRPO prompts
and held-out evaluation prompts whose ground truth is what CodeReward runs (MBPP's asserts,
HumanEval's `check`), SFT conversations answering the training prompts with the reference
solutions, and a byte-level BPE tokenizer unless DataParams.tokenizer names one. There are no
DPO pairs.
"""

from __future__ import annotations

import gzip
import json
import os
import random

from prefect import get_run_logger, task

from dew_lib.data.arithmetic import Problem, near_misses, problems, solution
from dew_lib.data.byte_bpe import train_byte_bpe
from tasks.manifests import DataManifest, fingerprint
from tasks.params import DataParams
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


CODE_VERSION = 1  # bump when the code task's files would come out differently
MBPP_TEST, MBPP_TRAIN = range(11, 511), range(601, 975)  # MBPP's published splits, by task_id
MBPP_ASK = "Write Python code for this task. Your code should pass these tests:"
HUMANEVAL_ASK = "Complete this Python function. Reply with the whole function."
FORMAT = "Answer with your code in a ```python block."


def read_code_rows(path: str) -> list[dict]:
    """The rows of an MBPP or HumanEval file (JSON lines, gzip-compressed when it ends in .gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        try:
            return [json.loads(line) for line in handle if line.strip()]
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON lines ({error}); DataParams.code_path takes MBPP's "
                             "mbpp.jsonl or HumanEval's HumanEval.jsonl(.gz)") from None


def code_layout(rows: list[dict], layout: str, path: str) -> str:
    """'mbpp' or 'humaneval': the layout given, checked against the rows, or the one they fit."""
    needs = {"mbpp": ("task_id", "text", "code", "test_list"),
             "humaneval": ("task_id", "prompt", "canonical_solution", "test", "entry_point")}
    fits = [name for name, columns in needs.items() if rows and all(c in rows[0] for c in columns)]
    if layout == "auto" and fits:
        return fits[0]
    if layout in fits:
        return layout
    found = sorted(rows[0]) if rows else "no rows"
    wanted = needs.get(layout) or " or ".join(f"{k}: {v}" for k, v in needs.items())
    raise ValueError(f"{path} does not have the columns of code_layout={layout!r} ({wanted}); its first "
                     f"row has {found}")


def code_prompt(row: dict, layout: str) -> dict:
    """A prompt record (chat messages, ground truth for CodeReward, data_source) of one problem."""
    if layout == "mbpp":
        tests = "\n".join(row["test_list"])
        text = f"{row['text']}\n{MBPP_ASK}\n{tests}\n{FORMAT}"
        truth = {"test_list": row["test_list"], "test_setup_code": row.get("test_setup_code") or ""}
        task = f"mbpp/{row['task_id']}"
    else:
        text = f"{HUMANEVAL_ASK}\n```python\n{row['prompt']}```\n{FORMAT}"
        truth = {"test": row["test"], "entry_point": row["entry_point"]}
        task = str(row["task_id"])
    return {"prompt": [{"role": "user", "content": text}], "ground_truth": json.dumps(truth),
            "data_source": layout, "extra_info": json.dumps({"task_id": task}), "task_id": task}


def code_answer(row: dict, layout: str) -> str:
    """The dataset's reference solution, written as the answer the prompt asks for."""
    if layout == "mbpp":
        code = row["code"].replace("\r\n", "\n").rstrip()
    else:
        code = (row["prompt"] + row["canonical_solution"]).rstrip()
    return f"```python\n{code}\n```"


def code_splits(rows: list[dict], layout: str, params: DataParams) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): MBPP's published splits; HumanEval's first rows held out."""
    if layout == "mbpp":
        ordered = sorted(rows, key=lambda r: int(r["task_id"]))
        held = [r for r in ordered if int(r["task_id"]) in MBPP_TEST][: params.code_test_problems]
        train = [r for r in ordered if int(r["task_id"]) in MBPP_TRAIN]
    else:
        held, train = rows[: params.code_test_problems], rows[params.code_test_problems:]
    if not held:
        raise ValueError(f"{params.code_path} has no rows to hold out for evaluation (MBPP's test split "
                         "is task_id 11-510); give the published file or another code_layout")
    return train[: params.code_train_problems], held


def prepare_code(params: DataParams, directory: str, seed: int) -> DataManifest:
    """Write code-task prompts, evaluation rows, SFT conversations and (unless given) a tokenizer."""
    path = os.path.abspath(params.code_path)
    key = fingerprint("code", CODE_VERSION, params, seed, (path, os.path.getsize(path),
                                                           os.path.getmtime(path)))
    manifest_path = os.path.join(directory, "manifest.json")
    existing = read_json(manifest_path)
    if existing is not None and existing.get("fingerprint") == key:
        return DataManifest(**existing)
    rows = read_code_rows(path)
    layout = code_layout(rows, params.code_layout, path)
    train, held = code_splits(rows, layout, params)
    prompts = [code_prompt(r, layout) for r in train]
    chats = [{"messages": p["prompt"] + [{"role": "assistant", "content": code_answer(r, layout)}]}
             for p, r in zip(prompts, train, strict=True)]
    held_out = [code_prompt(r, layout) for r in held]
    tokenizer_dir = params.tokenizer
    if tokenizer_dir is None:
        tokenizer_dir = os.path.join(directory, "tokenizer")
        corpus = [m["content"] for chat in chats for m in chat["messages"]]
        corpus += [p["prompt"][0]["content"] for p in held_out]
        train_byte_bpe(corpus, vocab_size=params.vocab_size, directory=tokenizer_dir)
    paths = {name: os.path.join(directory, f"{name}.jsonl") for name in ("chat", "prompts", "eval")}
    write_lines(paths["eval"], held_out)
    if train:
        write_lines(paths["chat"], chats)
        write_lines(paths["prompts"], prompts)
    manifest = DataManifest(directory=directory, tokenizer=tokenizer_dir,
                            chat_path=paths["chat"] if train else None, chat_val_path=None,
                            pairs_path=None, prompts_path=paths["prompts"] if train else None,
                            eval_path=paths["eval"], fingerprint=key)
    write_json(manifest_path, manifest.model_dump())  # last: its presence means the set is whole
    return manifest


@task(retries=1, retry_delay_seconds=1, task_run_name="prepare-{params.source}")
def prepare_data(params: DataParams, directory: str, seed: int) -> DataManifest:
    """Generate or check the run's data and return where each part lives."""
    logger = get_run_logger()
    if params.source == "files":
        manifest = user_files(params)
    elif params.source == "code":
        manifest = prepare_code(params, directory, seed)
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
