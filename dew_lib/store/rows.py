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
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from dew_lib.records.scheduler import CAUSES
from dew_lib.records.sessions import Call, Session, Status, check_truncation, status_trains
from dew_lib.store.schema import TABLES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One evaluated answer. item: the prompt's index in its split; prompt: its text, or its
    messages (a list or mapping, stored as JSON text); score: the reward's score; correct:
    whether the answer counts as right (None: the grader does not say); temperature: 0 for a
    greedy answer, else the temperature it was drawn at; sample: 0 for the greedy answer, 1..k
    for the k answers drawn for the item at `temperature`."""

    item: int
    prompt: str | Sequence[Any] | Mapping[str, Any]
    answer: str
    score: float
    reference: str = ""
    task: str = ""
    correct: bool | None = None
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    detail: str = ""
    temperature: float = 0.0
    sample: int = 0


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


def check_started_at(when: datetime.datetime | None) -> datetime.datetime | None:
    """A stage's given start, refused unless it is an aware time no later than now."""
    if when is None:
        return None
    if not isinstance(when, datetime.datetime) or when.tzinfo is None:
        raise ValueError(f"started_at must be a timezone-aware datetime (e.g. datetime.now(UTC)), got {when!r}")
    if when > now():
        raise ValueError(f"started_at {when.isoformat()} is in the future; give when the stage's work began")
    return when


def _stamps(when: datetime.datetime, n: int) -> pa.Array:
    return pa.array([when] * n, pa.timestamp("us", tz="UTC"))


