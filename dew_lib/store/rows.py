"""Records as Arrow tables in the store's schema, and sessions read back from rows.

Sessions and calls are turned into columns with NumPy concatenations, not a Python loop per token,
so a step of thousands of rollouts converts in milliseconds. `Evaluation` and `Verdict` are the
records the evaluation stage and code rewards hand the writer; a scheduler record is anything with
SchedulerRecord's fields (an object or a mapping).

Not here: files and durability (parts.py), the writer's thread (writer.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from dew_lib.store.schema import CAUSES, TABLES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One evaluated answer. item: the prompt's index in its split; score: the reward's score;
    correct: whether the answer counts as right (None: the grader does not say)."""

    item: int
    prompt: str
    answer: str
    score: float
    reference: str = ""
    task: str = ""
    correct: bool | None = None
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    detail: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """What one program of a code reward did for a session."""

    program: int
    name: str = ""
    status: str = ""
    passed: bool = False
    score: float | None = None
    seconds: float | None = None
    exit_code: int | None = None
    detail: str = ""


RECORD_FIELDS = ("updates", "version", "lag", "groups", "resubmitted", "cancelled", "abandoned", "cut",
                 "waited", "metrics")


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _stamps(when: datetime.datetime, n: int) -> pa.Array:
    return pa.array([when] * n, pa.timestamp("us", tz="UTC"))


def _list(arrays: Sequence[np.ndarray | None], dtype, value_type: pa.DataType) -> pa.Array:
    """A list column from per-row arrays (None: a null row) with one concatenation."""
    lengths = np.fromiter((0 if a is None else a.size for a in arrays), np.int64, len(arrays))
    offsets = np.zeros(len(arrays) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [a for a in arrays if a is not None]
    values = np.concatenate([np.asarray(a, dtype).reshape(-1) for a in present]) if present else np.zeros(0, dtype)
    mask = None
    if len(present) != len(arrays):
        mask = pa.array([a is None for a in arrays], pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, value_type), mask=mask)


def _nested(supports: Sequence[Sequence[np.ndarray] | None]) -> pa.Array:
    """list<list<int32>> from per-row lists of arrays (None: a null row)."""
    inner = [kept for rows in supports if rows is not None for kept in rows]
    inner_array = _list(inner, np.int32, pa.int32())
    counts = np.fromiter((0 if rows is None else len(rows) for rows in supports), np.int64, len(supports))
    offsets = np.zeros(len(supports) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    mask = pa.array([rows is None for rows in supports], pa.bool_()) if any(r is None for r in supports) else None
    return pa.ListArray.from_arrays(pa.array(offsets), inner_array, mask=mask)


def _map(mappings: Sequence[Mapping[str, float] | None], value_type=pa.float64()) -> pa.Array:
    keys, values, offsets = [], [], [0]
    for mapping in mappings:
        for name, value in (mapping or {}).items():
            keys.append(str(name))
            values.append(value)
        offsets.append(len(keys))
    return pa.MapArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(keys, pa.string()),
                                   pa.array(values, value_type))


def _table(name: str, columns: dict[str, Any]) -> pa.Table:
    schema = TABLES[name].schema
    return pa.Table.from_arrays([pa.array(columns[f.name], f.type) if not isinstance(columns[f.name], pa.Array)
                                 else columns[f.name] for f in schema], schema=schema)


def session_uid(run: str, stage: str, update: int, task: str, group: int, sample: int, attempt: int,
                trained: bool) -> int:
    """A signed 64-bit id of one recorded session row (the join key of calls and verdicts)."""
    text = f"{run}\0{stage}\0{update}\0{task}\0{group}\0{sample}\0{attempt}\0{int(trained)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _status(session) -> str:
    return str(getattr(session.status, "value", session.status))


def resolve_trained(sessions: Sequence[Any], trained, truncation: str) -> list[bool]:
    """Per-session trained flags: given, one for all, or (None) what `pack` would train on."""
    if trained is None:
        from dew_lib.objectives.rl.sessions import status_trains, Status

        return [status_trains(Status(_status(s)), truncation) for s in sessions]
    if isinstance(trained, (bool, np.bool_)):
        return [bool(trained)] * len(sessions)
    flags = [bool(t) for t in trained]
    if len(flags) != len(sessions):
        raise ValueError(f"trained has {len(flags)} entries for {len(sessions)} sessions; give one per session")
    return flags


def per_session(values, sessions: Sequence[Any], field: str, check=None) -> list:
    """One value per session from None, a single value or a sequence of them."""
    if values is None or isinstance(values, (str, int, float)):
        out = [values] * len(sessions)
    else:
        out = list(values)
        if len(out) != len(sessions):
            raise ValueError(f"{field} has {len(out)} entries for {len(sessions)} sessions; give one per session")
    if check is not None:
        for value in out:
            check(value)
    return out


