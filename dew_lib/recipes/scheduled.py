"""Asynchronous GRPO's rollout: the RolloutScheduler over a PromptSource on the native server.

`ScheduledRollout` is the Trainer's rollout that `build_grpo` (build.py) returns when
`GRPOOptions.mode == "async"`. It starts a `NativeRolloutServer` on the starting policy (or
draws from a remote engine, `server=`: remote.py), scores
completions with the stage's reward on the source's thread pool as draws finish, and, given the
stage's `dew_lib.store.StageWriter`, records in the run store every SchedulerRecord
(`scheduler_records`) and every session the scheduler settles, with its cause (admitted,
pending, discarded, cancelled, resubmitted, abandoned, cut) and, for code tasks, the verdict of
every program the reward ran (through the `verdicts` callable the caller passes). The prompt of
each task (`prompts`) is written with the first of its sessions, under the same update: the
scheduler's `tasks` function keeps the tasks it built (`prompt_tasks`) until then.

On resume, `reuse_from` reads, before the stage drops what the killed attempt recorded after its
checkpoint, the sessions that attempt (found by the run that recorded the checkpoint) finished
within the staleness bound of the checkpoint's update (`Store.resumable_sessions`, the path
tests/test_rollout_scheduler.py SIGKILLs), and offers them to the scheduler, so they are trained
instead of drawn again. See docs/rl.md, "Resume".

In a multi-process job each process builds its own: a server and a source over its own share of
the prompts, packing `batch / processes` prompts' groups a step; each writes through the `writer`
its process was given (the pipeline gathers them onto process 0: tasks/job_records.py).

Not here: the scheduler and sources themselves (dew_lib.rollouts), the synchronous mode
(build.py), the tool-episode source's setup (episodes.py), Prefect (tasks/train.py calls this).
"""

from __future__ import annotations

import jax

from dew_lib.inference import NativeRolloutServer, Server, ServeTask, serving_mesh
from dew_lib.rollouts import PromptSource, RolloutScheduler, prompt_tasks
from dew_lib.rollouts.sampled import token_text
from dew_lib.train.distributed import every_process

TRUNCATION = "score"  # a completion that used its whole budget is still graded and trained


def _rows_per_process(options) -> int:
    """The rows this process's scheduler packs: its share of the batch's prompts, `groups` each."""
    processes = jax.process_count()
    if options.batch % processes:
        raise ValueError(f"GRPOOptions.batch={options.batch} does not divide across {processes} processes; "
                         "each process's scheduler draws batch / processes prompts a step")
    return options.batch // processes * options.groups