def _list(arrays: Sequence[Any], dtype, value_type: pa.DataType) -> pa.Array:
    """A list column from per-row arrays (None: a null row) with one concatenation."""
    rows = [None if a is None else _array(a, dtype).reshape(-1) for a in arrays]
    lengths = np.fromiter((0 if a is None else a.size for a in rows), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [a for a in rows if a is not None]
    values = np.concatenate(present) if present else np.zeros(0, dtype)
    mask = None
    if len(present) != len(rows):
        mask = pa.array([a is None for a in rows], pa.bool_())
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


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit moves every output bit (uint64, wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def session_uids(run: str, stage: str, update: int, tasks: Sequence[str], groups, samples, attempts,
                 trained) -> np.ndarray:
    """Signed 64-bit ids of recorded session rows: a hash of run, stage, update, task, group,
    sample, attempt and the trained flag (the join key of calls and verdicts to sessions)."""
    cache: dict[str, int] = {}
    x = np.fromiter((cache.setdefault(t, _hash(t)) if t not in cache else cache[t] for t in tasks),
                    np.uint64, len(tasks))
    x = _mix(x ^ np.uint64(_hash(f"{run}\0{stage}\0{update}")))
    for values in (groups, samples, attempts, trained):
        x = _mix(x ^ np.asarray(values, np.int64).astype(np.uint64))
    return x.view(np.int64)


def session_uid(run: str, stage: str, update: int, task: str, group: int, sample: int, attempt: int,
                trained: bool) -> int:
    """The `session_uid` the store gives one recorded session (see session_uids)."""
    return int(session_uids(run, stage, update, [str(task)], [group], [sample], [attempt], [trained])[0])


def _status(session) -> str:
    return str(getattr(session.status, "value", session.status))


def trained_flags(sessions: Sequence[Any], trained, truncation: str) -> list[bool]:
    """Per-session trained flags: given, one for all, or (None) what `pack` would train on."""
    if trained is None:
        trains = {status: status_trains(status, truncation) for status in Status}
        return [trains[Status(_status(s))] for s in sessions]
    if isinstance(trained, (bool, np.bool_)):
        return [bool(trained)] * len(sessions)
    return [bool(t) for t in trained]


def check_trained(trained, count: int, truncation: str) -> None:
    """Refuse on the caller's thread what trained_flags would fail on later."""
    if trained is None:
        check_truncation(truncation)
    elif not isinstance(trained, (bool, np.bool_)) and len(trained) != count:
        raise ValueError(f"trained has {len(trained)} entries for {count} sessions; give one per session")


def per_session(values, count: int, field: str) -> list:
    """One value per session from None, a single value or a sequence of them."""
    if values is None or isinstance(values, (str, int, float)):
        return [values] * count
    out = list(values)
    if len(out) != count:
        raise ValueError(f"{field} has {len(out)} entries for {count} sessions; give one per session")
    return out


def check_causes(causes: list) -> None:
    for cause in set(causes) - set(CAUSES) - {None}:
        raise ValueError(f"cause must be one of {CAUSES} or None, got {cause!r}")


def check_latencies(latencies: list) -> None:
    given = [x for x in latencies if x is not None]
    try:
        values = np.asarray(given, np.float64)
    except (TypeError, ValueError):
        values = None
    if values is None or values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values < 0):
        bad = next((x for x in given if not isinstance(x, (int, float, np.number)) or not math.isfinite(x)
                    or x < 0), given)
        raise ValueError(f"latencies must be finite numbers of seconds >= 0 or None, got {bad!r}")


def _array(value, dtype) -> np.ndarray:
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    return array.astype(dtype, copy=False)


def session_tables(sessions: Sequence[Any], *, run: str, stage: str, update: int, trained: list[bool],
                   latencies: list, causes: list, when: datetime.datetime) -> tuple[pa.Table, pa.Table]:
    """The `sessions` and `calls` rows of one write: per-session values in Python, everything
    per call or per token in NumPy/Arrow."""
    n = len(sessions)
    tasks = [str(s.task) for s in sessions]
    groups = [int(s.group) for s in sessions]
    samples = [int(s.sample) for s in sessions]
    attempts = [int(s.attempt) for s in sessions]
    uids = session_uids(run, stage, update, tasks, groups, samples, attempts, trained)
    per_session = [tuple(s.calls) for s in sessions]
    num_calls = np.fromiter(map(len, per_session), np.int64, n)
    flat = [call for calls in per_session for call in calls]
    owner = np.repeat(np.arange(n), num_calls)
    first = np.concatenate([[0], np.cumsum(num_calls)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
    has = num_calls > 0
    prompts = [_array(c.prompt_ids, np.int32) for c in flat]
    sampled = [_array(c.sampled_ids, np.int32) for c in flat]
    prompt_len = np.fromiter((p.size for p in prompts), np.int32, len(flat))
    sampled_len = np.fromiter((t.size for t in sampled), np.int32, len(flat))
    versions = np.fromiter((int(c.version) for c in flat), np.int64, len(flat))
    finish = [c.finish_reason for c in flat]
    lowest, highest = np.zeros(n, np.int64), np.zeros(n, np.int64)
    if flat:
        starts = first[has]
        lowest[has] = np.minimum.reduceat(versions, starts)
        highest[has] = np.maximum.reduceat(versions, starts)
    present = ~has  # null where a session has no calls
    first_prompt = np.zeros(n, np.int32)
    first_prompt[has] = prompt_len[first[has]]
    ident = {"run": pa.repeat(pa.scalar(run), n), "stage": pa.repeat(pa.scalar(stage), n),
             "update": pa.repeat(pa.scalar(update, pa.int64()), n), "task": pa.array(tasks, pa.string()),
             "group_id": pa.array(groups, pa.int32()), "sample": pa.array(samples, pa.int32()),
             "attempt": pa.array(attempts, pa.int32()), "session_uid": pa.array(uids)}
    last = first + num_calls - 1
    sessions_table = _table("sessions", {
        **ident,
        "status": [_status(s) for s in sessions],
        "reward": [None if s.reward is None else float(s.reward) for s in sessions],
        "components": _map([s.components for s in sessions]),
        "detail": [str(s.detail) for s in sessions],
        "trained": trained, "cause": causes,
        "latency": [None if x is None else float(x) for x in latencies],
        "num_calls": num_calls.astype(np.int32),
        "prompt_tokens": first_prompt,
        "sampled_tokens": np.bincount(owner, weights=sampled_len, minlength=n).astype(np.int32),
        "min_version": pa.array(lowest, mask=present), "max_version": pa.array(highest, mask=present),
        "finish_reason": [finish[i] if k else None for i, k in zip(last.tolist(), has.tolist())],
        "written_at": _stamps(when, n),
    })
    take = pa.array(owner)
    routed, routed_shape, routed_dtype = [], [], []
    for call in flat:
        experts = call.routed_experts
        if experts is None:
            routed.append(None), routed_shape.append(None), routed_dtype.append(None)
        else:
            experts = np.asarray(experts)
            routed.append(experts)
            routed_shape.append(np.asarray(experts.shape[1:], np.int32))
            routed_dtype.append(str(experts.dtype))
    calls_table = _table("calls", {
        **{name: column.take(take) for name, column in ident.items()},
        "call": (np.arange(len(flat)) - first[owner]).astype(np.int32) if flat else np.zeros(0, np.int32),
        "version": versions, "finish_reason": finish,
        "prompt_tokens": prompt_len, "sampled_tokens": sampled_len,
        "prompt_ids": _list(prompts, np.int32, pa.int32()),
        "sampled_ids": _list(sampled, np.int32, pa.int32()),
        "behavior_log_probs": _list([c.behavior_log_probs for c in flat], np.float32, pa.float32()),
        "raw_log_probs": _list([c.raw_log_probs for c in flat], np.float32, pa.float32()),
        "routed_experts": _list(routed, np.int32, pa.int32()),
        "routed_shape": _list(routed_shape, np.int32, pa.int32()),
        "routed_dtype": routed_dtype,
        "support": _nested([None if c.support is None else list(c.support) for c in flat]),
    })
    return sessions_table, calls_table


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


def prompt_text(prompt: Any) -> str:
    """A prompt as stored: text as it is; messages, token ids or any other structure as JSON."""
    if isinstance(prompt, str):
        return prompt

    def plain(value):
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, Mapping):
            return dict(value)
        if isinstance(value, (tuple, set, frozenset)):
            return list(value)
        return str(value)

    return json.dumps(prompt, ensure_ascii=False, default=plain)


def evaluations_table(results: Sequence[Evaluation], *, run: str, stage: str, step: int, split: str,
                      when: datetime.datetime) -> pa.Table:
    n = len(results)
    return _table("evaluations", {
        "run": [run] * n, "stage": [stage] * n, "step": [step] * n, "split": [split] * n,
        "item": [int(r.item) for r in results], "task": [str(r.task) for r in results],
        "prompt": [prompt_text(r.prompt) for r in results], "answer": [r.answer for r in results],
        "reference": [r.reference for r in results], "score": [float(r.score) for r in results],
        "correct": [r.correct for r in results],
        "components": _map([{k: float(v) for k, v in r.components.items()} for r in results]),
        "detail": [r.detail for r in results], "temperature": [float(r.temperature) for r in results],
        "sample": [int(r.sample) for r in results], "written_at": _stamps(when, n)})


def verdicts_table(session: Any, verdicts: Sequence[Verdict], *, run: str, stage: str, update: int,
                   trained: bool, when: datetime.datetime) -> pa.Table:
    """The `verdicts` rows of one session's programs."""
    return owners_verdicts_table([(session.task, session.group, session.sample, session.attempt, trained)],
                                 [verdicts], run=run, stage=stage, update=update, when=when)


def owners_verdicts_table(owners: Sequence[tuple[Any, int, int, int, bool]],
                          verdicts: Sequence[Sequence[Verdict]], *, run: str, stage: str, update: int,
                          when: datetime.datetime) -> pa.Table:
    """The `verdicts` rows of many owners at once. owners: (task, group, sample, attempt, trained)
    of each session (or evaluated answer, see evaluation_owners); verdicts: one sequence per owner."""
    counts = [len(v) for v in verdicts]
    n = sum(counts)
    tasks = [str(o[0]) for o in owners]
    uids = session_uids(run, stage, update, tasks, [int(o[1]) for o in owners], [int(o[2]) for o in owners],
                        [int(o[3]) for o in owners], [bool(o[4]) for o in owners])

    def each(values):
        return [value for value, count in zip(values, counts, strict=True) for _ in range(count)]

    flat = [v for vs in verdicts for v in vs]
    return _table("verdicts", {
        "run": [run] * n, "stage": [stage] * n, "update": [update] * n, "task": each(tasks),
        "group_id": each([int(o[1]) for o in owners]), "sample": each([int(o[2]) for o in owners]),
        "attempt": each([int(o[3]) for o in owners]), "session_uid": each(uids.tolist()),
        "program": [v.program for v in flat], "name": [v.name for v in flat],
        "status": [v.status for v in flat], "passed": [bool(v.passed) for v in flat],
        "score": [v.score for v in flat], "seconds": [v.seconds for v in flat],
        "exit_code": [v.exit_code for v in flat], "detail": [v.detail for v in flat],
        "written_at": _stamps(when, n)})


SAMPLE_FIELDS = ("group", "rewards", "group_mean", "group_std", "advantages", "kept", "captions")


def sample_columns(record: Any, images: Sequence[bytes | None] | None) -> dict[str, np.ndarray]:
    """Check and copy the per-sample fields of a rollout record (a FlowRolloutRecord or anything
    with SAMPLE_FIELDS) on the caller's thread; `sample` numbers each row within its group."""
    missing = [f for f in SAMPLE_FIELDS if not hasattr(record, f)]
    if missing:
        raise TypeError(f"samples takes a rollout record with {list(SAMPLE_FIELDS)} (a "
                        f"FlowRolloutRecord); {type(record).__name__} lacks {missing}")
    columns = {
        "group_id": np.asarray(record.group).astype(np.int32).reshape(-1),
        "reward": np.array(record.rewards, np.float64).reshape(-1),
        "group_mean": np.array(record.group_mean, np.float64).reshape(-1),
        "group_std": np.array(record.group_std, np.float64).reshape(-1),
        "advantage": np.array(record.advantages, np.float32).reshape(-1),
        "kept": np.array(record.kept, bool).reshape(-1),
        "caption": np.array([str(c) for c in record.captions], dtype=object).reshape(-1),
        "image": np.array([None] * len(record.rewards) if images is None else
                          [None if i is None else bytes(i) for i in images], dtype=object).reshape(-1),
    }
    count = len(columns["reward"])
    wrong = {name: len(values) for name, values in columns.items() if len(values) != count}
    if wrong:
        raise ValueError(f"samples: every field needs one value per sample ({count} rewards); got "
                         f"lengths {wrong}" + (" for images (one PNG per sample, or None)"
                                               if "image" in wrong else ""))
    for name in ("reward", "group_mean", "group_std"):
        bad = np.flatnonzero(~np.isfinite(columns[name]))
        if bad.size:
            raise ValueError(f"samples: {name} must be finite; rows {bad[:4].tolist()} hold "
                             f"{columns[name][bad[:4]].tolist()}")
    group = columns["group_id"]
    order = np.argsort(group, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(group[order]) != 0])
    rank = np.arange(count) - np.repeat(starts, np.diff(np.r_[starts, count]))
    columns["sample"] = np.empty(count, np.int32)
    columns["sample"][order] = rank
    return columns


def samples_table(columns: Mapping[str, np.ndarray], *, run: str, stage: str, update: int,
                  when: datetime.datetime) -> pa.Table:
    n = len(columns["reward"])
    return _table("samples", {
        "run": [run] * n, "stage": [stage] * n, "update": [update] * n,
        "row": np.arange(n, dtype=np.int32), **{k: list(v) if v.dtype == object else v
                                                for k, v in columns.items()},
        "written_at": _stamps(when, n)})


def evaluation_owners(results: Sequence[Evaluation]) -> list[tuple[str, int, int, int, bool]]:
    """How an evaluated answer owns verdict rows: task = its task, group_id = its item, sample =
    its sample, attempt 0, never trained. Join with `v.update = e.step AND v.group_id = e.item
    AND v.sample = e.sample`."""
    return [(str(r.task), int(r.item), int(r.sample), 0, False) for r in results]


def check_verdicts(verdicts: Any, count: int, what: str) -> list[tuple[Verdict, ...]]:
    """One tuple of Verdict records per session or evaluation, refused on the caller's thread."""
    if isinstance(verdicts, (str, bytes)) or not isinstance(verdicts, Sequence):
        raise TypeError(f"verdicts must be a sequence with one list of Verdict records per {what}, "
                        f"got {type(verdicts).__name__}")
    if len(verdicts) != count:
        raise ValueError(f"verdicts has {len(verdicts)} entries for {count} {what}s; give one list "
                         f"(possibly empty) per {what}")
    out = []
    for entry in verdicts:
        entry = tuple(entry or ())
        for v in entry:
            if not isinstance(v, Verdict):
                raise TypeError(f"verdicts takes Verdict records, got {type(v).__name__}")
        out.append(entry)
    return out


def checkpoint_table(step: int, path: str, kind: str, *, run: str, stage: str,
                     when: datetime.datetime) -> pa.Table:
    return _table("checkpoints", {"run": [run], "stage": [stage], "step": [step], "path": [path],
                                  "kind": [kind], "written_at": _stamps(when, 1)})


# ----- reading back ----------------------------------------------------------------------------

def session_from_rows(row: Mapping[str, Any], calls: Sequence[Mapping[str, Any]]):
    """A `Session` (with its `Call`s, in call order) from a `sessions` row and its `calls` rows."""
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