def check_cause(cause) -> None:
    if cause is not None and cause not in CAUSES:
        raise ValueError(f"cause must be one of {CAUSES} or None, got {cause!r}")


def check_latency(latency) -> None:
    if latency is not None and not (isinstance(latency, (int, float, np.floating)) and math.isfinite(latency)
                                    and latency >= 0):
        raise ValueError(f"latency must be a finite number of seconds >= 0 or None, got {latency!r}")


def session_tables(sessions: Sequence[Any], *, run: str, stage: str, update: int, trained: list[bool],
                   latencies: list, causes: list, when: datetime.datetime) -> tuple[pa.Table, pa.Table]:
    """The `sessions` and `calls` rows of one write."""
    s_cols: dict[str, list] = {name: [] for name, _, _ in TABLES["sessions"].columns}
    ident = ("run", "stage", "update", "task", "group_id", "sample", "attempt", "session_uid")
    c_ident: dict[str, list] = {name: [] for name in ident}
    call_index, versions, finish, prompts, sampled, behavior, raw = [], [], [], [], [], [], []
    routed, routed_shape, routed_dtype, support = [], [], [], []
    for session, flag, latency, cause in zip(sessions, trained, latencies, causes, strict=True):
        calls = tuple(session.calls)
        uid = session_uid(run, stage, update, session.task, session.group, session.sample,
                          session.attempt, flag)
        values = (run, stage, update, str(session.task), int(session.group), int(session.sample),
                  int(session.attempt), uid)
        for name, value in zip(ident, values, strict=True):
            s_cols[name].append(value)
        s_cols["status"].append(_status(session))
        s_cols["reward"].append(None if session.reward is None else float(session.reward))
        s_cols["components"].append({k: float(v) for k, v in session.components.items()})
        s_cols["detail"].append(str(session.detail))
        s_cols["trained"].append(flag)
        s_cols["cause"].append(cause)
        s_cols["latency"].append(None if latency is None else float(latency))
        s_cols["num_calls"].append(len(calls))
        s_cols["prompt_tokens"].append(int(np.size(calls[0].prompt_ids)) if calls else 0)
        s_cols["sampled_tokens"].append(sum(int(np.size(c.sampled_ids)) for c in calls))
        s_cols["min_version"].append(min((int(c.version) for c in calls), default=None))
        s_cols["max_version"].append(max((int(c.version) for c in calls), default=None))
        s_cols["finish_reason"].append(calls[-1].finish_reason if calls else None)
        for k, call in enumerate(calls):
            for name, value in zip(ident, values, strict=True):
                c_ident[name].append(value)
            call_index.append(k)
            versions.append(int(call.version))
            finish.append(call.finish_reason)
            prompts.append(np.asarray(call.prompt_ids))
            sampled.append(np.asarray(call.sampled_ids))
            behavior.append(np.asarray(call.behavior_log_probs))
            raw.append(None if call.raw_log_probs is None else np.asarray(call.raw_log_probs))
            experts = call.routed_experts
            if experts is None:
                routed.append(None), routed_shape.append(None), routed_dtype.append(None)
            else:
                experts = np.asarray(experts)
                routed.append(experts)
                routed_shape.append(np.asarray(experts.shape[1:], np.int32))
                routed_dtype.append(str(experts.dtype))
            support.append(None if call.support is None else [np.asarray(kept) for kept in call.support])
    s_cols["written_at"] = _stamps(when, len(sessions))
    s_cols["components"] = _map(s_cols["components"])
    n = len(call_index)
    calls_cols = {
        **c_ident, "call": call_index, "version": versions, "finish_reason": finish,
        "prompt_tokens": [p.size for p in prompts], "sampled_tokens": [s.size for s in sampled],
        "prompt_ids": _list(prompts, np.int32, pa.int32()),
        "sampled_ids": _list(sampled, np.int32, pa.int32()),
        "behavior_log_probs": _list(behavior, np.float32, pa.float32()),
        "raw_log_probs": _list(raw, np.float32, pa.float32()),
        "routed_experts": _list(routed, np.int32, pa.int32()),
        "routed_shape": _list(routed_shape, np.int32, pa.int32()),
        "routed_dtype": routed_dtype,
        "support": _nested(support) if n else pa.array([], TABLES["calls"].schema.field("support").type),
    }
    return _table("sessions", s_cols), _table("calls", calls_cols)


