"""to_verl / from_verl: sessions as verl's agent-loop rows (`AgentLoopOutput`) and back.

A row holds one strict chain of a session (the calls `pack` merges: each call's prompt starts
with everything the chain holds so far):

    prompt_ids          the chain's first prompt
    response_ids        every later id: sampled ids and the ids between calls (tool answers)
    response_mask       1 on sampled ids, 0 on the ids between
    response_logprobs   the engine's behavior log-probability of each sampled id, 0.0 elsewhere
    routed_experts      `[prompt + response, layers, top_k]`, when every call recorded routing
    reward_score        the session's reward; num_turns: 2 per call (assistant, then tool/user)
    metrics             verl's AgentLoopMetrics fields at their defaults
    extra_fields        min_global_steps / max_global_steps (the calls' versions), and under
                        "dew" what restores the session exactly: its identity, status, detail,
                        components, and each call's prompt length, sampled count, finish reason,
                        version, raw log-probabilities and support

`from_verl(rows, samples=)` reads rows back. With "dew" fields it rebuilds the sessions as
they were (a call that sampled nothing keeps its place). A native verl row becomes one session
whose calls are its runs of mask-1 ids (each call's prompt: every id before it), with the row's
min_global_steps as their version; `samples` (verl's rollout.n) groups consecutive rows the way
verl repeats each prompt. verl's own extra_fields come back in `VerlTrajectory.extras`, and
`to_verl` writes them out unchanged (its own versions only where a row had none).

Refused: a row with media (`multi_modal_data`, `mm_processor_kwargs`, `mm_processor_output`)
unless `media=True` (a text trainer would score placeholder ids without the images), and rows
without behavior log-probabilities, a version or a reward. With `eos_ids=`, a call whose ids run
past an EOS, or whose finish reason disagrees with its last id, is refused as a live action is.

Not here: packing (`packing.py`), reading verl's parquet prompts (`dew_lib.data.Prompts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.records.episodes import check_termination
from dew_lib.records.sessions import Call, Session, Status
from dew_lib.rollouts.packing import chains

MEDIA = ("multi_modal_data", "mm_processor_kwargs", "mm_processor_output")
METRICS = {"generate_sequences": 0.0, "tool_calls": 0.0, "compute_score": 0.0, "num_preempted": -1}


@dataclasses.dataclass(frozen=True)
class VerlTrajectory:
    """A session read from verl rows, and verl's own extra_fields of each of its rows."""

    session: Session
    extras: tuple[Mapping[str, Any], ...] = ()


def to_verl(sessions: Iterable[Session | VerlTrajectory]) -> list[dict[str, Any]]:
    """verl AgentLoopOutput rows (as dicts), one per strict chain of each session."""
    rows = []
    for item in sessions:
        session, extras = (item.session, item.extras) if isinstance(item, VerlTrajectory) else (item, ())
        merged = chains(session)
        for number, chain in enumerate(merged):
            own = dict(extras[number]) if number < len(extras) else {}
            rows.append(_row(session, chain, number, len(merged), own))
    return rows


def _row(session: Session, chain, number: int, count: int, extras: dict) -> dict[str, Any]:
    ids, call_of = chain.flat()
    first = session.calls[chain.calls[0]]
    start = first.prompt_ids.size
    logprobs = np.zeros(ids.size, np.float32)
    calls = []
    for k in chain.calls:
        call = session.calls[k]
        where = np.flatnonzero(call_of == k)
        logprobs[where] = call.behavior_log_probs
        calls.append({"prompt": int(call.prompt_ids.size), "sampled": int(call.sampled_ids.size),
                      "finish_reason": call.finish_reason, "version": int(call.version),
                      "raw_log_probs": None if call.raw_log_probs is None else call.raw_log_probs.tolist(),
                      "support": None if call.support is None else [np.asarray(s).tolist() for s in call.support]})
    versions = [session.calls[k].version for k in chain.calls]
    extras.setdefault("min_global_steps", int(min(versions)))
    extras.setdefault("max_global_steps", int(max(versions)))
    extras["dew"] = {"task": session.task, "group": session.group, "sample": session.sample,
                     "attempt": session.attempt, "status": session.status.value, "detail": session.detail,
                     "components": dict(session.components), "chain": number, "chains": count, "calls": calls}
    return {"prompt_ids": ids[:start].tolist(), "response_ids": ids[start:].tolist(),
            "response_mask": (call_of[start:] >= 0).astype(int).tolist(),
            "response_logprobs": logprobs[start:].tolist(), "routed_experts": _routing(session, chain),
            "reward_score": session.reward, "num_turns": 2 * len(chain.calls), "metrics": dict(METRICS),
            "extra_fields": extras}


def _routing(session: Session, chain) -> np.ndarray | None:
    """Each call's own routing of the ids it added to the chain, or None unless all have one."""
    records = [session.calls[k].routed_experts for k in chain.calls]
    if any(r is None for r in records):
        return None
    parts, held = [], 0
    for k, record in zip(chain.calls, records, strict=True):
        call = session.calls[k]
        parts.append(np.asarray(record)[held:call.prompt_ids.size + call.sampled_ids.size])
        held = call.prompt_ids.size + call.sampled_ids.size
    return np.concatenate(parts)


