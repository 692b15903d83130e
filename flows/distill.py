"""distill: on-policy distillation of a saved policy (the student) from a frozen teacher.

The student samples a completion for each GRPO prompt, the teacher scores every sampled token,
and the student moves towards the teacher's next-token distributions (dew_lib/objectives/distill.py,
docs/distill.md). The teacher is `params.teacher`, a Hugging Face checkpoint with the student's
tokenizer loaded in the stage's process, or `params.teacher_url` with `params.teacher_model`, an
engine (vLLM, `dew serve`) that reports its log-prob of each sampled id (loss 'reverse_kl' only).
Every sampled session is recorded with reward = its negative mean per-token KL. The stage's key
reads the teacher checkpoint's files, or the served teacher's URL and model name.
"""

from __future__ import annotations

from prefect import flow

from dew_lib.train.trackers import TrackerOptions
from tasks.manifests import DataManifest, PolicyRef, StageResult
from tasks.params import DistillParams
from tasks.train import train_stage


@flow(name="distill")
def distill(params: DistillParams, data: DataManifest, start: PolicyRef, directory: str,
            store_root: str = "runs", run: str = "distill", seed: int = 0,
            tracking: TrackerOptions | None = None) -> StageResult:
    return train_stage("distill", "distill", params, data, start, directory, store_root, run, seed,
                       tracking=tracking)
