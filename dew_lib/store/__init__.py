"""The run store: every run, stage, rollout session (and its task's prompt), scheduler record,
metric, evaluation and checkpoint of a project, as Parquet parts that DuckDB reads while runs are
still writing.

    store = Store("runs")
    with store.writer("run-1") as run:
        run.start(params={...})
        with run.stage("grpo", kind="grpo") as stage:
            trainer.fit(..., sinks=[stage.sink()])       # metrics and checkpoints
            stage.prompts(tasks, update=step)             # what each task asked, once per task
            stage.sessions(sessions, update=step)         # rollouts, with their calls
    store.sql("SELECT update, avg(reward) FROM sessions GROUP BY update")

`dew sql` and `dew runs` (dew_lib/cli.py) query it from a shell; `runs/dew.duckdb` opens in the
duckdb client. Not here: Prefect (tasks and flows call these writers).
"""

from dew_lib.records.scheduler import CAUSES
from dew_lib.store.parts import StoreBusy, StoreError
from dew_lib.store.prompts import Prompt
from dew_lib.store.rows import Evaluation, Verdict, session_uid
from dew_lib.store.schema import TABLES
from dew_lib.store.store import NotAQuery, Store, StoreDamaged, StoredSession, StoreNotFound
from dew_lib.store.writer import RunWriter, StageWriter, StoreSink

__all__ = ["CAUSES", "Evaluation", "NotAQuery", "Prompt", "RunWriter", "StageWriter", "Store", "StoreBusy",
           "StoreDamaged", "StoreError", "StoreNotFound", "StoreSink", "StoredSession", "TABLES", "Verdict",
           "session_uid"]
