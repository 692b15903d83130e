"""The RL stage as a job of two processes beyond sync GRPO on prompts: PPO, GRPO on tool
episodes and asynchronous GRPO. Each runs the RL stage as two processes; process 1 is killed
(SIGKILL) mid-stage, after a checkpoint, and the task's retry resumes the job, which finishes;
process 0 records every process's sessions. Episodes train only the turns that ended at EOS, so
those runs start from a short SFT (in one process) whose policy ends about half its answers.

The pattern and its helpers are tests/test_stage_processes.py's; each run costs two job launches
(about 20 s each on two cores).
"""

import os

import pytest

pytest.importorskip("prefect")

from test_pipeline import TINY, query  # noqa: E402
from test_stage_processes import killed_and_resumed, run_with_a_crash  # noqa: E402
from test_tool_pipeline import TINY as TOOLS  # noqa: E402

from tasks.params import PipelineParams  # noqa: E402

RL = dict(steps=3, batch=2, groups=4, log_every=1, checkpoint_every=1, max_new_tokens=16, processes=2)
SFT = dict(steps=60, batch=8, log_every=20, checkpoint_every=60)  # in one process, a few seconds


def two_processes(root, base=TINY, **changes) -> PipelineParams:
    """`base`'s SFT, then its RL stage as a job of two processes, with `changes` to the pipeline."""
    grpo = {**RL, **changes.pop("grpo", {})}
    return PipelineParams(root=str(root), **{**base, "stages": ("sft", "grpo"), "sft": SFT, "grpo": grpo,
                                             **changes})


def each_step_once(root, run, stage):
    """The steps whose loss process 0 recorded, each once."""
    rows = query(root, f"SELECT step, count(*) FROM metrics WHERE run = '{run}' AND stage = '{stage}' "
                       "AND name = 'loss' GROUP BY step ORDER BY step")
    return [step for step, count in rows if count == 1]


def sessions_of_both_processes(root, run, updates, stage):
    """Each update's sessions: 2 prompts (one per process, group ids 0 and 1) x 4 samples."""
    sessions = query(root, f"SELECT update, group_id, count(*) FROM sessions WHERE run = '{run}' "
                           f"AND stage = '{stage}' GROUP BY ALL ORDER BY ALL")
    return sessions == [(update, group, 4) for update in range(updates) for group in (0, 1)]


def turns_of_every_session(root, run, stage):
    """Whether every recorded session of `stage` has its turns in the store."""
    return query(root, f"SELECT count(*) FROM sessions s WHERE run = '{run}' AND stage = '{stage}' AND NOT EXISTS "
                       "(SELECT 1 FROM turns t WHERE t.session_uid = s.session_uid)") == [(0,)]


@pytest.mark.slow
def test_ppo_trains_as_two_processes_and_resumes_after_one_is_killed(prefect_harness, tmp_path):
    params = two_processes(tmp_path, rl="ppo")
    outcome, lines = run_with_a_crash(params, process=1, step=3)
    run = outcome["run"]
    assert killed_and_resumed(lines, "ppo", checkpoint=2)
    assert query(tmp_path, f"SELECT status, attempt FROM stages WHERE run = '{run}' AND stage = 'ppo'") == \
        [("completed", 2)]
    assert each_step_once(tmp_path, run, "ppo") == [1, 2, 3]
    assert query(tmp_path, f"SELECT count(*) FROM metrics WHERE run = '{run}' AND name = 'critic/vf_loss'") == [(3,)]
    assert sessions_of_both_processes(tmp_path, run, 3, "ppo") and turns_of_every_session(tmp_path, run, "ppo")
    assert os.path.isdir(outcome["policy"])


@pytest.mark.slow
def test_grpo_on_tool_episodes_trains_as_two_processes_and_resumes_after_one_is_killed(prefect_harness, tmp_path):
    """Each process runs its own episodes in its own calculator workers; every turn samples the
    job's whole cohort."""
    outcome, lines = run_with_a_crash(two_processes(tmp_path, TOOLS), process=1, step=3)
    run = outcome["run"]
    assert killed_and_resumed(lines, "grpo", checkpoint=2)
    assert query(tmp_path, f"SELECT status, attempt FROM stages WHERE run = '{run}' AND stage = 'grpo'") == \
        [("completed", 2)]
    assert each_step_once(tmp_path, run, "grpo") == [1, 2, 3]
    assert sessions_of_both_processes(tmp_path, run, 3, "grpo") and turns_of_every_session(tmp_path, run, "grpo")
    answered = query(tmp_path, f"SELECT count(*) FROM turns WHERE run = '{run}' AND stage = 'grpo' "
                               "AND status = 'completed'")
    assert answered[0][0] > 0  # the calculator workers answered the episodes that ended


@pytest.mark.slow
def test_async_grpo_trains_as_two_processes_and_resumes_after_one_is_killed(prefect_harness, tmp_path):
    """Each process's scheduler draws its own prompts on its own native server, a batch ahead;
    process 0 records every process's sessions and one scheduler record per update. Process 1
    is killed as its scheduler reads the batch of step 3 ahead, during step 2."""
    params = PipelineParams(root=str(tmp_path), **{**TINY, "stages": ("grpo",),
                                                   "grpo": {**RL, "mode": "async", "slots": 8}})
    outcome, lines = run_with_a_crash(params, process=1, step=3)
    run = outcome["run"]
    assert killed_and_resumed(lines, "grpo", checkpoint=1)
    assert any(line.startswith("[0] grpo reuses up to") for line in lines)
    assert query(tmp_path, f"SELECT status, attempt FROM stages WHERE run = '{run}' AND stage = 'grpo'") == \
        [("completed", 2)]
    assert each_step_once(tmp_path, run, "grpo") == [1, 2, 3]
    # The groups each update trained: process 0's prompt of the batch (group id 2 x position) and
    # process 1's (2 x position + 1), 4 samples each.
    admitted = query(tmp_path, f"SELECT update, group_id, count(*) FROM sessions WHERE run = '{run}' "
                               "AND cause = 'admitted' GROUP BY ALL ORDER BY ALL")
    assert admitted == [(update, group, 4) for update in (0, 1, 2) for group in (2 * update, 2 * update + 1)]
    records = query(tmp_path, f"SELECT updates, groups FROM scheduler_records WHERE run = '{run}' ORDER BY updates")
    assert records == [(0, 2), (1, 2), (2, 2)]  # the processes' records merged, one per update
    # What the resumed attempt trained without drawing it, the killed one had finished: rows still
    # recorded as pending, or the groups of position 1 it admitted after the checkpoint (rows the
    # resume discarded, read before it did), as the kill fell before or after that update.
    reused = query(tmp_path, f"SELECT group_id, sample FROM sessions WHERE run = '{run}' AND cause = 'admitted' "
                             "AND latency IS NULL ORDER BY ALL")
    finished = query(tmp_path, f"SELECT group_id, sample FROM sessions WHERE run = '{run}' AND cause = 'pending' "
                               "ORDER BY ALL")
    assert {group for group, _ in set(reused) - set(finished)} <= {2, 3}
