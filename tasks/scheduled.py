"""The grpo flow's asynchronous mode: the RolloutScheduler over a PromptSource on the native server.

`ScheduledRollout` is the Trainer's rollout when `GRPOParams.mode == "async"`. It starts a
`NativeRolloutServer` on the starting policy, scores completions with the stage's TaskReward on
the source's thread pool as draws finish, and records in the run store every SchedulerRecord
(`scheduler_records`) and every session the scheduler settles, with its cause (admitted,
pending, discarded, cancelled, resubmitted, abandoned, cut) and, for code tasks, the verdict of
every program the reward ran.

On resume, `reuse_from` reads, before the stage drops what the killed attempt recorded after its
checkpoint, the sessions that attempt (found by the run that recorded the checkpoint) finished
within the staleness bound of the checkpoint's update (`Store.resumable_sessions`, the path tests/test_rollout_scheduler.py SIGKILLs), and
offers them to the scheduler, so they are trained instead of drawn again. See docs/rl.md, "Resume".

Not here: the scheduler and sources themselves (dew_lib.rollouts), the synchronous mode
(tasks/train.py), multi-turn environments in the pipeline.
"""

from __future__ import annotations

from dew_lib.inference import NativeRolloutServer, Server, ServeTask
from dew_lib.objectives import GRPOObjective
from dew_lib.rollouts import PromptSource, RolloutScheduler, prompt_tasks
from dew_lib.sampling import Sampling
from tasks.rewards import verdicts

TRUNCATION = "score"  # a completion that used its whole budget is still graded and trained


class ScheduledRollout:
    """RolloutScheduler + PromptSource + NativeRolloutServer for one GRPO stage; `close` stops them.

    params: GRPOParams (mode, ahead, max_lag, sync_every, oversample, max_attempts, timeout,
    slots, behavior_importance). reward: the stage's TaskReward. decode: sampled ids -> text.
    stage_writer: the stage's run-store writer.
    """

    def __init__(self, params, model, tokenizer, variables, reward, decode, stage_writer):
        prompt, response = params.max_prompt_len, params.max_new_tokens
        width = prompt + response
        self.objective = GRPOObjective(model, width - 1, beta=params.beta, pretrained=variables,
                                       sampling_temperature=params.temperature,
                                       behavior_importance=params.behavior_importance)
        self.stage = stage_writer
        sampling = Sampling(temperature=params.temperature, eos_id=tokenizer.eos_token_id)
        self.server = NativeRolloutServer(Server.from_task(
            ServeTask(model=model, variables=variables, sampling=sampling),
            slots=params.slots, capacity=width))
        self.source = None
        try:
            self.source = PromptSource(self.server, reward, max_new_tokens=response, decode=decode,
                                       workers=max(8, getattr(reward, "workers", 1)),
                                       reward_details=getattr(reward, "last_runs", None))
            self.scheduler = RolloutScheduler(
                self.objective, self.source, self.server, width=width,
                rows=params.batch * params.groups, tasks=prompt_tasks, groups=params.groups,
                oversample=params.oversample, max_lag=params.max_lag, ahead=params.ahead,
                sync_every=params.sync_every, max_attempts=params.max_attempts,
                timeout=params.timeout, truncation=TRUNCATION, log=stage_writer.record,
                session_log=self._record)
        except BaseException:
            if self.source is not None:
                self.source.close()
            self.server.close()
            raise

    def _record(self, log) -> None:
        runs = [self.source.pop_details(s) for s in log.sessions]
        self.stage.sessions(log.sessions, update=log.update, latencies=log.latencies,
                            causes=log.causes, trained=log.trained, truncation=TRUNCATION,
                            verdicts=[verdicts(r or ()) for r in runs] if any(runs) else None)

    def dataset(self, dataset):
        """The stage's prompts, registered with the scheduler as the trainer reads them."""
        return self.scheduler.tasks(dataset)

    def __call__(self, state, batch, key):
        return self.scheduler(state, batch, key)

    def reuse_from(self, store, run: str, stage: str, resumed: int, checkpoint: str) -> tuple[str, int]:
        """Offer the sessions an earlier attempt of this stage finished within the staleness
        bound of update `resumed` (the checkpoint's; the stage trains without accumulation, so
        steps are updates). checkpoint: the path the stage resumes from; the run that recorded
        it wrote those sessions (this run on a Prefect retry, an earlier flow run of the same
        pipeline name when a killed process is run again). Returns (that run, samples offered).
        """
        _, found = store.rows("SELECT run FROM checkpoints WHERE stage = ? AND step = ? AND path = ? "
                              "ORDER BY written_at DESC LIMIT 1", [stage, int(resumed), checkpoint])
        earlier = found[0][0] if found else run
        offered = self.scheduler.reuse(store.resumable_sessions(earlier, stage, updates=resumed,
                                                                max_lag=self.scheduler.max_lag))
        return earlier, offered

    def close(self) -> None:
        try:
            self.scheduler.close()
        finally:
            self.source.close()
            self.server.close()
