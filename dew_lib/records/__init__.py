"""Records: what rollouts produce and the run store keeps, as plain frozen dataclasses over numpy.

`Call`, `Session`, `Status` and `Task` (sessions.py); the episode types an environment and a
verifier exchange (episodes.py); a rollout server's `Draw` (draw.py); the scheduler's
`SchedulerRecord`, `SessionLog` and the causes it records (scheduler.py).

This package imports nothing else of dew_lib and never JAX, so the run store and the `dew`
command can read and write records without loading a model. Not here: packing records into
training batches (`dew_lib.rollouts`), drawing them, storing them (`dew_lib.store`).
"""

from dew_lib.records.draw import Draw
from dew_lib.records.episodes import (
                                      Action,
                                      Environment,
                                      EnvironmentFactory,
                                      Episode,
                                      EpisodeId,
                                      EpisodeStatus,
                                      Observation,
                                      Transition,
                                      Verifier,
)
from dew_lib.records.ids import token_ids
from dew_lib.records.scheduler import CAUSES, RESUBMIT_CAUSES, SchedulerRecord, SessionLog
from dew_lib.records.sessions import (
                                      FINISH_REASONS,
                                      TRUNCATION,
                                      Call,
                                      Session,
                                      SessionSource,
                                      Status,
                                      Task,
                                      check_truncation,
                                      status_trains,
)

__all__ = ["CAUSES", "FINISH_REASONS", "RESUBMIT_CAUSES", "TRUNCATION", "Action", "Call", "Draw",
           "Environment", "EnvironmentFactory", "Episode", "EpisodeId", "EpisodeStatus",
           "Observation", "SchedulerRecord", "Session", "SessionLog", "SessionSource", "Status",
           "Task", "Transition", "Verifier", "check_truncation", "status_trains", "token_ids"]
