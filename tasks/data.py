"""Preparing a run's data: the embedded arithmetic task, code tasks, or files a user already has.

The arithmetic task writes everything each stage reads: SFT conversations, DPO pairs (a right
answer against a near miss, as token ids with completion masks), GRPO prompts with ground
truths, held-out evaluation prompts and the byte-level BPE tokenizer they are tokenized with.

Code tasks (source "code") read an MBPP or HumanEval file as published and write GRPO prompts
and held-out evaluation prompts whose ground truth is what CodeReward runs (MBPP's asserts,
HumanEval's `check`), SFT conversations answering the training prompts with the reference
solutions, and a byte-level BPE tokenizer unless DataParams.tokenizer names one. There are no
DPO pairs.

Your own files (source "files") are read as they are, or, when DataParams.columns maps their fields
or DataParams.ground_truth_after extracts the reference answer (GSM8K: question/answer, the answer
after "####"), rewritten in the pipeline's layout under the run's data directory.

What the stages' lengths would cut of the prepared data is counted in tasks/lengths.py.
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
from tasks.refusals import RunRefused, retry_unless_refused
from tasks.storage import read_json, write_json, write_lines

GENERATOR_VERSION = 2  # bump when the files below would come out differently
FILES_ONLY = {"columns", "ground_truth_after", "max_truncated"}  # fields no generated file depends on


def _generator_params(params: DataParams, teacher: bool = True) -> dict:
    """What the arithmetic (`teacher`) or code files depend on. A new files-only field keeps their
    fingerprints, and so does `teacher_errors` where it is 0 or unused, as before it existed."""
    unused = {"teacher_errors"} if not teacher or params.teacher_errors == 0 else set()
    return params.model_dump(mode="json", exclude=FILES_ONLY | unused)


def _prompt_record(problem: Problem) -> dict:
    return {"prompt": problem.messages(False), "ground_truth": str(problem.answer),
            "data_source": "arithmetic", "extra_info": json.dumps({"solution": solution(problem)})}


def _taught(problem: Problem, rng: random.Random, errors: float) -> list[dict]:
    """The SFT conversation, its answer a near miss with probability `errors`."""
    if errors == 0 or rng.random() >= errors:
        return problem.messages()
    wrong = near_misses(problem, rng)[0]
    return problem.messages(False) + [{"role": "assistant", "content": solution(problem, wrong)}]


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
    key = fingerprint("arithmetic", GENERATOR_VERSION, _generator_params(params), seed)
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
    write_lines(paths["chat"], ({"messages": _taught(p, rng, params.teacher_errors)} for p in sft))
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
        raise RunRefused("DataParams(source='files') needs eval_path: every pipeline ends in an "
                         "evaluation on held-out prompts")
    paths = [params.chat_path, params.pairs_path, params.prompts_path, params.eval_path]
    stats = [None if p is None else (os.path.abspath(p), os.path.getsize(p), os.path.getmtime(p))
             for p in paths]
    return DataManifest(directory=os.path.dirname(os.path.abspath(params.eval_path)),
                        tokenizer=params.tokenizer, chat_path=params.chat_path, chat_val_path=None,
                        pairs_path=params.pairs_path, prompts_path=params.prompts_path,
                        eval_path=params.eval_path, fingerprint=fingerprint("files", stats))


MAPPED_VERSION = 1  # bump when mapped files would come out differently
PAIR_NAMES = ("prompt", "chosen", "rejected", "chosen_mask", "rejected_mask", "tools")
PATH_FIELDS = {"chat": "chat_path", "pairs": "pairs_path", "prompts": "prompts_path", "eval": "eval_path"}


class _Mapped:
    """Reads one of the user's files through DataParams.columns: `value(index, name)` is the row's
    value of the pipeline's `name`, and every refusal names the file, row, field and fix."""

    def __init__(self, params: DataParams, kind: str):
        from dew_lib.data.readers import read_rows

        self.params, self.kind = params, kind
        self.path = getattr(params, PATH_FIELDS[kind])
        self.rows = read_rows(self.path)
        self.records = self.rows.get(range(len(self.rows)))

    def field(self, name: str) -> str:
        return self.params.columns.get(name, name)

    def has(self, name: str) -> bool:
        return self.field(name) in self.rows.columns

    def describe(self, name: str) -> str:
        """Where `name` is read from: the field the mapping names, or the field of that name."""
        if name in self.params.columns:
            return f"field {self.field(name)!r} (DataParams.columns[{name!r}])"
        return f"field {name!r} (map another with DataParams.columns[{name!r}])"

    def origin(self, name: str) -> str:
        return f"the {self.describe(name)}"

    def need(self, *names: str) -> None:
        for name in names:
            if not self.has(name):
                raise RunRefused(f"{PATH_FIELDS[self.kind]} {self.path} has no {self.describe(name)}; "
                                 f"its fields are {list(self.rows.columns)}. Set DataParams.columns, "
                                 f"e.g. for GSM8K {_GSM8K}")

    def value(self, index: int, name: str, required: bool = True):
        value = self.records[index].get(self.field(name))
        if value is None and required:
            raise RunRefused(f"{self.rows.where(index)}: no value in {self.origin(name)}, which the "
                             f"{PATH_FIELDS[self.kind]} rows need")
        return value