def from_verl(rows: Sequence[Mapping[str, Any]], *, samples: int | None = None,
              media: bool = False, eos_ids: Sequence[int] = ()) -> list[VerlTrajectory]:
    """Sessions from verl AgentLoopOutput rows (dicts or the pydantic objects); see the module
    docstring. samples: verl's rollout.n, for rows without Dew's fields. eos_ids: the policy's
    EOS ids; given, every call's ids are checked as live actions are (nothing after an EOS, a
    "stop" ends on one), and a native row's calls end "stop" on an EOS id, else "length"."""
    if samples is not None and (not isinstance(samples, int) or samples < 1):
        raise ValueError(f"from_verl(samples=) is verl's rollout.n, a positive integer; got {samples!r}")
    rows = [row.model_dump() if hasattr(row, "model_dump") else dict(row) for row in rows]
    out: list[VerlTrajectory] = []
    pending: dict[tuple, list] = {}
    for index, row in enumerate(rows):
        _check(row, index, media)
        extras = dict(row.get("extra_fields") or {})
        dew = extras.pop("dew", None)
        if dew is None:
            trajectory = VerlTrajectory(_native(row, index, samples, eos_ids), (extras,))
            _check_calls(trajectory.session, eos_ids, f"verl row {index}")
            out.append(trajectory)
            continue
        key = (dew["task"], dew["group"], dew["sample"], dew["attempt"])
        parts = pending.setdefault(key, [])
        parts.append((row, dew, extras))
        if len(parts) == dew["chains"]:
            del pending[key]
            trajectory = VerlTrajectory(_restored(parts), tuple(extras for _, _, extras in parts))
            _check_calls(trajectory.session, eos_ids, f"the verl rows of session {key}")
            out.append(trajectory)
    if pending:
        task = next(iter(pending))
        raise ValueError(f"the rows of session {task} are incomplete: Dew wrote {pending[task][0][1]['chains']} "
                         f"chains for it and {len(pending[task])} are here")
    return out


def _check(row: Mapping[str, Any], index: int, media: bool) -> None:
    where = f"verl row {index}"
    if not media and any(row.get(name) for name in MEDIA):
        raise ValueError(f"{where} carries media ({', '.join(n for n in MEDIA if row.get(n))}); Dew's text "
                         "trainer would score its placeholder ids without the images or video. Pass "
                         "from_verl(..., media=True) only to read it back out unchanged")
    if row.get("response_logprobs") is None:
        raise ValueError(f"{where} has no response_logprobs; without the engine's behavior log-probabilities "
                         "its ids cannot train")
    width = len(row["response_ids"])
    if len(row["response_logprobs"]) != width or len(row["response_mask"]) != width:
        raise ValueError(f"{where}: response_ids, response_mask and response_logprobs differ in length")
    extras = row.get("extra_fields") or {}
    if "dew" not in extras and extras.get("min_global_steps") is None:
        raise ValueError(f"{where} has no version: set extra_fields.min_global_steps (the policy version that "
                         "started it)")
    if row.get("reward_score") is None:
        raise ValueError(f"{where} has no reward_score; score it before importing")


def _check_calls(session: Session, eos_ids: Sequence[int], where: str) -> None:
    """The checks every sampled action passes (`check_termination`), when EOS ids are given."""
    if not len(eos_ids):
        return
    for k, call in enumerate(session.calls):
        check_termination(call.sampled_ids, call.finish_reason == "stop", eos_ids, f"{where}, call {k}")


def _native(row: Mapping[str, Any], index: int, samples: int | None, eos_ids: Sequence[int]) -> Session:
    prompt = np.asarray(row["prompt_ids"], np.int32)
    response = np.asarray(row["response_ids"], np.int32)
    mask = np.asarray(row["response_mask"]) > 0
    logprobs = np.asarray(row["response_logprobs"], np.float32)
    routed = row.get("routed_experts")
    version = int(row["extra_fields"]["min_global_steps"])
    calls = []
    for begin, end in _runs(mask):
        context = np.concatenate([prompt, response[:begin]])
        stopped = not len(eos_ids) or int(response[end - 1]) in eos_ids
        calls.append(Call(prompt_ids=context, sampled_ids=response[begin:end],
                          behavior_log_probs=logprobs[begin:end], version=version,
                          finish_reason="stop" if stopped else "length",
                          routed_experts=None if routed is None else np.asarray(routed)[:prompt.size + end]))
    group, sample = (index // samples, index % samples) if samples else (index, 0)
    return Session(task=str(group), group=group, sample=sample, calls=tuple(calls), status=Status.COMPLETED,
                   reward=float(row["reward_score"]))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.r_[0, mask.astype(np.int8), 0]))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def _restored(parts: list) -> Session:
    calls = []
    for row, dew, _ in sorted(parts, key=lambda part: part[1]["chain"]):
        ids = np.asarray([*row["prompt_ids"], *row["response_ids"]], np.int32)
        behavior = np.asarray([0.0] * len(row["prompt_ids"]) + list(row["response_logprobs"]), np.float32)
        routed = row.get("routed_experts")
        for entry in dew["calls"]:
            prompt, sampled = entry["prompt"], entry["sampled"]
            calls.append(Call(
                prompt_ids=ids[:prompt], sampled_ids=ids[prompt:prompt + sampled],
                behavior_log_probs=behavior[prompt:prompt + sampled], finish_reason=entry["finish_reason"],
                version=entry["version"], raw_log_probs=entry["raw_log_probs"],
                routed_experts=None if routed is None else np.asarray(routed)[:prompt + sampled],
                support=None if entry["support"] is None else tuple(np.asarray(s, np.int32) for s in entry["support"])))
    row, dew, _ = parts[0]
    return Session(task=dew["task"], group=dew["group"], sample=dew["sample"], attempt=dew["attempt"],
                   calls=tuple(calls), status=Status(dew["status"]), reward=row["reward_score"],
                   components=dew["components"], detail=dew["detail"])


__all__ = ["VerlTrajectory", "from_verl", "to_verl"]
