"""The `turns` rows of tool episodes: one per action, keyed to its session like calls and verdicts.

An episode (`dew_lib.records.Episode`) is recorded as its session (the `sessions` and `calls`
rows) plus one `turns` row per action: what the policy sampled, whether EOS ended it, and what
the environment answered and how long it took. So SQL can answer "tool errors by kind" (turns
whose status is error, by detail) and "turns per episode" (count by session_uid).

Not here: the session rows (rows.py), writing (writer.py).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from dew_lib.store.rows import _list, _stamps, _table, session_uids


def turns_table(sessions: Sequence[Any], episodes: Sequence[Any], trained: Sequence[bool], *, run: str,
                stage: str, update: int, when: datetime.datetime) -> pa.Table:
    """The `turns` rows of `episodes`, each recorded as the session at the same position (None:
    a session without turns, e.g. one cancelled before its environment started)."""
    if len(episodes) != len(sessions):
        raise ValueError(f"episodes has {len(episodes)} entries for {len(sessions)} sessions; give "
                         "one episode per session, in the same order")
    uids = session_uids(run, stage, update, [str(s.task) for s in sessions], [int(s.group) for s in sessions],
                        [int(s.sample) for s in sessions], [int(s.attempt) for s in sessions],
                        [bool(t) for t in trained]).tolist()
    columns: dict[str, list] = {name: [] for name in (
        "task", "group_id", "sample", "attempt", "session_uid", "turn", "context_tokens", "action_ids",
        "terminated", "status", "detail", "seconds")}
    for session, episode, uid in zip(sessions, episodes, uids, strict=True):
        for transition in () if episode is None else episode.transitions:
            action, answer = transition.action, transition.observation
            columns["task"].append(str(session.task))
            columns["group_id"].append(int(session.group))
            columns["sample"].append(int(session.sample))
            columns["attempt"].append(int(session.attempt))
            columns["session_uid"].append(uid)
            columns["turn"].append(int(action.step))
            columns["context_tokens"].append(int(action.context.size))
            columns["action_ids"].append(action.tokens)
            columns["terminated"].append(bool(action.terminated))
            columns["status"].append(None if answer is None else answer.status.value)
            columns["detail"].append(None if answer is None else answer.detail)
            columns["seconds"].append(transition.seconds)
    n = len(columns["turn"])
    columns["action_ids"] = _list(columns["action_ids"], "int32", pa.int32())
    return _table("turns", {"run": [run] * n, "stage": [stage] * n, "update": [update] * n, **columns,
                            "written_at": _stamps(when, n)})