_GSM8K = '{"prompt": "question", "completion": "answer", "ground_truth": "answer"}'


def jsonable(value):
    """A value read from Parquet or JSON as plain JSON-able Python (arrays as lists)."""
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _as_prompt(value):
    """A plain-string prompt becomes one user message, as ChatMessages reads it for SFT, so that GRPO
    and evaluation prompt the model through the chat template it was trained with."""
    value = jsonable(value)
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


def _ground_truth(source: _Mapped, index: int) -> str:
    value = source.value(index, "ground_truth")
    text = value if isinstance(value, str) else json.dumps(jsonable(value))
    marker = source.params.ground_truth_after
    if marker is None:
        return text
    if marker not in text:
        raise RunRefused(f"{source.rows.where(index)}: {source.origin('ground_truth')} has no "
                         f"{marker!r} (DataParams.ground_truth_after) to take the reference answer "
                         "after; give the marker your answers use, or leave ground_truth_after empty "
                         "to take the whole field")
    answer = text.rsplit(marker, 1)[1].strip()
    if not answer:
        raise RunRefused(f"{source.rows.where(index)}: nothing follows {marker!r} in "
                         f"{source.origin('ground_truth')}; the reference answer cannot be empty")
    return answer


def _prompt_rows(source: _Mapped) -> list[dict]:
    """GRPO or evaluation rows: prompt, ground_truth, data_source and extra_info; a GRPO row's
    `extra_info.solution` is its completion when it has one (DPO's pairs from the policy take it as
    the chosen side)."""
    source.need("prompt", "ground_truth")
    out = []
    for index in range(len(source.records)):
        extra = jsonable(source.value(index, "extra_info", required=False))
        if extra is None:
            extra = {}
        elif isinstance(extra, str):
            try:
                extra = json.loads(extra) if extra.strip() else {}
            except json.JSONDecodeError:
                pass
        completion = source.value(index, "completion", required=False) if source.kind == "prompts" else None
        if isinstance(extra, dict) and isinstance(completion, str) and "solution" not in extra:
            extra = {**extra, "solution": completion}
        row = {"prompt": _as_prompt(source.value(index, "prompt")),
               "ground_truth": _ground_truth(source, index)}
        data_source = source.value(index, "data_source", required=False)
        if data_source is not None:
            row["data_source"] = str(data_source)
        if extra not in (None, {}):
            row["extra_info"] = extra if isinstance(extra, str) else json.dumps(extra)
        out.append(row)
    return out


def _renamed_rows(source: _Mapped, names: tuple[str, ...]) -> list[dict]:
    """Rows with the fields of `names` under the pipeline's names (ChatMessages and
    PreferencePairs read and check them at training time)."""
    present = [n for n in names if source.has(n)]
    return [{n: jsonable(source.records[i][source.field(n)]) for n in present
             if source.records[i].get(source.field(n)) is not None}
            for i in range(len(source.records))]


