"""Lengths: what the stages' sequence lengths would cut of the prepared data, counted before
anything trains.

`check_lengths` tokenizes what each stage reads, as it reads it, and counts the SFT
conversations longer than sft.max_length ids (cut at the end), the GRPO prompts longer than
grpo.max_prompt_len (cut at the start) and the DPO pairs from the policy whose prompt and reference
solution exceed dpo.max_length (dropped). Each count is logged; more than DataParams.max_truncated of
the rows cut refuses the run, naming the field, the count, the share and the values that fit. A
held-out prompt that cannot be answered within the model's context, or a GRPO budget longer than
it, refuses the run too. The counts are kept beside the data (lengths.json) while the data and the
tokenizer stay the same.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
from prefect import get_run_logger, task

from tasks.data import jsonable, read_eval
from tasks.manifests import DataManifest, fingerprint
from tasks.params import PipelineParams
from tasks.refusals import RunRefused
from tasks.storage import read_json, write_json

LENGTHS_VERSION = 1  # bump when the measured lengths would come out differently


@dataclasses.dataclass(frozen=True)
class LengthCheck:
    """The token counts of the rows one length parameter applies to.

    field: the parameter (`sft.max_length`); value: its value; limit: the most ids a row keeps at
    that value; offset: a row of n ids needs the parameter at n - offset; rows: what the rows are
    ("SFT conversations"); verb: what happens to a longer one ("cuts"); ids: each row's count.
    """

    field: str
    value: int
    limit: int
    offset: int
    rows: str
    verb: str
    path: str
    ids: tuple[int, ...]

    @property
    def cut(self) -> int:
        return sum(n > self.limit for n in self.ids)

    def needed(self, share: float) -> int:
        """The smallest value at which at most `share` of the rows are cut."""
        ordered = sorted(self.ids, reverse=True)
        allowed = math.floor(share * len(ordered) + 1e-9)
        return max(ordered[allowed] - self.offset if allowed < len(ordered) else 1, 1)

    def summary(self) -> str:
        share = self.cut / len(self.ids)
        return (f"{self.field}={self.value} {self.verb} {self.cut:,} of {len(self.ids):,} {self.rows} "
                f"({share:.1%}) in {self.path}; the longest has {max(self.ids):,} ids, the 99th "
                f"percentile {int(np.percentile(self.ids, 99)):,}")

    def refusal(self, max_truncated: float, context: str) -> str | None:
        """The reason to refuse the run, or None when at most `max_truncated` of the rows are cut."""
        share = self.cut / len(self.ids)
        if share <= max_truncated:
            return None
        fits, longest = self.needed(max_truncated), max(self.ids) - self.offset
        within = (f"{self.field}={fits} {self.verb} at most {100 * max_truncated:g}% of them and "
                  f"{self.field}={longest} none" if fits < longest else f"{self.field}={longest} "
                  f"{self.verb} none of them")
        allow = math.ceil(share * 1000) / 1000
        return (f"{self.field}={self.value} {self.verb} {self.cut:,} of {len(self.ids):,} {self.rows} "
                f"({share:.1%}) in {self.path}, more than data.max_truncated={max_truncated:g} allows. "
                f"{within} (the longest has {max(self.ids):,} ids){context}. Raise {self.field}, or "
                f"accept the cut with data.max_truncated={allow:g}")


def _tokenizer_for(data: DataManifest, params: PipelineParams) -> str:
    tokenizer = data.tokenizer or params.model.pretrained
    if tokenizer is None:
        raise RunRefused("the run's data names no tokenizer and model.pretrained is empty; set "
                         "data.tokenizer to a tokenizer directory")
    return tokenizer


def _context(params: PipelineParams) -> tuple[int | None, str]:
    """The model's context in ids and the parameter that sets it (None when the checkpoint has none)."""
    if params.model.pretrained is None:
        return params.model.max_seq_len, "model.max_seq_len"
    config = read_json(os.path.join(params.model.pretrained, "config.json")) or {}
    value = config.get("max_position_embeddings")
    return (None if value is None else int(value)), "the checkpoint's max_position_embeddings"


