"""Asynchronous GRPO: `RolloutScheduler` draws rollouts ahead of the update that trains them."""

from dew_lib.rollouts.scheduler.scheduler import RolloutScheduler
from dew_lib.rollouts.scheduler.states import GroupState
from dew_lib.rollouts.scheduler.tasks import prompt_tasks, task_ids

__all__ = ["GroupState", "RolloutScheduler", "prompt_tasks", "task_ids"]