def _chat_rows(source: _Mapped) -> list[dict]:
    if source.has("completion"):
        source.need("prompt")
    elif not source.has("messages"):
        raise RunRefused(f"chat_path {source.path} has neither the {source.describe('completion')} "
                         f"nor the {source.describe('messages')}; its fields are "
                         f"{list(source.rows.columns)}. SFT reads a prompt and a completion, or "
                         f"conversations as messages: set DataParams.columns, e.g. for GSM8K {_GSM8K}")
    return _renamed_rows(source, ("prompt", "completion", "tools") if source.has("completion")
                         else ("messages", "tools"))


def mapped_files(params: DataParams, directory: str) -> DataManifest:
    """The user's files rewritten in the pipeline's layout under `directory`, their fields read
    through DataParams.columns and the reference answer through ground_truth_after."""
    if params.eval_path is None:
        raise RunRefused("DataParams(source='files') needs eval_path: every pipeline ends in an "
                         "evaluation on held-out prompts")
    given = {kind: getattr(params, field) for kind, field in PATH_FIELDS.items()}
    stats = {kind: None if p is None else (os.path.abspath(p), os.path.getsize(p), os.path.getmtime(p))
             for kind, p in given.items()}
    key = fingerprint("files-mapped", MAPPED_VERSION, params.columns, params.ground_truth_after, stats)
    manifest_path = os.path.join(directory, "manifest.json")
    existing = read_json(manifest_path)
    if existing is not None and existing.get("fingerprint") == key:
        return DataManifest(**existing)
    build = {"chat": _chat_rows, "pairs": lambda s: _renamed_rows(s, PAIR_NAMES),
             "prompts": _prompt_rows, "eval": _prompt_rows}
    paths = {}
    for kind, path in given.items():
        if path is None:
            continue
        rows = build[kind](_Mapped(params, kind))
        paths[kind] = os.path.join(directory, f"{kind}.jsonl")
        write_lines(paths[kind], rows)
    manifest = DataManifest(directory=directory, tokenizer=params.tokenizer,
                            chat_path=paths.get("chat"), chat_val_path=None,
                            pairs_path=paths.get("pairs"), prompts_path=paths.get("prompts"),
                            eval_path=paths["eval"], fingerprint=key)
    write_json(manifest_path, manifest.model_dump())  # last: its presence means the set is whole
    return manifest


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
            raise RunRefused(f"{path} is not JSON lines ({error}); DataParams.code_path takes MBPP's "
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
    raise RunRefused(f"{path} does not have the columns of code_layout={layout!r} ({wanted}); its first "
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
        raise RunRefused(f"{params.code_path} has no rows to hold out for evaluation (MBPP's test split "
                         "is task_id 11-510); give the published file or another code_layout")
    return train[: params.code_train_problems], held


def prepare_code(params: DataParams, directory: str, seed: int) -> DataManifest:
    """Write code-task prompts, evaluation rows, SFT conversations and (unless given) a tokenizer."""
    path = os.path.abspath(params.code_path)
    source = (path, os.path.getsize(path), os.path.getmtime(path))
    key = fingerprint("code", CODE_VERSION, _generator_params(params, teacher=False), seed, source)
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


@task(retries=1, retry_delay_seconds=1, retry_condition_fn=retry_unless_refused,
      task_run_name="prepare-{params.source}")
def prepare_data(params: DataParams, directory: str, seed: int) -> DataManifest:
    """Generate or check the run's data and return where each part lives."""
    logger = get_run_logger()
    if params.source == "files":
        manifest = user_files(params) if params.read_as_given() else mapped_files(params, directory)
    elif params.source == "code":
        manifest = prepare_code(params, directory, seed)
    elif params.source == "tools":
        from tasks.tool_task import generate_tools

        manifest = generate_tools(params, directory, seed)
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
            raise RunRefused(f"{path} line {index + 1}: an evaluation row needs 'prompt' and "
                             "'ground_truth'")
    return rows

