"""Packing: sessions into the one fixed-shape batch every GRPO path trains on.

Call k + 1 joins call k's chain only when its prompt starts with every id of the chain so far,
sampled ids included, so sampled ids are never spliced into a context the model did not see.
Chains are placed first-fit into `[rows, width]` with segment ids and positions, and every
column is aligned with `input_ids`:

    input_ids, text_segment_ids, text_positions   int32    the chains (segment 0 is padding)
    response_mask                                 int32    1 on sampled ids, EOS included
    behavior_log_probs                            float32  engine-reported, on sampled ids
    old_log_probs                                 float32  raw-policy log-probs; only when every
                                                           call recorded them (else bypass mode)
    versions, session_index, call_index           int32    on sampled ids; -1 elsewhere
    advantages, rewards                           float32  the session's advantage and the
                                                           reward it trains on, whole chain
    session_weights                               float32  1 / (sampled ids of its session) on
                                                           sampled ids, so each session sums to 1
    routed_experts, routed                        when a call recorded expert routing
    support_ids, support_columns [rows, C]        when a call recorded its sampling support

Which sessions train, and on what reward, follows their `Status` and the truncation policy (see
`dew_lib.records.sessions`). Advantages come from the estimator table in
`dew_lib.objectives.algorithms`.

Not here: the records themselves (`dew_lib.records`), drawing sessions (sources,
`SampledRollout`, the scheduler), tokenization.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from dew_lib.objectives import algorithms
from dew_lib.records.sessions import Session, Status, check_truncation, status_trains

# ----- chains ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Chain:
    """The ids of merged calls and, per id, which call sampled it (-1 for context ids)."""

    session: int
    ids: list[np.ndarray]
    call_of: list[np.ndarray]
    calls: list[int]

    @property
    def length(self) -> int:
        return sum(len(part) for part in self.ids)

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self.ids), np.concatenate(self.call_of)


def chains(session: Session, index: int = 0) -> list[Chain]:
    """Merge a session's calls into strict chains (see the module docstring)."""
    out: list[Chain] = []
    current: Chain | None = None
    so_far = np.zeros(0, np.int32)
    for k, call in enumerate(session.calls):
        prompt, sampled = call.prompt_ids, call.sampled_ids
        extends = (current is not None and prompt.size >= so_far.size
                   and np.array_equal(prompt[: so_far.size], so_far))
        if extends:
            between = prompt[so_far.size:]
            current.ids += [between, sampled]
            current.call_of += [np.full(between.size, -1, np.int32), np.full(sampled.size, k, np.int32)]
            current.calls.append(k)
        else:
            current = Chain(index, [prompt, sampled],
                            [np.full(prompt.size, -1, np.int32), np.full(sampled.size, k, np.int32)], [k])
            out.append(current)
        so_far = np.concatenate(current.ids)
    return out


def trains(session: Session, truncation: str) -> bool:
    """Whether a session takes rows and a place in its group's baseline."""
    return status_trains(session.status, truncation)


def chain_lengths(sessions: Sequence[Session], width: int, truncation: str = "mask") -> list[int]:
    """Length of every chain `pack` would place, in packing order; refuses one wider than width."""
    check_truncation(truncation)
    lengths = []
    for index, session in enumerate(sessions):
        if not trains(session, truncation):
            continue
        for chain in chains(session, index):
            if chain.length > width:
                raise ValueError(
                    f"session {index} (task {session.task!r}, sample {session.sample}) has a chain "
                    f"of {chain.length} ids, wider than the row width {width}; raise width (the "
                    "objective's seq_len + 1) or lower the prompt and response budgets"
                )
            lengths.append(chain.length)
    return lengths


def first_fit(lengths: Sequence[int], width: int) -> list[tuple[int, int]]:
    """(row, offset) for each length, placing each into the first row with room."""
    free: list[int] = []
    places = []
    for length in lengths:
        for row, room in enumerate(free):
            if room >= length:
                places.append((row, width - room))
                free[row] -= length
                break
        else:
            places.append((len(free), 0))
            free.append(width - length)
    return places


def rows_needed(lengths: Sequence[int], width: int) -> int:
    """How many `[width]` rows first-fit packing fills with these chain lengths."""
    return 1 + max((row for row, _ in first_fit(lengths, width)), default=-1)


# ----- rewards and advantages ------------------------------------------------------------------

def training_rewards(sessions: Sequence[Session], truncation: str) -> dict[int, float]:
    """The reward each training session trains on, by index; refuses missing or NaN rewards."""
    rewards = {}
    for index, session in enumerate(sessions):
        if not trains(session, truncation):
            continue
        if session.status is Status.TRUNCATED and truncation == "zero":
            rewards[index] = 0.0
            continue
        if session.reward is None:
            raise ValueError(
                f"session {index} (task {session.task!r}, sample {session.sample}, status "
                f"{session.status.value}) has no reward; a session that trains needs its "
                "verifier's reward (a source should report an unscored session as INFRA_ERROR)"
            )
        reward = float(session.reward)
        if not math.isfinite(reward):
            raise ValueError(
                f"session {index} (task {session.task!r}, sample {session.sample}) has reward "
                f"{reward}; rewards must be finite"
            )
        rewards[index] = reward
    return rewards