def _prompt_lengths(renderer, prompts: list) -> list[int]:
    """Ids of each prompt as GRPO and evaluation encode it: messages through the chat template
    with the generation prompt, strings with the tokenizer's special tokens, ids as they are."""
    from dew_lib.data.prompts import prompt_kind

    out: list[int | None] = [None] * len(prompts)
    chats = []
    for index, prompt in enumerate(prompts):
        prompt = jsonable(prompt)
        kind = prompt_kind(prompt, f"prompt {index}")
        if kind == "ids":
            out[index] = len(prompt)
        elif kind == "text":
            out[index] = len(renderer.encode_plain(prompt))
        else:
            chats.append((index, prompt))
    for start in range(0, len(chats), 1000):
        chunk = chats[start:start + 1000]
        texts = renderer.render_many([m for _, m in chunk], generation=True)
        for (index, _), ids in zip(chunk, renderer.encode(texts), strict=True):
            out[index] = len(ids)
    return [int(n) for n in out]


def _chat_lengths(path: str, tokenizer: str, seq_len: int) -> list[int]:
    """Ids of each SFT conversation as ChatMessages renders it whole."""
    from dew_lib.data import ChatMessages

    spec = ChatMessages(path=path, tokenizer=tokenizer, seq_len=seq_len)
    renderer = spec.renderer()
    conversations = spec.conversations()
    out: list[int | None] = [None] * len(conversations)
    plain = [i for i, c in enumerate(conversations) if not c.tools]
    for start in range(0, len(plain), 1000):
        chunk = plain[start:start + 1000]
        texts = renderer.render_many([conversations[i].messages for i in chunk])
        for index, ids in zip(chunk, renderer.encode(texts), strict=True):
            out[index] = len(ids)
    for index, conversation in enumerate(conversations):
        if conversation.tools:
            out[index] = len(renderer.encode([renderer.render(conversation.messages, conversation.tools)])[0])
    return [int(n) for n in out]


def _conversation_prompt_lengths(path: str, tokenizer: str, renderer, seq_len: int) -> list[int]:
    """Ids of each SFT conversation's prompt as the distill stage reads it with lmbda < 1: the
    messages before its last assistant message, with the generation prompt (`last_turns`)."""
    from dew_lib.data import ChatMessages
    from dew_lib.data.prompts import last_turns

    conversations = ChatMessages(path=path, tokenizer=tokenizer, seq_len=seq_len).conversations()
    return _prompt_lengths(renderer, [record["prompt"] for record in last_turns(conversations)])


def _pair_lengths(path: str, renderer, count: int) -> list[int]:
    """Ids of the pairs DPO builds from the policy (pairs='policy'): the prompt and the reference
    solution (extra_info.solution) with its EOS, for the first `count` prompts that have one."""
    from dew_lib.data.readers import read_rows

    rows = read_rows(path)
    records = rows.get(range(min(count, len(rows))))
    prompts, solutions = [], []
    for record in records:
        extra = record.get("extra_info")
        try:
            extra = json.loads(extra) if isinstance(extra, str) else extra
        except json.JSONDecodeError:
            extra = None
        if isinstance(extra, dict) and isinstance(extra.get("solution"), str):
            prompts.append(record.get("prompt"))
            solutions.append(extra["solution"])
    if not prompts:
        return []
    lengths = _prompt_lengths(renderer, prompts)
    return [n + len(ids) + 1 for n, ids in zip(lengths, renderer.encode(solutions), strict=True)]


