"""The values of an episode journal: a collection's identity, its saved draws and answered turns,
and what a restarted collection gets back (`Restored`), checked against what runs now.

`CollectionIdentity` is what must agree for a journal to resume a collection: the clocks, task
ids, budgets, sampling controls, topology, key and a digest of the local policy shards
(`policy_digest`, which reads the weights once). `check_identity` refuses any difference with
`JournalMismatch`, naming the field.

Not here: the database (`journal.py`), the collection loop (`episodes.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dew_lib.records.episodes import Action, EpisodeStatus, Observation
from dew_lib.sampling import Sampling


class JournalMismatch(ValueError):
    """The journal's unfinished collection at these clocks was collected differently."""


@dataclasses.dataclass(frozen=True)
class CollectionIdentity:
    """What makes a collection the same collection: a restored collection must agree on all.

    tasks: the batch's task ids in order. sampling: `Sampling`'s controls (eos ids as a list).
    processes, local_devices: the topology (`jax.process_count()`, `jax.local_device_count()`).
    key: the collection key's data in hex. policy: sha256 of the local shards of the bound
    params (`policy_digest`).
    """

    step: int
    policy_step: int
    tasks: tuple[str, ...]
    groups: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_turns: int
    sampling: Mapping[str, Any]
    processes: int
    local_devices: int
    key: str
    policy: str

    def as_json(self) -> dict:
        """A JSON object of the fields (tuples as lists), the form the journal compares."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


# How a mismatch reads: "recorded step 7 under <this>".
_DIFFERENT = {"tasks": "for different tasks", "groups": "with different groups",
              "max_prompt_tokens": "with a different max_prompt_tokens",
              "max_new_tokens": "with a different max_new_tokens", "max_turns": "with a different max_turns",
              "sampling": "under different sampling", "processes": "on a different topology (processes)",
              "local_devices": "on a different topology (local devices)", "key": "with a different key",
              "policy": "under a different policy"}


def collection_identity(snapshot: Any, key: jax.Array, *, step: int, policy_step: int,
                        tasks: Sequence[str], groups: int, max_prompt_tokens: int, max_new_tokens: int,
                        max_turns: int, sampling: Sampling) -> CollectionIdentity:
    """The identity of a collection of `tasks` under `snapshot` (reads the local weights once)."""
    controls = dict(temperature=float(sampling.temperature), top_k=sampling.top_k,
                    top_p=float(sampling.top_p), min_p=float(sampling.min_p), eos_ids=list(sampling.eos_ids))
    data = np.asarray(jax.random.key_data(key))
    return CollectionIdentity(step=int(step), policy_step=int(policy_step), tasks=tuple(map(str, tasks)),
                              groups=groups, max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                              max_turns=max_turns, sampling=controls, processes=jax.process_count(),
                              local_devices=jax.local_device_count(),
                              key=f"{data.dtype}{list(data.shape)}:{data.tobytes().hex()}",
                              policy=policy_digest(snapshot))


def policy_digest(snapshot: Any) -> str:
    """sha256 over every leaf of `snapshot` in tree order: its path, dtype, shape and the bytes
    of its local shards (each distinct shard once, so replicas on several devices count once)."""
    flat = jax.tree_util.tree_flatten_with_path(snapshot)[0]
    parts = [_local_parts(leaf) for _, leaf in flat]
    host = jax.device_get(parts)  # one transfer for the whole tree
    digest = hashlib.sha256()
    for (path, _), pieces in zip(flat, host, strict=True):
        digest.update(jax.tree_util.keystr(path).encode())
        for piece in pieces:
            piece = np.ascontiguousarray(piece)
            digest.update(f"|{piece.dtype}{piece.shape}|".encode())
            digest.update(piece.tobytes())
    return digest.hexdigest()


def _local_parts(leaf: Any) -> list:
    """The parts of `leaf` this process holds: the whole array when it is fully addressable,
    else each distinct addressable shard in index order."""
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return [leaf]
    unique: dict[tuple[tuple[int, int], ...], Any] = {}
    for shard in leaf.addressable_shards:
        where = tuple((s.start or 0, -1 if s.stop is None else s.stop) for s in shard.index)
        unique.setdefault(where, shard.data)
    return [unique[where] for where in sorted(unique)]


def check_identity(recorded: Mapping[str, Any], identity: CollectionIdentity, *, where: str, path: str) -> None:
    """Refuse to rebuild a collection whose recorded identity (`recorded`, the JSON form) differs
    from `identity`: JournalMismatch naming the first field that differs, and the others."""
    current = identity.as_json()
    differ = [name for name in _DIFFERENT if recorded.get(name) != current[name]]
    if not differ:
        return
    name = differ[0]
    there, here = recorded.get(name), current[name]
    if name == "policy":
        there, here = f"digest {str(there)[:16]}", str(here)[:16]
    also = f"; also differs: {', '.join(differ[1:])}" if differ[1:] else ""
    raise JournalMismatch(
        f"the journal in {where} recorded step {identity.step} (policy_step {identity.policy_step}) "
        f"{_DIFFERENT[name]} ({name}: {there} there, {here} here{also}); a journal resumes only the "
        f"same collection: use a new journal directory per run, or remove {path} to collect this "
        "step afresh")


@dataclasses.dataclass(frozen=True, eq=False)
class PendingDraw:
    """One slot's sampled action of a round, as saved before any tool call of the round."""

    context: np.ndarray
    tokens: np.ndarray
    raw_log_probs: np.ndarray
    behavior_log_probs: np.ndarray
    terminated: bool
    routed_experts: np.ndarray | None = None  # [context + tokens, layers, top_k] when routes are drawn

    def action(self, turn: int, policy_step: int) -> Action:
        """The draw as an `Action` (whose own checks apply to restored draws as to live ones)."""
        return Action(context=self.context, tokens=self.tokens, terminated=self.terminated, step=turn,
                      raw_log_probs=self.raw_log_probs, behavior_log_probs=self.behavior_log_probs,
                      policy_step=policy_step, routed_experts=self.routed_experts)


