"""The parameters of every flow, as pydantic models: the Prefect UI renders them as forms.

Defaults are the embedded demo (arithmetic in a chat template, a small decoder, two CPU cores);
a real run changes only these values: a local Hugging Face checkpoint in `ModelParams.pretrained`
and data files in `DataParams`.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Params(BaseModel):
    """Frozen, and unknown fields are refused, so a typo in the UI is an error, not a no-op."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class DataParams(Params):
    source: Literal["arithmetic", "files", "code"] = Field(
        "arithmetic", description="'arithmetic' generates the demo task from the seed; 'files' "
        "reads the four paths below; 'code' turns an MBPP or HumanEval file (code_path) into prompts")
    train_problems: int = Field(20_000, ge=100, description="arithmetic: problems generated for training")
    test_problems: int = Field(200, ge=10, description="arithmetic: held-out problems for evaluation")
    vocab_size: int = Field(320, ge=260, description="arithmetic: size of the byte-level BPE tokenizer it trains")
    chat_path: str | None = Field(None, description="files: SFT conversations (.jsonl/.parquet, 'messages' column)")
    pairs_path: str | None = Field(None, description="files: DPO pairs (.jsonl/.parquet: chosen, rejected, masks)")
    prompts_path: str | None = Field(None, description="files: GRPO prompts (.jsonl/.parquet: prompt, ground_truth)")
    eval_path: str | None = Field(None, description="files: held-out prompts with ground_truth for evaluation")
    tokenizer: str | None = Field(None, description="files: tokenizer directory (default: the model's)")
    code_path: str | None = Field(None, description="code: an MBPP (.jsonl) or HumanEval (.jsonl or "
                                  ".jsonl.gz) file as published; tokenized with `tokenizer`, or else a "
                                  "byte-level BPE of `vocab_size` trained on its problems")
    code_layout: Literal["auto", "mbpp", "humaneval"] = Field(
        "auto", description="code: the file's layout; 'auto' tells them apart by their columns")
    code_test_problems: int = Field(50, ge=1, description="code: held-out problems for evaluation (MBPP: "
                                    "the first of its test split, task_id 11-510; HumanEval: the first rows)")
    code_train_problems: int | None = Field(None, ge=1, description="code: GRPO prompts (MBPP: from its "
                                            "train split, task_id 601-974; HumanEval: the rows after the "
                                            "held-out ones); empty: all of them")

    @field_validator("chat_path", "pairs_path", "prompts_path", "eval_path", "tokenizer", "code_path")
    @classmethod
    def _exists(cls, value: str | None) -> str | None:
        if value is not None and not os.path.exists(value):
            raise ValueError(f"{value!r} does not exist; give a path readable from where the flow runs")
        return value

    @model_validator(mode="after")
    def _code_needs_a_file(self) -> DataParams:
        if self.source == "code" and self.code_path is None:
            raise ValueError("DataParams(source='code') needs code_path: an MBPP or HumanEval file, "
                             "e.g. shared/data/mbpp/mbpp.jsonl")
        return self


class ModelParams(Params):
    pretrained: str | None = Field(None, description="a local Hugging Face checkpoint directory "
                                   "(Qwen3, Qwen2, Llama); empty: the embedded small decoder")
    emb_features: int = Field(128, ge=8, description="embedded decoder: width")
    num_layers: int = Field(4, ge=1, description="embedded decoder: layers")
    num_heads: int = Field(4, ge=1, description="embedded decoder: attention heads")
    mlp_features: int = Field(384, ge=8, description="embedded decoder: MLP width")
    max_seq_len: int = Field(128, ge=16, description="embedded decoder: context length")

    @field_validator("pretrained")
    @classmethod
    def _checkpoint(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isfile(os.path.join(value, "config.json")):
            raise ValueError(f"{value!r} is not a Hugging Face checkpoint directory (no config.json)")
        return value


class StageParams(Params):
    steps: int = Field(ge=1, description="optimizer steps")
    batch: int = Field(16, ge=1, description="rows (SFT), pairs (DPO) or prompts (GRPO) per step")
    learning_rate: float = Field(1e-3, gt=0, description="peak AdamW learning rate")
    log_every: int = Field(10, ge=1, description="steps per logged metric window")
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints (a retry resumes there)")
    max_minutes: float | None = Field(None, gt=0, description="stop the stage with an error after this long")


class SFTParams(StageParams):
    steps: int = Field(600, ge=1, description="optimizer steps")
    learning_rate: float = Field(3e-3, gt=0, description="peak AdamW learning rate")
    seq_len: int = Field(96, ge=8, description="tokens per packed row, less one")


class DPOParams(StageParams):
    steps: int = Field(120, ge=1, description="optimizer steps")
    learning_rate: float = Field(5e-4, gt=0, description="AdamW learning rate")
    beta: float = Field(0.1, gt=0, description="DPO beta: the scale of the log-ratio to the reference")
    seq_len: int = Field(40, ge=4, description="ids per chosen or rejected row")


class GRPOParams(StageParams):
    steps: int = Field(60, ge=1, description="optimizer steps")
    learning_rate: float = Field(5e-4, gt=0, description="AdamW learning rate")
    batch: int = Field(16, ge=1, description="prompts per step")
    groups: int = Field(4, ge=2, description="completions drawn per prompt")
    max_new_tokens: int = Field(16, ge=1, description="response budget per completion")
    max_prompt_len: int = Field(24, ge=2, description="prompt ids kept (left-padded)")
    beta: float = Field(0.01, ge=0, description="KL coefficient to the frozen starting policy")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts")


class RewardParams(Params):
    """How answers are graded, in GRPO and in evaluation: each row's `data_source` picks the
    reward (tasks/rewards.py); code is run in a sandbox chosen here."""

    runner: Literal["namespace", "process", "container"] = Field(
        "namespace", description="code: 'namespace' (bubblewrap: no network, read-only system), "
        "'process' (rlimits only: trusted code), 'container' (a Docker container per program)")
    workers: int | None = Field(None, ge=1, description="code: programs run at once (empty: CPU count)")
    wall_seconds: float = Field(10.0, gt=0, description="code: each program's wall-clock deadline")
    memory_mb: int = Field(1024, ge=16, description="code: each program's memory limit in MiB")
    image: str = Field("python:3.12-slim", min_length=1, description="code, container runner: the image")
    all_or_nothing: bool = Field(False, description="code: 1.0 only when every test passes, else 0.0")


class EvalParams(Params):
    max_new_tokens: int = Field(16, ge=1, description="answer budget")
    batch: int = Field(100, ge=1, description="prompts generated at once")


class PipelineParams(Params):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$",
                      description="run directory name under `root`; a rerun with the same name "
                      "and inputs skips the stages that already finished")
    root: str = Field("runs", description="project directory: runs and the store (dew.duckdb) live here")
    seed: int = Field(0, description="seeds data generation, initialization and sampling")
    data: DataParams = DataParams()
    model: ModelParams = ModelParams()
    sft: SFTParams = SFTParams()
    dpo: DPOParams = DPOParams()
    grpo: GRPOParams = GRPOParams()
    evaluation: EvalParams = EvalParams()
    reward: RewardParams = RewardParams()
    stages: tuple[Literal["sft", "dpo", "grpo"], ...] = Field(
        ("sft", "dpo", "grpo"), description="stages to run, in order")

    @model_validator(mode="after")
    def _code_has_no_pairs(self) -> PipelineParams:
        if self.data.source == "code" and "dpo" in self.stages:
            raise ValueError("data.source='code' has no preference pairs for DPO; choose stages "
                             "without 'dpo', e.g. stages=['sft', 'grpo']")
        return self