def measure_lengths(data: DataManifest, params: PipelineParams) -> dict[str, list[int]]:
    """Token counts of every row the stages of `params` read: SFT conversations ("chat"), GRPO
    prompts ("prompts"), DPO pairs from the policy ("pairs") and held-out prompts ("eval")."""
    from dew_lib.data.readers import read_rows
    from dew_lib.data.tokenizer import Renderer, load_tokenizer

    tokenizer = _tokenizer_for(data, params)
    renderer = Renderer(load_tokenizer(tokenizer))
    out = {"eval": _prompt_lengths(renderer, [row["prompt"] for row in
                                              read_eval(data.eval_path)[: params.evaluation.limit]])}
    if "sft" in params.stages and data.chat_path is not None:
        out["chat"] = _chat_lengths(data.chat_path, tokenizer, params.sft.max_length - 1)
    if {"grpo", "distill"} & set(params.stages) and data.prompts_path is not None:
        out["prompts"] = _prompt_lengths(renderer, read_rows(data.prompts_path).column("prompt"))
    if "distill" in params.stages and params.distill.lmbda < 1 and data.chat_path is not None:
        out["distill"] = _conversation_prompt_lengths(
            data.chat_path, tokenizer, renderer, params.distill.max_prompt_len + params.distill.max_new_tokens)
    if "dpo" in params.stages and params.dpo.pairs == "policy" and data.prompts_path is not None:
        out["pairs"] = _pair_lengths(data.prompts_path, renderer, params.dpo.pair_prompts)
    return out


def length_checks(data: DataManifest, params: PipelineParams,
                  measured: dict[str, list[int]]) -> list[LengthCheck]:
    checks = []
    if measured.get("chat"):
        checks.append(LengthCheck("sft.max_length", params.sft.max_length, params.sft.max_length, 0,
                                  "SFT conversations", "cuts", data.chat_path, tuple(measured["chat"])))
    # With lmbda < 1 the distill stage's prompts are the SFT conversations' (train.py _build_distill).
    distilled = ("distill", data.chat_path) if params.distill.lmbda < 1 else ("prompts", data.prompts_path)
    if measured.get(distilled[0]) and "distill" in params.stages:
        checks.append(LengthCheck("distill.max_prompt_len", params.distill.max_prompt_len,
                                  params.distill.max_prompt_len, 0, "distill prompts", "cuts the start of",
                                  distilled[1], tuple(measured[distilled[0]])))
    if measured.get("prompts") and "grpo" in params.stages:
        checks.append(LengthCheck("grpo.max_prompt_len", params.grpo.max_prompt_len,
                                  params.grpo.max_prompt_len, 0, "GRPO prompts", "cuts the start of",
                                  data.prompts_path, tuple(measured["prompts"])))
    if measured.get("pairs"):
        checks.append(LengthCheck("dpo.max_length", params.dpo.max_length, params.dpo.max_length, 0,
                                  "DPO pairs from the policy (prompt and reference solution)", "drops",
                                  data.prompts_path, tuple(measured["pairs"])))
    return checks