def session_advantages(sessions: Sequence[Session], estimator: str = "group",
                       truncation: str = "mask") -> dict[int, float]:
    """Group-relative advantage of every training session, groups keyed by (task, group)."""
    rewards = training_rewards(sessions, truncation)
    order = sorted(rewards)
    keys: dict[tuple[str, int], int] = {}
    group_ids = np.array([keys.setdefault((sessions[i].task, sessions[i].group), len(keys)) for i in order],
                         np.int32)
    values = np.array([rewards[i] for i in order], np.float64)
    advantages = algorithms.advantages(estimator, values, group_ids)
    return {i: float(a) for i, a in zip(order, advantages, strict=True)}


# ----- packing ---------------------------------------------------------------------------------

def pack(sessions: Sequence[Session], width: int, rows: int | None = None, *,
         estimator: str = "group", truncation: str = "mask",
         support_capacity: int | None = None) -> dict[str, np.ndarray]:
    """One training batch of `[rows, width]` columns from sessions (see the module docstring).

    rows: fixed row count (None: as many as the chains need). Refuses sessions whose chains do
    not fit, a chain wider than `width`, and a recorded support without `support_capacity`.
    """
    if width < 2:
        raise ValueError(f"pack width must be at least 2, got {width}")
    check_truncation(truncation)
    algorithms.advantage_function(estimator)  # unknown names fail before any work
    rewards = training_rewards(sessions, truncation)
    advantages = session_advantages(sessions, estimator, truncation)
    placed: list[Chain] = []
    for index in sorted(advantages):
        placed += chains(sessions[index], index)
    lengths = chain_lengths([sessions[i] for i in sorted(advantages)], width, "score")
    places = first_fit(lengths, width)
    needed = 1 + max((row for row, _ in places), default=-1)
    if rows is None:
        rows = max(needed, 1)
    elif needed > rows:
        raise ValueError(
            f"the sessions' {len(lengths)} chains need {needed} rows of width {width}, but pack "
            f"was given rows={rows}; raise rows (see rows_needed) or pack fewer sessions"
        )
    calls = [sessions[c.session].calls[k] for c in placed for k in c.calls]
    has_raw = bool(calls) and all(call.raw_log_probs is not None for call in calls)
    routed_calls = [call for call in calls if call.routed_experts is not None]
    support_calls = [call for call in calls if call.support is not None]
    if support_calls and support_capacity is None:
        raise ValueError(
            "calls recorded their sampling support, so pack needs support_capacity (kept ids per "
            "row; size it at top_k times the sampled ids a row holds) to give every batch one shape"
        )

    shape = (rows, width)
    out = {
        "input_ids": np.zeros(shape, np.int32),
        "text_segment_ids": np.zeros(shape, np.int32),
        "text_positions": np.zeros(shape, np.int32),
        "response_mask": np.zeros(shape, np.int32),
        "behavior_log_probs": np.zeros(shape, np.float32),
        "versions": np.full(shape, -1, np.int32),
        "session_index": np.full(shape, -1, np.int32),
        "call_index": np.full(shape, -1, np.int32),
        "advantages": np.zeros(shape, np.float32),
        "rewards": np.zeros(shape, np.float32),
        "session_weights": np.zeros(shape, np.float32),
    }
    if has_raw:
        out["old_log_probs"] = np.zeros(shape, np.float32)
    if routed_calls:
        layers_topk = routed_calls[0].routed_experts.shape[1:]
        for call in routed_calls:
            if call.routed_experts.shape[1:] != layers_topk:
                raise ValueError(
                    f"calls recorded routed_experts of shapes [*, {layers_topk}] and "
                    f"[*, {call.routed_experts.shape[1:]}]; one model routes one way"
                )
        out["routed_experts"] = np.zeros(shape + layers_topk, routed_calls[0].routed_experts.dtype)
        out["routed"] = np.zeros(shape, bool)
    supports: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(rows)]
    sampled_per_session: dict[int, int] = {}
    for chain in placed:
        sampled_per_session[chain.session] = sampled_per_session.get(chain.session, 0) + int(
            (chain.flat()[1] >= 0).sum())
    segment_in_row = [0] * rows
    for chain, (row, offset) in zip(placed, places, strict=True):
        ids, call_of = chain.flat()
        span = slice(offset, offset + ids.size)
        segment_in_row[row] += 1
        session = sessions[chain.session]
        out["input_ids"][row, span] = ids
        out["text_segment_ids"][row, span] = segment_in_row[row]
        out["text_positions"][row, span] = np.arange(ids.size)
        out["advantages"][row, span] = advantages[chain.session]
        out["rewards"][row, span] = rewards[chain.session]
        sampled = call_of >= 0
        columns = offset + np.flatnonzero(sampled)
        out["response_mask"][row, columns] = 1
        out["session_index"][row, columns] = chain.session
        out["call_index"][row, columns] = call_of[sampled]
        out["session_weights"][row, columns] = 1.0 / max(sampled_per_session[chain.session], 1)
        _fill_calls(out, supports, session, chain, row, offset)
    if support_calls:
        out["support_ids"], out["support_columns"] = _support_columns(supports, support_capacity)
    return out