@dataclasses.dataclass(frozen=True, eq=False)
class CompletedTurn:
    """A tool's committed answer to a draw, and the environment's snapshot after it."""

    observation: Observation
    seconds: float
    snapshot: bytes


@dataclasses.dataclass(frozen=True, eq=False)
class Restored:
    """What the journal held for an unfinished collection (empty for a new one).

    draws: turn -> slot -> PendingDraw. turns: (turn, slot) -> CompletedTurn. where: the
    journal's directory, for errors. shared: in a multi-process job, the rounds every process
    restores (episode_pool.agreed); in those, a process none of whose slots runs draws nothing.
    """

    draws: Mapping[int, Mapping[int, PendingDraw]] = dataclasses.field(default_factory=dict)
    turns: Mapping[tuple[int, int], CompletedTurn] = dataclasses.field(default_factory=dict)
    where: str = ""
    shared: int = 0

    def __bool__(self) -> bool:
        return bool(self.draws)

    def rounds(self) -> int:
        """How many rounds, from round 0 on, have their draws saved."""
        count = 0
        while count in self.draws:
            count += 1
        return count

    def up_to(self, rounds: int) -> Restored:
        """Only the draws and answers of the first `rounds` rounds."""
        return Restored({t: d for t, d in self.draws.items() if t < rounds},
                        {k: v for k, v in self.turns.items() if k[0] < rounds}, self.where, self.shared)

    def runs_on(self) -> bool:
        """Whether a slot may still run after the last saved round: one whose draw ended at EOS
        and whose answer is missing or left its episode running (True when nothing was saved).
        A slot that used its budget ended there, and one without a draw ended before it."""
        last = self.rounds() - 1
        if last < 0:
            return True
        for slot, draw in self.draws[last].items():
            done = self.turns.get((last, slot))
            if draw.terminated and (done is None or done.observation.status is EpisodeStatus.RUNNING):
                return True
        return False

    def snapshots(self) -> dict[int, bytes]:
        """Each slot's snapshot after its last answered turn (slots never answered: absent)."""
        last: dict[int, tuple[int, bytes]] = {}
        for (turn, slot), done in self.turns.items():
            if slot not in last or turn > last[slot][0]:
                last[slot] = (turn, done.snapshot)
        return {slot: snapshot for slot, (_, snapshot) in last.items()}

    def round(self, turn: int, contexts: Mapping[int, np.ndarray]) -> dict[int, PendingDraw] | None:
        """The saved draws of round `turn` (None when it was never drawn), checked against the
        running slots and the contexts they read now (`contexts`: slot -> ids)."""
        draws = self.draws.get(turn)
        if draws is None:
            return {} if not contexts and turn < self.shared else None
        if set(draws) != set(contexts):
            raise JournalMismatch(f"the journal in {self.where} saved round {turn}'s draws for slots "
                                  f"{sorted(draws)}, but slots {sorted(contexts)} are running now; the "
                                  "environment did not answer as it did before the restart (it must be "
                                  "deterministic under the episode identity and its snapshots)")
        for slot, context in contexts.items():
            if not np.array_equal(draws[slot].context, context):
                raise JournalMismatch(f"the journal in {self.where} saved round {turn}'s draw of slot {slot} "
                                      "after a different context than the environment gives now; the "
                                      "environment must answer reset and step the same under the episode "
                                      "identity and its snapshots")
        return dict(draws)


__all__ = ["CollectionIdentity", "CompletedTurn", "JournalMismatch", "PendingDraw", "Restored", "check_identity",
           "collection_identity", "policy_digest"]
