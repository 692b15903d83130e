"""The tool task (data.source="tools"): products asked in chat, answered with a calculator.

The data is the arithmetic demo's layout with two-digit products (beyond what the embedded
decoder computes): SFT conversations of which a share (`DataParams.tool_share`) call the
calculator, read its answer and reply, and the others reply at once; GRPO prompts and held-out
prompts with their products as ground truth. GRPO and evaluation run each prompt as a tool
episode: the policy's turns go to a calculator worker process (`dew_lib.tools.calculator`, one
per episode, through `SubprocessEnvironment`), and the policy's last reply is graded like any
math answer (`TaskReward`, data_source "calculator"). What GRPO can learn is when to call.

Not here: the calculator itself (dew_lib/tools/calculator.py), the episode loop
(dew_lib.rollouts.EpisodeRollout), building the stage (dew_lib/recipes/episodes.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys

import jax
import numpy as np

from dew_lib.data.arithmetic import Problem, expression, products, solution
from dew_lib.data.byte_bpe import train_byte_bpe
from dew_lib.data.prompts import text_field
from dew_lib.inference import TextGeneration
from dew_lib.records.episodes import Episode
from dew_lib.rollouts import EpisodeRollout, SubprocessEnvironment
from dew_lib.sampling import Sampling
from dew_lib.sandbox import SandboxLimits
from dew_lib.tools import calculator
from tasks.manifests import DataManifest, fingerprint
from tasks.params import DataParams, ToolParams
from tasks.storage import read_json, write_json, write_lines

TOOLS_VERSION = 1  # bump when the files below would come out differently
SOURCE = "calculator"  # the rows' data_source: graded as math (tasks/rewards.py)


def conversation(problem: Problem, called: bool) -> list[dict[str, str]]:
    """The problem answered through the calculator (`called`) or at once."""
    if not called:
        return problem.messages()
    arithmetic = expression(problem)
    return [{"role": "user", "content": problem.question},
            {"role": "assistant", "content": calculator.call_text(arithmetic)},
            {"role": "tool", "content": calculator.calculate(arithmetic)[0]},
            {"role": "assistant", "content": solution(problem)}]


def _chatml(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def _prompt_record(problem: Problem) -> dict:
    return {"prompt": problem.messages(False), "ground_truth": str(problem.answer),
            "data_source": SOURCE, "extra_info": json.dumps({"expression": expression(problem)})}


def generate_tools(params: DataParams, directory: str, seed: int) -> DataManifest:
    """Write the tool task's files under `directory` (or reuse an identical earlier set)."""
    unused = {"max_truncated", "teacher_errors"}  # the tool task's answers all come from its calculator
    key = fingerprint("tools", TOOLS_VERSION, params.model_dump(mode="json", exclude=unused), seed)
    manifest_path = os.path.join(directory, "manifest.json")
    existing = read_json(manifest_path)
    if existing is not None and existing.get("fingerprint") == key:
        return DataManifest(**existing)
    # 8,100 products in all: hold out distinct ones first, then draw training problems (repeats
    # and all) among the rest, so every held-out product is one the policy never saw answered
    held_out = list({p.question: p for p in products(4 * params.test_problems, seed=seed + 1)}.values())
    held_out = held_out[: params.test_problems]
    unseen = {p.question for p in held_out}
    train = [p for p in products(2 * params.train_problems, seed=seed)
             if p.question not in unseen][: params.train_problems]
    rng = random.Random(seed)
    sft, rest = train[: len(train) // 2], train[len(train) // 2:]
    chats = [conversation(p, rng.random() < params.tool_share) for p in sft]
    tokenizer_dir = os.path.join(directory, "tokenizer")
    train_byte_bpe((_chatml(c) for c in chats[:4000]), vocab_size=params.vocab_size, directory=tokenizer_dir)
    paths = {name: os.path.join(directory, f"{name}.jsonl") for name in ("chat", "chat_val", "prompts", "eval")}
    write_lines(paths["chat"], ({"messages": c} for c in chats))
    write_lines(paths["chat_val"], ({"messages": conversation(p, True)} for p in held_out[:50]))
    write_lines(paths["prompts"], (_prompt_record(p) for p in rest))
    write_lines(paths["eval"], (_prompt_record(p) for p in held_out))
    manifest = DataManifest(directory=directory, tokenizer=tokenizer_dir, chat_path=paths["chat"],
                            chat_val_path=paths["chat_val"], pairs_path=None, prompts_path=paths["prompts"],
                            eval_path=paths["eval"], fingerprint=key, tool="calculator")
    write_json(manifest_path, manifest.model_dump())  # last: its presence means the set is whole
    return manifest


def calculator_environment(tokenizer, tokenizer_dir: str, params: ToolParams) -> SubprocessEnvironment:
    """The factory of calculator episodes: a worker process each, with `params`' limits, told
    how `tokenizer`'s chat template wraps a tool's answer."""
    turn = {"tokenizer": os.path.abspath(os.path.join(tokenizer_dir, "tokenizer.json")),
            **calculator.tool_turn(tokenizer)}
    if not os.path.isfile(turn["tokenizer"]):
        raise ValueError(f"the calculator worker reads {turn['tokenizer']}, which does not exist; the "
                         "tool task needs a fast tokenizer saved as tokenizer.json")
    limits = SandboxLimits(wall_seconds=params.wall_seconds, cpu_seconds=math.ceil(params.wall_seconds),
                           memory_bytes=params.memory_mb << 20)
    return SubprocessEnvironment((sys.executable, "-m", "dew_lib.tools.calculator", "turn.json"), limits,
                                 files={"turn.json": json.dumps(turn)})


def reply_text(tokenizer, episode: Episode) -> str:
    """The policy's last reply of an episode (empty when it never replied)."""
    if not episode.transitions:
        return ""
    return tokenizer.decode(episode.transitions[-1].action.tokens, skip_special_tokens=True)


def transcript(tokenizer, episode: Episode) -> str:
    """Everything after the prompt: the policy's turns and the tool's answers, as text."""
    if not episode.transitions:
        return ""
    first = episode.transitions[0].action.context.size
    last = episode.transitions[-1].action
    ids = [*last.context.tolist()[first:], *last.tokens.tolist()]
    return tokenizer.decode(ids, skip_special_tokens=False)


def _text(value) -> str:
    """A reward field as text: already text (prompt_tasks' layout), or a Prompts row's bytes."""
    return value if isinstance(value, str) else text_field(np.asarray(value)[None])[0]


class EpisodeVerifier:
    """`(task, episode) -> score`: the last reply graded by `grader` (a TaskReward) on the task
    row's data_source, ground_truth and extra_info, as a one-turn answer would be."""

    def __init__(self, grader, tokenizer):
        self.grader, self.tokenizer = grader, tokenizer

    def __call__(self, task, episode: Episode) -> float:
        source, truth, extra = (_text(task.data.get(name, "")) for name in
                                ("data_source", "ground_truth", "extra_info"))
        return float(self.grader(source, reply_text(self.tokenizer, episode), truth, extra))


def _graded_later(task, episode) -> float:
    """Evaluation grades the replies after the episodes, like one-turn answers (tasks/evaluate.py)."""
    return 0.0


def episode_answers(model, variables, tokenizer, tokenizer_dir: str, prompts: list[list[int]],
                    max_new_tokens: int, tools: ToolParams, *, temperature: float, samples: int,
                    seed: int) -> list[tuple[str, str]]:
    """`(last reply, transcript)` of `samples` episodes per prompt (greedy at temperature 0;
    sample j of prompt i at j * len(prompts) + i), `tools.alive` episodes open at a time."""
    groups = max(samples, 2)  # EpisodeRollout compares samples; a greedy pass keeps the first
    rollout = EpisodeRollout(
        TextGeneration(model, pad_id=tokenizer.pad_token_id or 0),
        calculator_environment(tokenizer, tokenizer_dir, tools), _graded_later,
        max_prompt_tokens=tools.max_prompt_len, max_new_tokens=max_new_tokens, max_turns=tools.max_turns,
        groups=groups, sampling=Sampling(temperature=temperature, eos_id=tokenizer.eos_token_id),
        workers=tools.workers)
    width = max(map(len, prompts))
    chunk = max(1, tools.alive // groups)
    answers: list[list[tuple[str, str]]] = [[] for _ in range(samples)]
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        batch = {"task_id": np.arange(start, start + len(part), dtype=np.int32),
                 "prompt": np.array([[0] * (width - len(p)) + list(p) for p in part], np.int32),
                 "prompt_length": np.array([len(p) for p in part], np.int32)}
        results = rollout.collect(variables, batch, jax.random.fold_in(jax.random.key(seed), start))
        for n, result in enumerate(results):
            if n % groups < samples:
                answers[n % groups].append((reply_text(tokenizer, result.episode),
                                            transcript(tokenizer, result.episode)))
    return [answer for drawn in answers for answer in drawn]
