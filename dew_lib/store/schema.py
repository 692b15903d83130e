"""The run store's tables: their columns, their key and the DuckDB views over their parts.

Every table is a set of Parquet parts under `store/<table>/<run>/<stream>/`, all written with the
exact Arrow schema below, so a view is one `read_parquet` over the generations a snapshot names
(snapshot.py). Tables whose rows belong
to a training step name that column as their `key`: a writer replaces everything an earlier
attempt wrote under the same key, which is what makes a retried task idempotent. `runs` and
`stages` hold one row per run and per stage, replaced whole when their status changes. A table
with `unique` columns (`prompts`) may hold a row more than once across writer lifetimes; its
view keeps the first by key.

Adding a table is not a format change: a store that lacks it gets its (empty) view when a
snapshot is next published. Changing a table's columns is one (bump FORMAT).

Not here: writing (writer.py), the on-disk layout of parts (parts.py), queries (store.py).
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

FORMAT = 2  # bump when a table's columns change; readers refuse a store of another format

_ts = pa.timestamp("us", tz="UTC")
_floats = pa.map_(pa.string(), pa.float64())
_counts = pa.map_(pa.string(), pa.int64())


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    key: str | None  # the step column a retry replaces by; None: one row per stream, replaced whole
    columns: tuple[tuple[str, pa.DataType, str], ...]
    about: str
    unique: tuple[str, ...] = ()  # the view keeps one row per these columns: the first by key

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(name, kind) for name, kind, _ in self.columns])


_IDENTITY = (
    ("run", pa.string(), "run id"),
    ("stage", pa.string(), "stage name within the run"),
)
_SESSION = (
    ("update", pa.int64(), "trainer update (step) the session was recorded at"),
    ("task", pa.string(), "task id"),
    ("group_id", pa.int32(), "GRPO group of the session (Session.group)"),
    ("sample", pa.int32(), "sample within the group"),
    ("attempt", pa.int32(), "resubmission count of the sample"),
)

TABLES: dict[str, Table] = {t.name: t for t in (
    Table("runs", None, _IDENTITY[:1] + (
        ("status", pa.string(), "running, completed or failed (dew runs shows a running run whose writer is gone as "
                                "interrupted)"),
        ("attempts", pa.int32(), "how many times the run was started"),
        ("params", pa.string(), "the run's parameters as JSON"),
        ("code_version", pa.string(), "version of the code that ran it (git commit when known)"),
        ("host", pa.string(), "machine that last wrote it"),
        ("pid", pa.int64(), "process that last wrote it"),
        ("started_at", _ts, "first start"),
        ("finished_at", _ts, "end of the last attempt; null while running"),
        ("error", pa.string(), "why it failed"),
        ("updated_at", _ts, "when this row was written"),
    ), "one row per run"),
    Table("stages", None, _IDENTITY + (
        ("kind", pa.string(), "sft, dpo, grpo, evaluate, ..."),
        ("status", pa.string(), "running, completed or failed"),
        ("attempt", pa.int32(), "1 for the first attempt, counting up on every retry"),
        ("params", pa.string(), "the stage's parameters as JSON"),
        ("code_version", pa.string(), "version of the code that ran it"),
        ("metrics", _floats, "headline metrics recorded when the stage finished"),
        ("started_at", _ts, "start of the current attempt"),
        ("finished_at", _ts, "end of the current attempt; null while running"),
        ("error", pa.string(), "why it failed"),
        ("updated_at", _ts, "when this row was written"),
    ), "one row per stage of a run"),
    Table("sessions", "update", _IDENTITY + _SESSION + (
        ("session_uid", pa.int64(), "hash of run, stage, update, task, group_id, sample, attempt, trained: joins "
                                    "calls and verdicts"),
        ("status", pa.string(), "completed, truncated, agent_error, infra_error or cancelled"),
        ("reward", pa.float64(), "verifier reward; null when it never ran"),
        ("components", _floats, "reward broken down by name"),
        ("detail", pa.string(), "source's note on how the session ended"),
        ("trained", pa.bool_(), "whether the update trained on it"),
        ("cause", pa.string(), "why it was or was not trained: pending, admitted, discarded, cancelled, resubmitted, "
                               "abandoned, cut (null: not stated)"),
        ("latency", pa.float64(), "seconds from submission to finish"),
        ("num_calls", pa.int32(), "engine calls in the session"),
        ("prompt_tokens", pa.int32(), "prompt ids of its first call"),
        ("sampled_tokens", pa.int32(), "sampled ids over all its calls"),
        ("min_version", pa.int64(), "oldest policy version among its calls"),
        ("max_version", pa.int64(), "newest policy version among its calls"),
        ("finish_reason", pa.string(), "its last call's finish reason"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per recorded rollout session"),
    Table("calls", "update", _IDENTITY + _SESSION + (
        ("session_uid", pa.int64(), "the session's sessions.session_uid"),
        ("call", pa.int32(), "index of the call within its session"),
        ("version", pa.int64(), "policy version served when the call was submitted"),
        ("finish_reason", pa.string(), "stop, length or abort"),
        ("prompt_tokens", pa.int32(), "length of prompt_ids"),
        ("sampled_tokens", pa.int32(), "length of sampled_ids"),
        ("prompt_ids", pa.list_(pa.int32()), "every id the engine read"),
        ("sampled_ids", pa.list_(pa.int32()), "the ids it drew, EOS included on a natural stop"),
        ("behavior_log_probs", pa.list_(pa.float32()), "engine log-probability of each sampled id"),
        ("raw_log_probs", pa.list_(pa.float32()), "raw policy log-probabilities, when recorded"),
        ("routed_experts", pa.list_(pa.int32()), "expert ids, flattened from [ids, layers, top_k], when recorded"),
        ("routed_shape", pa.list_(pa.int32()), "[layers, top_k] of routed_experts"),
        ("routed_dtype", pa.string(), "the engine's dtype of routed_experts"),
        ("support", pa.list_(pa.list_(pa.int32())), "ids the sampler kept for each sampled id, when recorded"),
    ), "one row per engine call of a recorded session"),
    Table("prompts", "update", _IDENTITY + (
        ("update", pa.int64(), "first update whose sessions the writer recorded with the task (a retry replaces by "
                               "it)"),
        ("task", pa.string(), "task id: sessions.task"),
        ("prompt", pa.string(), "the prompt as text: decoded by the stage's decode (token ids separated by spaces "
                                "without one); null when not given"),
        ("prompt_ids", pa.list_(pa.int32()), "its token ids, without padding; null when not given"),
        ("prompt_tokens", pa.int32(), "length of prompt_ids"),
        ("data_source", pa.string(), "the reward's data_source field"),
        ("ground_truth", pa.string(), "the reward's ground truth"),
        ("extra_info", pa.string(), "the reward's extra_info (JSON text)"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per task of a stage: the prompt its sessions answered", unique=("run", "stage", "task")),
    Table("turns", "update", _IDENTITY + _SESSION + (
        ("session_uid", pa.int64(), "the episode's sessions.session_uid"),
        ("turn", pa.int32(), "the action's turn in its episode, from 0"),
        ("context_tokens", pa.int32(), "ids of the context the action was sampled from"),
        ("action_ids", pa.list_(pa.int32()), "the ids the policy sampled, EOS included when EOS ended it"),
        ("terminated", pa.bool_(), "whether EOS ended the action (else it used its whole budget)"),
        ("status", pa.string(), "the environment's answer: running, completed, truncated, cancelled or error; null "
                                "when the action was not sent to it"),
        ("detail", pa.string(), "what the environment said about it (a tool's result summary, an error)"),
        ("seconds", pa.float64(), "how long the environment took to answer (tool latency); null when not sent"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per action of a recorded tool episode"),
    Table("verdicts", "update", _IDENTITY + (
        ("update", pa.int64(), "the session's update, or the evaluated answer's step"),
        ("task", pa.string(), "the session's or evaluated answer's task id"),
        ("group_id", pa.int32(), "the session's group, or the evaluated answer's item"),
        ("sample", pa.int32(), "sample within the group (0 for an evaluated answer)"),
        ("attempt", pa.int32(), "resubmission count of the sample (0 for an evaluated answer)"),
        ("session_uid", pa.int64(), "the session's sessions.session_uid"),
        ("program", pa.int32(), "index of the program among the session's verdicts"),
        ("name", pa.string(), "the program's or test's name"),
        ("status", pa.string(), "how the program ended: completed, failed, timeout, crashed, output_limit"),
        ("passed", pa.bool_(), "whether it passed"),
        ("score", pa.float64(), "its score, when it gives one"),
        ("seconds", pa.float64(), "wall time it ran"),
        ("exit_code", pa.int32(), "its exit status, when it ran to one"),
        ("detail", pa.string(), "output tail or error"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per program a code reward ran for a session or an evaluated answer"),
    Table("scheduler_records", "updates", _IDENTITY + (
        ("updates", pa.int64(), "optimizer updates when the trainer call ran"),
        ("version", pa.int64(), "oldest admitted call's policy version"),
        ("lag", pa.int64(), "updates minus that version"),
        ("groups", pa.int64(), "admitted groups"),
        ("resubmitted", _counts, "resubmissions by cause"),
        ("cancelled", pa.int64(), "in-flight rollouts cancelled"),
        ("abandoned", pa.int64(), "groups given up after max_attempts"),
        ("cut", pa.int64(), "complete groups left out for lack of rows"),
        ("waited", pa.float64(), "seconds the trainer waited"),
        ("metrics", _floats, "session_metrics over the admitted rollouts"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per trainer call of the rollout scheduler"),
    Table("metrics", "step", _IDENTITY + (
        ("step", pa.int64(), "trainer step the metric was logged at"),
        ("name", pa.string(), "metric name (loss, accuracy, val/loss, reward/mean, ...)"),
        ("value", pa.float64(), "its value"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per metric per logged training step"),
    Table("evaluations", "step", _IDENTITY + (
        ("step", pa.int64(), "trainer step of the evaluated policy"),
        ("split", pa.string(), "which prompts (e.g. test)"),
        ("item", pa.int32(), "index of the prompt in the split"),
        ("task", pa.string(), "task id"),
        ("prompt", pa.string(), "the prompt as text"),
        ("answer", pa.string(), "the policy's answer"),
        ("reference", pa.string(), "the expected answer"),
        ("score", pa.float64(), "the reward's score"),
        ("correct", pa.bool_(), "whether the answer counts as correct"),
        ("components", _floats, "score broken down by name"),
        ("detail", pa.string(), "grader's note"),
        ("temperature", pa.float64(), "0: the greedy answer; else the temperature it was drawn at"),
        ("sample", pa.int32(), "0: the greedy answer; 1..k: the answers drawn at temperature"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per evaluated answer"),
    Table("samples", "update", _IDENTITY + (
        ("update", pa.int64(), "trainer updates before the rollout that drew the sample"),
        ("row", pa.int32(), "index of the sample in its rollout"),
        ("group_id", pa.int32(), "its group: the source row it was drawn for"),
        ("sample", pa.int32(), "index of the sample within its group"),
        ("reward", pa.float64(), "the reward's score"),
        ("group_mean", pa.float64(), "mean reward of its group"),
        ("group_std", pa.float64(), "population standard deviation of its group's rewards"),
        ("advantage", pa.float32(), "group-relative advantage the update trained with"),
        ("kept", pa.bool_(), "whether its transitions entered the loss (advantage != 0)"),
        ("caption", pa.string(), "the decoded condition (empty when unconditioned)"),
        ("image", pa.binary(), "the sample as an 8-bit PNG, when recorded"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per image sample of a Flow-GRPO rollout"),
    Table("checkpoints", "step", _IDENTITY + (
        ("step", pa.int64(), "trainer step saved"),
        ("path", pa.string(), "where it is"),
        ("kind", pa.string(), "checkpoint (trainer state) or policy (exported weights)"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per saved checkpoint or exported policy"),
    Table("trackers", "step", _IDENTITY + (
        ("step", pa.int64(), "trainer step the stage's attempt started from (0, or the checkpoint it resumed)"),
        ("tracker", pa.string(), "tensorboard, mlflow or wandb"),
        ("tracker_run", pa.string(), "the tracker's id of the stage's run: the MLflow or W&B run id; for "
                                     "TensorBoard its directory under the log directory (<run>/<stage>)"),
        ("parent_run", pa.string(), "mlflow: the run id of the pipeline's run the stage's run is nested under"),
        ("name", pa.string(), "the run's name in the tracker: <run>/<stage>"),
        ("location", pa.string(), "the TensorBoard log directory, the MLflow tracking URI or the W&B run directory"),
        ("written_at", _ts, "when the row was written"),
    ), "one row per tracker run of a stage's attempt (dew_lib/train/trackers.py)"),
)}

RUN_STATUSES = ("running", "completed", "failed")


def glob(root: str, table: str) -> str:
    """Every part of every run and stream of `table` under `root` (what the `runs` and `stages`
    views read: their files are replaced by rename, never removed)."""
    return f"{root}/{table}/*/*/*.parquet"


def placeholder(root: str, table: str) -> str:
    """A zero-row part that keeps the `runs` and `stages` globs bindable before the first run.
    (Older Dews kept one per table; writers remove those once the table has parts.)"""
    return f"{root}/{table}/_/_/schema.parquet"


def schema_file(root: str, table: str) -> str:
    """A zero-row part with the table's exact schema, named first in every view's file list so
    that DuckDB binds the view from it and never opens a part to publish a snapshot (a damaged
    part then fails only the scans that read it)."""
    return f"{root}/.gens/_schema/{table}.parquet"


def empty(table: str) -> pa.Table:
    schema = TABLES[table].schema
    return pa.Table.from_arrays([pa.array([], f.type) for f in schema], schema=schema)