class ScheduledRollout:
    """RolloutScheduler + PromptSource + NativeRolloutServer for one GRPO stage; `close` stops them.

    options: GRPOOptions (options.py; besides the loss and sampling, its async fields: ahead,
    max_lag, sync_every, oversample, max_attempts, timeout, slots, behavior_importance, proximal). reward:
    grades each completion. max_prompt_len: the prompt spec's width. eos_id: the id (or ids)
    that end a completion (None: only the budget). decode: sampled ids -> text (None: token-id
    text). reward_details: the reward's record of its latest call on the calling thread (e.g.
    CodeReward.last_runs).
    writer: the stage's StageWriter (None: nothing recorded). verdicts: program runs -> Verdict rows.
    source: `server -> source` for sessions of another kind, e.g. an EnvironmentSource's tool
    episodes (recipes/episodes.py), in place of a PromptSource grading with `reward`;
    max_prompt_len is then the longest context a turn reads. truncation: what the scheduler does
    with a truncated session, "score" (trained, graded as it is) or "mask" (tool episodes).
    server: `sampling -> RolloutServer` for an engine elsewhere (`remote.remote_server`), in place
    of a NativeRolloutServer on the starting policy.
    """

    def __init__(self, options, model, variables, reward=None, *, max_prompt_len: int, eos_id=None,
                 decode=None, reward_details=None, writer=None, verdicts=None, source=None,
                 truncation=TRUNCATION, server=None):
        prompt, response = max_prompt_len, options.max_new_tokens
        width = prompt + response
        self.objective = options.objective(model, variables, width, lagged=True)
        self.stage, self.verdicts, self.truncation = writer, verdicts, truncation
        self.decode = decode or token_text
        self._unrecorded: dict[str, object] = {}  # task id -> Task whose prompt is not written yet
        sampling = options.sampling(eos_id)
        if server is not None:
            self.server = server(sampling)
        else:
            self.server = NativeRolloutServer(Server.from_task(
                ServeTask(model=model, variables=variables, sampling=sampling),
                slots=options.slots, capacity=width, routing=options.routing_replay != "none",
                mesh=serving_mesh(options.tensor_parallel_size) if options.tensor_parallel_size > 1 else None))
        self.source = None
        try:
            if source is not None:
                self.source = source(self.server)
            else:
                decoded = {} if decode is None else {"decode": decode}
                self.source = PromptSource(self.server, reward, max_new_tokens=response,
                                           workers=max(8, getattr(reward, "workers", 1)),
                                           reward_details=reward_details if writer is not None else None,
                                           **decoded)
            self.scheduler = RolloutScheduler(
                self.objective, self.source, self.server, width=width,
                rows=_rows_per_process(options), groups=options.groups,
                tasks=prompt_tasks if writer is None else self._tasks,
                oversample=options.oversample, max_lag=options.max_lag, ahead=options.ahead,
                sync_every=options.sync_every, max_attempts=options.max_attempts,
                timeout=options.timeout, estimator=options.advantage_estimator, truncation=truncation,
                proximal=options.proximal,
                log=None if writer is None else writer.record,
                session_log=None if writer is None else self._record)
        except BaseException:
            if self.source is not None:
                self.source.close()
            self.server.close()
            raise

    def _tasks(self, batch):
        """prompt_tasks, keeping each task whose prompt the stage has not recorded yet."""
        tasks = prompt_tasks(batch)
        for task in tasks:
            if not self.stage.has_prompt(task.id):
                self._unrecorded.setdefault(task.id, task)
        return tasks

    def _record(self, log) -> None:
        details = getattr(self.source, "pop_details", lambda session: None)
        runs = [details(s) for s in log.sessions]
        verdicts = self.verdicts
        named = dict.fromkeys(s.task for s in log.sessions)
        tasks = [self._unrecorded.pop(t) for t in named if t in self._unrecorded]
        if tasks:
            self.stage.prompts(tasks, update=log.update, decode=self.decode)
        episodes = getattr(self.source, "pop_episode", None)  # an EnvironmentSource's, when it keeps them
        self.stage.sessions(log.sessions, update=log.update, latencies=log.latencies,
                            causes=log.causes, trained=log.trained, truncation=self.truncation,
                            verdicts=[verdicts(r or ()) for r in runs] if any(runs) and verdicts else None,
                            episodes=None if episodes is None else [episodes(s) for s in log.sessions])

    def dataset(self, dataset):
        """The stage's prompts, registered with the scheduler as the trainer reads them."""
        return self.scheduler.tasks(dataset)

    def __call__(self, state, batch, key):
        return self.scheduler(state, batch, key)

    def reuse_from(self, store, run: str, stage: str, resumed: int, checkpoint: str) -> tuple[str, int]:
        """Offer the sessions an earlier attempt of this stage finished within the staleness
        bound of update `resumed` (the checkpoint's; the stage trains without accumulation, so
        steps are updates). store: the run store (`dew_lib.store.Store`). checkpoint: the path the
        stage resumes from; the run that recorded it wrote those sessions (this run on a Prefect
        retry, an earlier flow run of the same pipeline name when a killed process is run
        again). Returns (that run, samples offered).

        In a multi-process job every process calls it: process 0 reads the store (the others
        pass store=None) and hands what it read to every process, whose scheduler takes only
        the sessions of its own task rows.
        """
        read = None
        if store is not None:
            _, found = store.rows("SELECT run FROM checkpoints WHERE stage = ? AND step = ? AND path = ? "
                                  "ORDER BY written_at DESC LIMIT 1", [stage, int(resumed), checkpoint])
            earlier = found[0][0] if found else run
            read = earlier, store.resumable_sessions(earlier, stage, updates=resumed, max_lag=self.scheduler.max_lag)
        earlier, sessions = every_process(read)[0]
        return earlier, self.scheduler.reuse(sessions)

    def close(self) -> None:
        try:
            self.scheduler.close()
        finally:
            self.source.close()
            self.server.close()
