"""EpisodeJournal: what a lock-step collection sampled and what its tools answered, kept on disk
so that a killed training process resumes the collection instead of sampling it again.

    rollout = EpisodeRollout(policy, environment, verifier, ..., journal=EpisodeJournal("run/episodes"))

One SQLite database per rank (`rank-<i>.sqlite`, i = `jax.process_index()`), in WAL mode with
`synchronous=FULL`, so every commit is on disk before the call returns. A collection (one
`EpisodeRollout.collect`) is known by its clocks, the attempted `step` and the committed
`policy_step`, and the journal keeps, in this order:

- the collection's identity (`CollectionIdentity`): tasks, budgets, sampling, topology, clocks,
  key, and a digest of the local policy shards;
- each round's draws for every running slot, committed before any tool call of that round;
- each turn a tool answered: its observation, latency and the environment's `get_state()`
  snapshot, committed before that slot's next tool call and before any training update;
- the rewards, and that the collection finished.

When `collect` starts and the journal holds an unfinished collection with the same clocks, every
identity field must match (else `JournalMismatch`, naming the field); the collection is then
rebuilt from the records (`Restored`): answered turns come back as they were, each slot's
environment is reset and given its last snapshot (`set_state`), and a round whose draws were
saved reuses them instead of sampling. Tool calls whose answer was not committed run again: an
effect between a saved draw and its answer's commit can happen twice, so environments key
outside effects by the episode identity and the action. Rounds after that sample with the
round's own key, so they draw what the uninterrupted run would have drawn. A finished
collection is never rebuilt: a later collection with the same clocks starts over. In a job of
several processes each keeps its own rank's journal, and a restarted collection keeps only the
rounds every rank saved (`CollectionLog.keep_rounds`, through episode_pool.agreed): one process
killed between two commits leaves the others ahead, and the cohort draws every round together.

Answers that several slots commit at once share one transaction (a group commit: each caller
still returns only once its own row is synced), so a cohort pays about one sync per wave of
answers, not one per slot.

Not here: the identity and the restored values (`journal_records.py`), the collection loop
(`episodes.py`), the run store (the `record` callback's business),
resuming in the middle of a tool call, exactly-once outside effects.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from dew_lib.options import integer
from dew_lib.records.episodes import EpisodeStatus, Observation, Transition
from dew_lib.rollouts.journal_records import (
    CollectionIdentity,
    CompletedTurn,
    JournalMismatch,
    PendingDraw,
    Restored,
    check_identity,
    collection_identity,
    policy_digest,
)

SCHEMA_VERSION = 2  # 2: draws.routed_experts
SCHEMA = """
CREATE TABLE IF NOT EXISTS collections (
    id INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,           -- the attempted-work clock
    policy_step INTEGER NOT NULL,    -- the committed-update clock
    identity TEXT NOT NULL,          -- CollectionIdentity as a JSON object
    finished INTEGER NOT NULL DEFAULT 0,
    rewards TEXT,                    -- JSON list, one per slot in task-then-sample order (null: unscored)
    opened REAL NOT NULL,            -- unix seconds
    closed REAL
);
CREATE INDEX IF NOT EXISTS collections_by_clock ON collections (step, policy_step);
CREATE TABLE IF NOT EXISTS draws (   -- a round's sampled actions, saved before its tool calls
    collection INTEGER NOT NULL REFERENCES collections (id),
    turn INTEGER NOT NULL,
    slot INTEGER NOT NULL,           -- task * groups + sample
    context BLOB NOT NULL,           -- int32 ids the action read
    tokens BLOB NOT NULL,            -- int32 sampled ids, EOS included
    raw_log_probs BLOB NOT NULL,     -- float32, one per sampled id
    behavior_log_probs BLOB NOT NULL,
    terminated INTEGER NOT NULL,     -- EOS ended it (else the budget did: never sent to a tool)
    routed_experts BLOB,             -- .npy int [context + tokens, layers, top_k] when routes are drawn
    PRIMARY KEY (collection, turn, slot)
);
CREATE TABLE IF NOT EXISTS turns (   -- a tool's answer to a draw, with the state it left
    collection INTEGER NOT NULL REFERENCES collections (id),
    turn INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    context BLOB NOT NULL,           -- int32 ids of the observation
    status TEXT NOT NULL,            -- running, completed or truncated
    detail TEXT NOT NULL,
    seconds REAL NOT NULL,           -- how long the tool took
    snapshot BLOB NOT NULL,          -- environment.get_state() after the answer
    PRIMARY KEY (collection, turn, slot)
);
"""


class JournalBusy(RuntimeError):
    """Another EpisodeJournal (in this process or another) holds this rank's journal."""