def _fill_calls(out, supports, session: Session, chain: Chain, row: int, offset: int) -> None:
    """Per-call columns: likelihoods and versions on sampled ids, routing, support."""
    cursor = offset
    for part_index, part in enumerate(chain.ids):
        is_sample = part_index % 2 == 1
        call = session.calls[chain.calls[part_index // 2]]
        if is_sample:
            span = slice(cursor, cursor + part.size)
            out["behavior_log_probs"][row, span] = call.behavior_log_probs
            out["versions"][row, span] = call.version
            if "old_log_probs" in out:
                out["old_log_probs"][row, span] = call.raw_log_probs
            if call.support is not None:
                supports[row] += [(cursor + j, kept) for j, kept in enumerate(call.support)]
            if call.routed_experts is not None:
                # A call's record covers its whole prompt (the chain so far) and its samples.
                covered = slice(offset, cursor + part.size)
                out["routed_experts"][row, covered] = call.routed_experts
                out["routed"][row, covered] = True
        cursor += part.size


def _support_columns(supports, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    rows = len(supports)
    ids = np.full((rows, capacity), -1, np.int32)
    columns = np.full((rows, capacity), -1, np.int32)
    for row, entries in enumerate(supports):
        flat_ids = [kept for _, kept in entries]
        total = sum(k.size for k in flat_ids)
        if total > capacity:
            raise ValueError(
                f"row {row} holds {total} support ids but support_capacity is {capacity}; raise "
                "support_capacity (top_k times the sampled ids a row holds)"
            )
        cursor = 0
        for column, kept in entries:
            ids[row, cursor:cursor + kept.size] = kept
            columns[row, cursor:cursor + kept.size] = column
            cursor += kept.size
    return ids, columns


# ----- metrics ---------------------------------------------------------------------------------

def session_metrics(sessions: Sequence[Session], batch: Mapping[str, np.ndarray] | None = None, *,
                    latencies: Sequence[float] | None = None, version: int | None = None,
                    truncation: str = "mask") -> dict[str, float]:
    """Host-side statistics of a set of sessions and the batch packed from them.

    calls_per_chain (the merge ratio), status shares, the share of sampled ids masked per
    status, mean reward and reward per component over training sessions, latency p50/p90/max,
    and version lag (`version` minus each training call's version) mean and max.
    """
    check_truncation(truncation)
    metrics: dict[str, float] = {}
    count = max(len(sessions), 1)
    sampled_total = sum(call.sampled_ids.size for s in sessions for call in s.calls)
    for status in Status:
        members = [s for s in sessions if s.status is status]
        metrics[f"sessions/{status.value}"] = len(members) / count
        masked = 0 if status_trains(status, truncation) else sum(
            call.sampled_ids.size for s in members for call in s.calls)
        metrics[f"masked/{status.value}"] = masked / max(sampled_total, 1)
    training = [s for s in sessions if trains(s, truncation)]
    n_chains = sum(len(chains(s)) for s in training)
    n_calls = sum(len(s.calls) for s in training)
    metrics["calls_per_chain"] = n_calls / max(n_chains, 1)
    rewards = training_rewards(sessions, truncation)
    if rewards:
        metrics["reward/mean"] = float(np.mean(list(rewards.values())))
        names = sorted({name for s in training for name in s.components})
        for name in names:
            values = [float(s.components[name]) for s in training if name in s.components]
            metrics[f"reward/{name}"] = float(np.mean(values))
    if latencies:
        lat = np.asarray(latencies, np.float64)
        metrics["latency/p50"] = float(np.percentile(lat, 50))
        metrics["latency/p90"] = float(np.percentile(lat, 90))
        metrics["latency/max"] = float(lat.max())
    if version is not None and training:
        lags = [version - call.version for s in training for call in s.calls]
        metrics["lag/mean"] = float(np.mean(lags))
        metrics["lag/max"] = float(np.max(lags))
    if batch is not None:
        mask = np.asarray(batch["response_mask"])
        metrics["batch/response_tokens"] = float(mask.sum())
        metrics["batch/fill"] = float((np.asarray(batch["text_segment_ids"]) > 0).mean())
    return metrics


__all__ = ["Chain", "chain_lengths", "chains", "first_fit", "pack", "rows_needed",
           "session_advantages", "session_metrics", "training_rewards", "trains"]
