"""The distill stage's options: on-policy distillation from a frozen teacher, held in process (a
checkpoint directory) or served by an engine (an OpenAI-compatible URL and a served model name).

Its own module only to keep options.py small; it builds on options.py's bases (`Adapted`,
`TrainOptions`), and options.py does not import it.

Not here: loading the teacher or making its client (build.py), the pipeline's own fields
(tasks/params.py `DistillParams`), the stage's key (tasks/train.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from dew_lib.recipes.options import Adapted, TrainOptions
from dew_lib.sampling import Sampling


class DistillOptions(Adapted, TrainOptions):
    """On-policy distillation from a frozen teacher (DistillObjective, DistillRollout, docs/distill.md).

    The teacher is either `teacher` (a checkpoint loaded in process) or `teacher_url` with
    `teacher_model` (an engine that answers vLLM's `prompt_logprobs`: vLLM, or `dew serve`),
    never both. A remote teacher reports only the log-probability of each sampled id, so it trains
    `loss='reverse_kl'` at `temperature=1` only."""

    steps: int = Field(60, ge=1, description="optimizer steps")
    learning_rate: float = Field(1e-4, gt=0, description="AdamW learning rate")
    batch: int = Field(8, ge=1, description="prompts per step (one completion each)")
    teacher: str | None = Field(None, description="the teacher: a Hugging Face checkpoint directory "
                                "(dew_lib.models.load_pretrained) with the student's vocabulary; this or "
                                "teacher_url")
    teacher_url: str | None = Field(None, description="a teacher served by an engine instead: its "
                                    "OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1; vLLM or dew "
                                    "serve); needs teacher_model and loss='reverse_kl'")
    teacher_model: str | None = Field(None, description="teacher_url: the served model name the requests name")
    loss: Literal["jsd", "reverse_kl"] = Field(
        "jsd", description="'jsd': TRL GKD's generalized JSD over the vocabulary; 'reverse_kl': "
        "prime-rl's per-token reverse KL on the sampled ids as a policy gradient (lmbda=1 only)")
    beta: float = Field(0.5, ge=0, le=1, description="jsd: 0 the forward KL(teacher || student), 1 the "
                        "reverse KL, between the generalized JSD (TRL's beta)")
    temperature: float = Field(1.0, gt=0, description="both models' logits are divided by this before "
                               "they are compared (the loss's temperature)")
    sampling_temperature: float = Field(1.0, gt=0, description="temperature the student samples at "
                                        "(TRL GKD's generation temperature)")
    lmbda: float = Field(1.0, ge=0, le=1, description="share of steps trained on the student's own "
                         "samples; the others train on the data's completions (TRL's lmbda)")
    max_new_tokens: int = Field(16, ge=1, description="response budget per completion")

    # Stages keyed before a remote teacher existed keep their keys while these stay empty.
    LATER: ClassVar[frozenset[str]] = TrainOptions.LATER | {"teacher_url", "teacher_model"}

    @field_validator("teacher_url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"DistillOptions.teacher_url={url!r} is not an http(s) URL; give the engine's "
                             "OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
        return None if url is None else url.rstrip("/")

    @model_validator(mode="after")
    def _on_policy(self) -> DistillOptions:
        if self.loss == "reverse_kl" and self.lmbda < 1:
            raise ValueError(f"DistillOptions.lmbda={self.lmbda} trains some steps on the data's completions, "
                             "but loss='reverse_kl' is a policy gradient on the student's own samples and is "
                             "biased on tokens it did not draw; set lmbda=1.0, or loss='jsd' for the mix")
        return self

    @model_validator(mode="after")
    def _one_teacher(self) -> DistillOptions:
        if self.teacher is not None and self.teacher_url is not None:
            raise ValueError(f"DistillOptions.teacher={self.teacher!r} and teacher_url={self.teacher_url!r} are "
                             "both set: the teacher is a checkpoint loaded in process or an engine, not both; "
                             "clear one of teacher and teacher_url")
        if (self.teacher_url is None) != (self.teacher_model is None):
            given, empty = ("teacher_url", "teacher_model") if self.teacher_model is None else \
                ("teacher_model", "teacher_url")
            raise ValueError(f"DistillOptions.{given} is set and {empty} is empty: a served teacher is named by "
                             "both its base URL (teacher_url) and its served model name (teacher_model)")
        if self.remote:
            if self.loss != "reverse_kl":
                raise ValueError(f"DistillOptions.teacher_url serves the teacher, which reports only the "
                                 f"log-probability of each sampled id, and loss={self.loss!r} needs its whole "
                                 "next-token distribution: set loss='reverse_kl' (or give a checkpoint in "
                                 "teacher for 'jsd')")
            if self.temperature != 1:
                raise ValueError(f"DistillOptions.teacher_url serves the teacher's raw log-probabilities, and "
                                 f"temperature={self.temperature} would rescale its logits: set temperature=1.0 "
                                 "(sampling_temperature sets how the student draws)")
        return self

    @property
    def remote(self) -> bool:
        """Whether the teacher is served by an engine (`teacher_url`) rather than loaded in process."""
        return self.teacher_url is not None

    def sampling(self, eos_id: int | Sequence[int] | None) -> Sampling:
        """How the student draws: at `sampling_temperature`, ending at `eos_id`."""
        ends = eos_id if eos_id is None or isinstance(eos_id, int) else tuple(eos_id)
        return Sampling(temperature=self.sampling_temperature, eos_id=ends)


__all__ = ["DistillOptions"]