class CollectionLog:
    """One collection's records in an `EpisodeJournal`; `EpisodeRollout.collect` writes it."""

    journaled = True

    def __init__(self, journal: EpisodeJournal, collection: int, restored: Restored):
        self.journal, self.collection, self._restored = journal, collection, restored

    def restored(self) -> Restored:
        """The collection's records when it was opened (empty for a new collection)."""
        return self._restored

    def pending(self, turn: int, draws: Mapping[int, PendingDraw]) -> None:
        """Save round `turn`'s draws (slot -> draw) in one commit, before any of its tool calls."""
        rows = [(self.collection, turn, slot, _ids(d.context), _ids(d.tokens), _floats(d.raw_log_probs),
                 _floats(d.behavior_log_probs), int(bool(d.terminated)), _array(d.routed_experts))
                for slot, d in sorted(draws.items())]
        self.journal._commits.write("INSERT INTO draws VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def completed(self, slot: int, transition: Transition, snapshot: bytes) -> None:
        """Commit a tool's answer to slot `slot`'s draw and the environment's state after it."""
        observation = transition.observation
        if not isinstance(snapshot, (bytes, bytearray)):
            raise TypeError(f"get_state() returned {type(snapshot).__name__}; the journal keeps bytes")
        row = (self.collection, transition.action.step, slot, _ids(observation.context),
               observation.status.value, observation.detail, float(transition.seconds), bytes(snapshot))
        self.journal._commits.write("INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [row])

    def keep_rounds(self, rounds: int) -> Restored:
        """Forget every round from `rounds` on (its draws and answers, here and on disk), so it is
        drawn and answered again; what stays restored. A multi-process job keeps the rounds
        every process saved (episode_pool.agreed)."""
        with self.journal._transaction() as db:
            db.execute("DELETE FROM draws WHERE collection = ? AND turn >= ?", (self.collection, rounds))
            db.execute("DELETE FROM turns WHERE collection = ? AND turn >= ?", (self.collection, rounds))
        self._restored = self._restored.up_to(rounds)
        return self._restored

    def finished(self, rewards: Sequence[float | None]) -> None:
        """Record the rewards and that the collection finished: it is never rebuilt again."""
        with self.journal._transaction() as db:
            db.execute("UPDATE collections SET finished = 1, rewards = ?, closed = ? WHERE id = ?",
                       (json.dumps([None if r is None else float(r) for r in rewards]), time.time(),
                        self.collection))


class Unjournaled:
    """The log of a collection without a journal: records nothing, restores nothing."""

    journaled = False

    def restored(self) -> Restored:
        return Restored()

    def pending(self, turn: int, draws: Mapping[int, PendingDraw]) -> None:
        pass

    def completed(self, slot: int, transition: Transition, snapshot: bytes) -> None:
        pass

    def keep_rounds(self, rounds: int) -> Restored:
        return Restored()

    def finished(self, rewards: Sequence[float | None]) -> None:
        pass


class EpisodeJournal:
    """This rank's journal in `directory` (module docstring); one writer at a time.

    rank: which rank's file (default `jax.process_index()`; create the journal after
    `jax.distributed.initialize` in a multi-process run). Opening refuses a journal another
    `EpisodeJournal` holds, in this process or another (`JournalBusy`); `close()` (or leaving a
    `with` block) lets it go, and so does the process's death.
    """

    def __init__(self, directory: str | os.PathLike, *, rank: int | None = None):
        self.directory = os.path.abspath(os.fspath(directory))
        self.rank = jax.process_index() if rank is None else integer("EpisodeJournal.rank", rank, at_least=0)
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, f"rank-{self.rank}.sqlite")
        self._lock = _hold(self.path + ".lock", self)
        self._mutex = threading.Lock()  # one connection, shared by the rollout's worker threads
        self._commits = _GroupCommit(self)
        try:
            self._db = _connect(self.path)
        except BaseException:
            os.close(self._lock)
            raise

    def open_collection(self, identity: CollectionIdentity) -> CollectionLog:
        """The log of the collection at `identity`'s clocks: the unfinished one the journal holds
        (after checking every identity field), else a new one."""
        with self._mutex:
            row = self._db.execute("SELECT id, identity, finished FROM collections WHERE step = ? AND "
                                   "policy_step = ? ORDER BY id DESC LIMIT 1",
                                   (identity.step, identity.policy_step)).fetchone()
        if row is not None and not row[2]:
            check_identity(json.loads(row[1]), identity, where=self.directory, path=self.path)
            return CollectionLog(self, row[0], self._restore(row[0]))
        with self._transaction() as db:
            finished = "SELECT id FROM collections WHERE finished = 1"  # never rebuilt: their turns go
            db.execute(f"DELETE FROM draws WHERE collection IN ({finished})")
            db.execute(f"DELETE FROM turns WHERE collection IN ({finished})")
            cursor = db.execute("INSERT INTO collections (step, policy_step, identity, opened) VALUES (?, ?, ?, ?)",
                                (identity.step, identity.policy_step, json.dumps(identity.as_json()), time.time()))
            return CollectionLog(self, cursor.lastrowid, Restored(where=self.directory))

    def collections(self) -> list[dict]:
        """Every collection the journal knows, oldest first: id, step, policy_step, finished,
        rewards, draws and turns (how many rows it still holds)."""
        with self._mutex:
            rows = self._db.execute(
                "SELECT c.id, c.step, c.policy_step, c.finished, c.rewards, "
                "(SELECT count(*) FROM draws d WHERE d.collection = c.id), "
                "(SELECT count(*) FROM turns t WHERE t.collection = c.id) FROM collections c ORDER BY c.id").fetchall()
        names = ("id", "step", "policy_step", "finished", "rewards", "draws", "turns")
        return [dict(zip(names, (*row[:3], bool(row[3]), row[4] and json.loads(row[4]), *row[5:]), strict=True))
                for row in rows]

    def close(self) -> None:
        """Close the database and let the journal go (another EpisodeJournal may open it)."""
        with self._mutex:
            if self._lock < 0:
                return
            self._db.close()
            os.close(self._lock)
            self._lock = -1

    def __enter__(self) -> EpisodeJournal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EpisodeJournal({self.directory!r}, rank={self.rank})"

    # ----- inside -------------------------------------------------------------------------------
    def _restore(self, collection: int) -> Restored:
        with self._mutex:
            draws = self._db.execute("SELECT turn, slot, context, tokens, raw_log_probs, behavior_log_probs, "
                                     "terminated, routed_experts FROM draws WHERE collection = ?",
                                     (collection,)).fetchall()
            turns = self._db.execute("SELECT turn, slot, context, status, detail, seconds, snapshot FROM turns "
                                     "WHERE collection = ?", (collection,)).fetchall()
        rounds: dict[int, dict[int, PendingDraw]] = {}
        for turn, slot, context, tokens, raw, behavior, terminated, routed in draws:
            rounds.setdefault(turn, {})[slot] = PendingDraw(
                np.frombuffer(context, "<i4"), np.frombuffer(tokens, "<i4"), np.frombuffer(raw, "<f4"),
                np.frombuffer(behavior, "<f4"), bool(terminated),
                None if routed is None else np.load(io.BytesIO(routed), allow_pickle=False))
        answered = {(turn, slot): CompletedTurn(Observation(np.frombuffer(context, "<i4"), EpisodeStatus(status),
                                                            detail), seconds, bytes(snapshot))
                    for turn, slot, context, status, detail, seconds, snapshot in turns}
        return Restored(rounds, answered, self.directory)

    def _transaction(self):
        return _Transaction(self)


class _Transaction:
    """`with journal._transaction() as db:` one committed (fsynced) transaction, serialized."""

    def __init__(self, journal: EpisodeJournal):
        self.journal = journal

    def __enter__(self) -> sqlite3.Connection:
        self.journal._mutex.acquire()
        if self.journal._lock < 0:
            self.journal._mutex.release()
            raise RuntimeError(f"the episode journal in {self.journal.directory} is closed")
        self.journal._db.execute("BEGIN IMMEDIATE")
        return self.journal._db

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.journal._db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            self.journal._mutex.release()


class _GroupCommit:
    """Rows from concurrent threads, committed together. `write` returns once a transaction
    holding its rows has committed; a thread that finds no commit under way commits everything
    queued so far, one that finds one waits and joins the next. A lone writer commits at once."""

    def __init__(self, journal: EpisodeJournal):
        self.journal = journal
        self.condition = threading.Condition()
        self.queue: list[tuple[str, list[tuple]]] = []
        self.filling = 0  # the batch that rows written now belong to
        self.committed = -1  # the last batch done (committed or failed)
        self.busy = False
        self.failures: dict[int, BaseException] = {}

    def write(self, sql: str, rows: list[tuple]) -> None:
        with self.condition:
            self.queue.append((sql, rows))
            ticket = self.filling
            while self.busy and self.committed < ticket:
                self.condition.wait()
            batch = None
            if self.committed < ticket:  # no commit under way and this batch not done: commit it
                batch, self.queue, self.busy = self.queue, [], True
                self.filling += 1
        if batch is not None:
            self._commit(ticket, batch)
        failure = self.failures.get(ticket)
        if failure is not None:
            raise OSError(f"the episode journal in {self.journal.directory} could not commit: "
                          f"{type(failure).__name__}: {failure}") from failure

    def _commit(self, ticket: int, batch: list[tuple[str, list[tuple]]]) -> None:
        try:
            with self.journal._transaction() as db:
                for sql, rows in batch:
                    db.executemany(sql, rows)
        except BaseException as error:  # every writer of the batch raises it
            self.failures[ticket] = error
        finally:
            with self.condition:
                self.busy, self.committed = False, ticket
                self.condition.notify_all()


def _hold(path: str, journal: EpisodeJournal) -> int:
    """An exclusive flock on `path` (the kernel drops it with the process), or JournalBusy."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise JournalBusy(f"the episode journal in {journal.directory} (rank {journal.rank}) is held by "
                          "another EpisodeJournal, in this process or another; a journal has one writer: "
                          "close the other, or give this run its own directory") from None
    return fd


def _connect(path: str) -> sqlite3.Connection:
    """The journal database: WAL, every commit synced (FULL), the schema of this version."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    try:
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise OSError(f"SQLite could not put the episode journal {path} in WAL mode (it is in "
                          f"{mode!r} mode); put the journal on a local filesystem")
        db.execute("PRAGMA synchronous=FULL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, 1, SCHEMA_VERSION):
            raise ValueError(f"the episode journal {path} has schema version {version}; this Dew reads "
                             f"versions 1 and {SCHEMA_VERSION}: use a new journal directory")
        upgrade = "ALTER TABLE draws ADD COLUMN routed_experts BLOB;" if version == 1 else ""
        db.executescript(f"BEGIN; {SCHEMA} {upgrade} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
    except BaseException:
        db.close()
        raise
    return db


def _ids(values: np.ndarray) -> bytes:
    return np.asarray(values).astype("<i4").tobytes()


def _floats(values: np.ndarray) -> bytes:
    return np.asarray(values).astype("<f4").tobytes()


def _array(values: np.ndarray | None) -> bytes | None:
    """`values` as .npy bytes (shape and dtype kept), or None."""
    if values is None:
        return None
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(values), allow_pickle=False)
    return buffer.getvalue()


__all__ = ["CollectionIdentity", "CollectionLog", "CompletedTurn", "EpisodeJournal", "JournalBusy",
           "JournalMismatch", "PendingDraw", "Restored", "SCHEMA", "Unjournaled", "collection_identity",
           "policy_digest"]  # the values are journal_records.py's, here for one import