def length_refusals(data: DataManifest, params: PipelineParams,
                    measured: dict[str, list[int]]) -> tuple[list[str], list[str]]:
    """(what to log, why to refuse) for the measured lengths against the parameters."""
    context, setting = _context(params)
    notes, refusals = [], []
    for check in length_checks(data, params, measured):
        notes.append(check.summary())
        needs = ""
        if context is not None and check.field == "sft.max_length":
            needs = f"; {setting}={context} must hold sft.max_length - 1 too"
        elif context is not None and check.field == "grpo.max_prompt_len":
            needs = (f"; {setting}={context} must hold grpo.max_prompt_len + grpo.max_new_tokens "
                     f"({params.grpo.max_new_tokens})")
        reason = check.refusal(params.data.max_truncated, needs)
        if reason is not None:
            refusals.append(reason)
    if context is None:
        return notes, refusals
    budget = params.evaluation.max_new_tokens
    held = measured["eval"]
    over = [n for n in held if n + budget > context]
    if over:
        fix = (f"raise {setting} to {max(held) + budget}, lower evaluation.max_new_tokens"
               if params.model.pretrained is None else
               f"lower evaluation.max_new_tokens to {max(context - max(held), 1)}")
        refusals.append(
            f"{setting}={context} cannot hold {len(over):,} of the {len(held):,} held-out prompts in "
            f"{data.eval_path} with their answers (evaluation.max_new_tokens={budget}): the longest "
            f"prompt has {max(held):,} ids. To fix it, {fix}, or evaluate fewer rows with evaluation.limit")
    if "sft" in params.stages and measured.get("chat") and params.sft.max_length - 1 > context:
        refusals.append(f"sft.max_length={params.sft.max_length} trains {params.sft.max_length - 1} positions, "
                        f"more than {setting}={context}; raise {setting} to at least "
                        f"{params.sft.max_length - 1} or lower sft.max_length to {context + 1}")
    if "grpo" in params.stages and params.grpo.max_prompt_len + params.grpo.max_new_tokens > context:
        refusals.append(f"grpo.max_prompt_len + grpo.max_new_tokens = {params.grpo.max_prompt_len} + "
                        f"{params.grpo.max_new_tokens} is longer than {setting}={context}; raise "
                        f"{setting} to at least {params.grpo.max_prompt_len + params.grpo.max_new_tokens} "
                        "or lower one of them")
    if "distill" in params.stages and params.distill.max_prompt_len + params.distill.max_new_tokens > context:
        refusals.append(f"distill.max_prompt_len + distill.max_new_tokens = {params.distill.max_prompt_len} + "
                        f"{params.distill.max_new_tokens} is longer than {setting}={context}; lower one of them")
    return notes, refusals


def _tokenizer_stats(directory: str) -> list:
    return sorted((name, os.path.getsize(os.path.join(directory, name)),
                   os.path.getmtime(os.path.join(directory, name)))
                  for name in os.listdir(directory) if os.path.isfile(os.path.join(directory, name)))


def lengths_of(data: DataManifest, params: PipelineParams, directory: str | None = None):
    """`measure_lengths`, kept in `directory`/lengths.json and reused while the data, tokenizer,
    evaluation limit and the stages that read the rows stay the same."""
    tokenizer = _tokenizer_for(data, params)
    kinds = (params.stages, params.evaluation.limit,
             params.dpo.pair_prompts if params.dpo.pairs == "policy" else None)
    stats = _tokenizer_stats(tokenizer) if os.path.isdir(tokenizer) else tokenizer
    key = fingerprint("lengths", LENGTHS_VERSION, data.fingerprint, os.path.abspath(tokenizer), stats,
                      kinds)
    path = None if directory is None else os.path.join(directory, "lengths.json")
    saved = None if path is None else read_json(path)
    if saved is not None and saved.get("fingerprint") == key:
        return saved["lengths"]
    measured = measure_lengths(data, params)
    if path is not None:
        write_json(path, {"fingerprint": key, "lengths": measured})
    return measured


def check_lengths_now(data: DataManifest, params: PipelineParams, logger,
                      directory: str | None = None) -> dict[str, list[int]]:
    """Log what the stages' lengths cut; ValueError with every reason when the run should not start."""
    measured = lengths_of(data, params, directory)
    notes, refusals = length_refusals(data, params, measured)
    for note in notes:
        logger.info("%s", note)
    if refusals:
        raise RunRefused("the run's lengths do not fit its data:\n- " + "\n- ".join(refusals))
    return measured


@task(retries=0, task_run_name="check-lengths")
def check_lengths(data: DataManifest, params: PipelineParams) -> dict[str, int]:
    """Count, before training, the rows each stage's length would cut or drop; refuse the run when
    more than data.max_truncated of them would be, or when held-out prompts do not fit the model.
    Returns how many rows each length cuts."""
    directory = os.path.join(os.path.abspath(params.root), params.name, "data")
    measured = check_lengths_now(data, params, get_run_logger(), directory)
    return {check.field: check.cut for check in length_checks(data, params, measured)}