def record_table(record: Any, *, run: str, stage: str, when: datetime.datetime) -> pa.Table:
    """One `scheduler_records` row from a SchedulerRecord or a mapping with its fields."""
    get = record.get if isinstance(record, Mapping) else (lambda name, default=None: getattr(record, name, default))
    missing = [f for f in RECORD_FIELDS if get(f, None) is None]
    if missing:
        raise ValueError(f"scheduler record lacks {missing}; it needs the fields {RECORD_FIELDS}")
    columns = {"run": [run], "stage": [stage], "written_at": _stamps(when, 1)}
    for name in RECORD_FIELDS:
        value = get(name)
        if name == "resubmitted":
            columns[name] = _map([{k: int(v) for k, v in value.items()}], pa.int64())
        elif name == "metrics":
            columns[name] = _map([{k: float(v) for k, v in value.items()}])
        else:
            columns[name] = [float(value) if name == "waited" else int(value)]
    return _table("scheduler_records", columns)


def metrics_table(metrics: Mapping[str, float], *, run: str, stage: str, step: int,
                  when: datetime.datetime) -> pa.Table:
    names = sorted(metrics)
    return _table("metrics", {"run": [run] * len(names), "stage": [stage] * len(names),
                              "step": [step] * len(names), "name": names,
                              "value": [float(metrics[k]) for k in names],
                              "written_at": _stamps(when, len(names))})


def evaluations_table(results: Sequence[Evaluation], *, run: str, stage: str, step: int, split: str,
                      when: datetime.datetime) -> pa.Table:
    n = len(results)
    return _table("evaluations", {
        "run": [run] * n, "stage": [stage] * n, "step": [step] * n, "split": [split] * n,
        "item": [int(r.item) for r in results], "task": [str(r.task) for r in results],
        "prompt": [r.prompt for r in results], "answer": [r.answer for r in results],
        "reference": [r.reference for r in results], "score": [float(r.score) for r in results],
        "correct": [r.correct for r in results],
        "components": _map([{k: float(v) for k, v in r.components.items()} for r in results]),
        "detail": [r.detail for r in results], "written_at": _stamps(when, n)})


def verdicts_table(session: Any, verdicts: Sequence[Verdict], *, run: str, stage: str, update: int,
                   trained: bool, when: datetime.datetime) -> pa.Table:
    n = len(verdicts)
    uid = session_uid(run, stage, update, session.task, session.group, session.sample, session.attempt,
                      trained)
    return _table("verdicts", {
        "run": [run] * n, "stage": [stage] * n, "update": [update] * n, "task": [str(session.task)] * n,
        "group_id": [int(session.group)] * n, "sample": [int(session.sample)] * n,
        "attempt": [int(session.attempt)] * n, "session_uid": [uid] * n,
        "program": [v.program for v in verdicts], "name": [v.name for v in verdicts],
        "status": [v.status for v in verdicts], "passed": [bool(v.passed) for v in verdicts],
        "score": [v.score for v in verdicts], "seconds": [v.seconds for v in verdicts],
        "exit_code": [v.exit_code for v in verdicts], "detail": [v.detail for v in verdicts],
        "written_at": _stamps(when, n)})


def checkpoint_table(step: int, path: str, kind: str, *, run: str, stage: str,
                     when: datetime.datetime) -> pa.Table:
    return _table("checkpoints", {"run": [run], "stage": [stage], "step": [step], "path": [path],
                                  "kind": [kind], "written_at": _stamps(when, 1)})


# ----- reading back ----------------------------------------------------------------------------

def session_from_rows(row: Mapping[str, Any], calls: Sequence[Mapping[str, Any]]):
    """A `Session` (with its `Call`s, in call order) from a `sessions` row and its `calls` rows."""
    from dew_lib.objectives.rl.sessions import Call, Session

    built = []
    for call in sorted(calls, key=lambda c: c["call"]):
        experts = None
        if call["routed_experts"] is not None:
            shape = (-1, *call["routed_shape"])
            experts = np.asarray(call["routed_experts"], call["routed_dtype"]).reshape(shape)
        support = None if call["support"] is None else [np.asarray(k, np.int32) for k in call["support"]]
        built.append(Call(
            prompt_ids=np.asarray(call["prompt_ids"], np.int32),
            sampled_ids=np.asarray(call["sampled_ids"], np.int32),
            behavior_log_probs=np.asarray(call["behavior_log_probs"], np.float32),
            raw_log_probs=None if call["raw_log_probs"] is None else np.asarray(call["raw_log_probs"], np.float32),
            finish_reason=call["finish_reason"], version=call["version"], routed_experts=experts,
            support=support))
    return Session(task=row["task"], group=row["group_id"], sample=row["sample"], attempt=row["attempt"],
                   calls=tuple(built), status=row["status"], reward=row["reward"],
                   components=dict(row["components"] or {}), detail=row["detail"])
