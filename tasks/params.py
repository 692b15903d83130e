"""The parameters of every flow, as pydantic models: the Prefect UI renders them as forms.

A stage's form is the library's options for it (dew_lib/recipes/options.py, where each option is
declared once) plus what only the pipeline decides: data lengths, how DPO's pairs are made,
processes, deadlines, where async rollouts are drawn. Defaults are the embedded demo (arithmetic
in a chat template, a small decoder, two CPU cores); a real run changes only these values: a
local Hugging Face checkpoint in `ModelParams.pretrained` and data files in `DataParams`.
"""

from __future__ import annotations

import os
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from dew_lib.recipes.options import (
    DPOOptions,
    EpisodeOptions,
    GRPOOptions,
    PPOOptions,
    Renamed,
    SFTOptions,
)
from dew_lib.recipes.options_distill import DistillOptions
from dew_lib.train.mesh import MeshSpec
from dew_lib.train.trackers import TrackerOptions
from tasks.memory import planned_bytes
from tasks.params_base import Params, StageParams, _existing
from tasks.params_file import command_line, read_params_file  # noqa: F401 - flows import them from here
from tasks.params_image import (  # noqa: F401 - flows and tasks import the image pipeline's forms from here
    DiTParams,
    FlowGRPOParams,
    FlowPipelineParams,
    FlowPretrainParams,
    ImageDataParams,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: str | None) -> bool:
    """Whether a checkpoint directory ships a tokenizer (the files Pretrained loads one from)."""
    return directory is not None and any(os.path.isfile(os.path.join(directory, name))
                                         for name in TOKENIZER_FILES)


# The names DataParams.columns maps to fields of the user's files (tasks/data.py reads them).
COLUMN_NAMES = ("prompt", "completion", "ground_truth", "messages", "tools", "data_source",
                "extra_info", "chosen", "rejected", "chosen_mask", "rejected_mask")
GSM8K_COLUMNS = '{"prompt": "question", "completion": "answer", "ground_truth": "answer"}'


class DataParams(Params):
    source: Literal["arithmetic", "files", "code", "tools"] = Field(
        "arithmetic", description="'arithmetic' generates the demo task from the seed; 'files' "
        "reads the four paths below; 'code' turns an MBPP or HumanEval file (code_path) into prompts; "
        "'tools' generates two-digit products answered with a calculator tool (GRPO and evaluation "
        "run tool episodes, see ToolParams)")
    train_problems: int = Field(20_000, ge=100, description="arithmetic, tools: problems generated for training")
    test_problems: int = Field(200, ge=10, description="arithmetic, tools: held-out problems for evaluation")
    vocab_size: int = Field(320, ge=260, description="arithmetic, tools: size of the byte-level BPE "
                            "tokenizer it trains")
    teacher_errors: float = Field(0.1, ge=0, lt=1, description="arithmetic: share of the SFT "
                                  "answers that are near misses (off by one or ten, digits swapped), "
                                  "as a careless teacher writes them; SFT learns the rule and the "
                                  "slips, and DPO and GRPO, graded against the true answers, remove "
                                  "the slips (docs/pipeline.md). 0: every answer right")
    tool_share: float = Field(0.5, ge=0, le=1, description="tools: share of the SFT conversations that "
                              "call the calculator; the others answer at once")
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

    columns: dict[str, str] = Field(
        default_factory=dict, description="files: which field of your files holds each thing the "
        "pipeline reads, the same for every file: prompt, completion (the SFT answer), ground_truth "
        "(the reference answer), messages, tools, data_source, extra_info, chosen, rejected, "
        "chosen_mask, rejected_mask. GSM8K: {\"prompt\": \"question\", \"completion\": \"answer\", "
        "\"ground_truth\": \"answer\"}. Names left out are read from the field of that name")
    ground_truth_after: str | None = Field(
        None, min_length=1, description="files: the reference answer is the text after the last "
        "occurrence of this marker in the ground_truth field (GSM8K: \"####\"); empty: the whole field")
    max_truncated: float = Field(
        0.01, ge=0, le=1, description="share of the rows a length may cut (SFT conversations longer "
        "than sft.max_length, GRPO prompts longer than grpo.max_prompt_len, DPO pairs from the "
        "policy longer than dpo.max_length) before the run is refused; the pipeline counts them after "
        "preparing the data, before training. 1: never refuse")

    _exists = field_validator("chat_path", "pairs_path", "prompts_path", "eval_path", "tokenizer",
                              "code_path")(_existing)

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, value: dict[str, str]) -> dict[str, str]:
        for name, field in value.items():
            if name not in COLUMN_NAMES:
                hint = (f" The keys are the pipeline's names and the values your fields: did you mean "
                        f"{{{field!r}: {name!r}}}?" if field in COLUMN_NAMES else "")
                raise ValueError(f"DataParams.columns has the key {name!r}, which is not a name the pipeline "
                                 f"reads; map these names to the fields of your files: "
                                 f"{', '.join(COLUMN_NAMES)}, e.g. for GSM8K {GSM8K_COLUMNS}.{hint}")
            if not field.strip():
                raise ValueError(f"DataParams.columns[{name!r}] is empty; give the field of your files that "
                                 f"holds the {name}")
        return value

    @model_validator(mode="after")
    def _code_needs_a_file(self) -> DataParams:
        if self.source == "code" and self.code_path is None:
            raise ValueError("DataParams(source='code') needs code_path: an MBPP or HumanEval file, "
                             "e.g. shared/data/mbpp/mbpp.jsonl")
        if self.source != "files" and (self.columns or self.ground_truth_after is not None):
            given = "columns" if self.columns else "ground_truth_after"
            raise ValueError(f"DataParams.{given} maps the fields of your files and applies to "
                             f"source='files' only, not source={self.source!r}; set source='files' "
                             "with chat_path, prompts_path and eval_path, or leave it empty")
        return self

    def read_as_given(self) -> bool:
        """True when the files are read as they are: no field is mapped and no answer extracted."""
        return not self.columns and self.ground_truth_after is None


class ModelParams(Params):
    pretrained: str | None = Field(None, description="a local Hugging Face checkpoint directory "
                                   "(Qwen3, Qwen2, Llama); empty: the embedded small decoder")
    emb_features: int = Field(128, ge=8, description="embedded decoder: width")
    num_layers: int = Field(4, ge=1, description="embedded decoder: layers")
    num_heads: int = Field(4, ge=1, description="embedded decoder: attention heads")
    mlp_features: int = Field(384, ge=8, description="embedded decoder: MLP width")
    max_seq_len: int = Field(128, ge=16, description="embedded decoder: context length")
    experts: int = Field(0, ge=0, description="embedded decoder: experts per layer, each token's MLP "
                         "a mix of its experts_per_token best (mixture of experts, docs/moe.md); 0: one "
                         "dense MLP")
    experts_per_token: int = Field(2, ge=1, description="embedded decoder with experts: experts each "
                                   "token is routed to (top-k)")
    expert_features: int | None = Field(None, ge=8, description="embedded decoder with experts: each "
                                        "expert's MLP width; empty: mlp_features")

    # Fields added after initial policies were first keyed: left at their defaults, the key is
    # what it was before they existed (tasks/manifests.keyed).
    LATER: ClassVar[frozenset[str]] = frozenset({"experts", "experts_per_token", "expert_features"})

    @model_validator(mode="after")
    def _routable(self) -> ModelParams:
        if self.experts and self.experts_per_token > self.experts:
            raise ValueError(f"ModelParams.experts_per_token={self.experts_per_token} exceeds experts="
                             f"{self.experts}: a token cannot be routed to more experts than a layer has")
        if self.pretrained is not None and self.experts:
            raise ValueError("ModelParams.experts shapes the embedded decoder, and pretrained names a "
                             "checkpoint whose config.json already says whether it has experts; leave "
                             "experts at 0 with a checkpoint")
        return self

    @field_validator("pretrained")
    @classmethod
    def _checkpoint(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isfile(os.path.join(value, "config.json")):
            raise ValueError(f"{value!r} is not a Hugging Face checkpoint directory (no config.json)")
        return value


class TextStageParams(StageParams):
    """A language-model stage (SFT, DPO, GRPO, distill), which can train as a job of several processes."""

    processes: int = Field(1, ge=1, description="train as a job of this many processes on this host "
                           "(tasks/stage_job.py), each reading its own share of every batch, so the "
                           "data order differs from one process and this is part of the stage's "
                           "inputs; 1: in the task's own process. Every stage: SFT, DPO, distill, and the "
                           "RL stage sync or async, on prompts or tool episodes, GRPO or PPO (docs/pipeline.md)")

    mesh: str = Field("", description="how the stage's devices are arranged, as axis=size pairs: "
                      "'fsdp=8' splits every weight, optimizer moment and reference copy 8 ways, "
                      "'data=2,fsdp=2,tensor=2' adds tensor parallelism and replicas (docs/distributed.md, "
                      "Sharding), 'fsdp=2,expert=4' splits a mixture of experts' experts 4 ways (docs/moe.md); "
                      "empty: every device a replica of the whole state. Not part of the "
                      "stage's inputs: a stage resumes its checkpoint under another mesh")

    device_memory: str = Field("", description="each device's memory to plan the stage against before it "
                               "trains: a known device (h100, h200, a100-40, a100-80, l40s, v5e) or a whole "
                               "number of bytes; empty: what the devices report (GPUs and TPUs do, CPUs do "
                               "not). A stage that does not fit is refused with what to change (docs/distributed.md, "
                               "What fits). Not part of the stage's inputs")

    @field_validator("mesh")
    @classmethod
    def _mesh_reads(cls, mesh: str) -> str:
        MeshSpec.parse(mesh)
        return mesh

    @field_validator("device_memory")
    @classmethod
    def _memory_reads(cls, device_memory: str) -> str:
        planned_bytes(device_memory)
        return device_memory

    @model_validator(mode="after")
    def _batch_divides(self) -> TextStageParams:
        if self.batch % self.processes:
            raise ValueError(f"batch={self.batch} does not divide across processes={self.processes} (each "
                             f"process reads batch / processes rows a step); make batch a multiple of "
                             f"{self.processes}, or change processes")
        return self


class SFTParams(SFTOptions, TextStageParams):
    max_length: int = Field(97, ge=9, description="ids per packed row (TRL's max_length); each row "
                            "trains its max_length - 1 next-token predictions")

    RENAMED = {"seq_len": Renamed("max_length", shift=1)}  # seq_len was the row less one


class DPOParams(DPOOptions, TextStageParams):
    max_length: int = Field(40, ge=4, description="ids per chosen or rejected row, prompt included "
                            "(TRL's max_length)")
    RENAMED = {"seq_len": Renamed("max_length")}

    pairs: Literal["policy", "data"] = Field(
        "policy", description="'policy': reference answers against the starting policy's own wrong "
        "answers (drawn at pair_temperature) to the GRPO prompts; 'data': the prepared pairs file")
    pair_prompts: int = Field(8000, ge=1, description="policy pairs: prompts the policy answers")
    pair_temperature: float = Field(1.0, ge=0, description="policy pairs: temperature of the "
                                    "policy's answers (0: greedy, what evaluation measures)")
    max_epochs: float | None = Field(2.0, gt=0, description="passes over the pairs at most: with "
                                     "fewer pairs than steps x batch / max_epochs, steps are cut to "
                                     "fit (a strong policy makes few mistakes; many passes over "
                                     "them overfit); None: always `steps`")


class RolloutServerParams(Params):
    """Where an async GRPO stage, or a distill stage's student, draws: in its own process (the
    native server; distill: `generate`), or on a remote engine (vLLM, SGLang, `dew serve`) it
    pushes weights to through `directory` (recipes.RemoteEngine)."""

    server: str = Field("native", min_length=1, description="'native', or the engine's root URL")
    provider: Literal["vllm", "sglang"] = Field("vllm", description="wire format ('vllm' for dew serve)")
    directory: str | None = Field(None, description="remote: the replicas' launch directory (pushes rewrite it)")
    model: str | None = Field(None, description="remote: served model name (empty: the one it lists)")
    replicas: list[str] = Field(default_factory=list, description="remote: root URLs pushed to (empty: server)")
    processed_logprobs: bool = Field(False, description="remote vLLM: --logprobs-mode processed_logprobs")
    timeout: float = Field(600.0, gt=0, description="remote: seconds a draw or one push call may take")

    @property
    def remote(self) -> bool:
        return self.server != "native"

    @model_validator(mode="after")
    def _where(self) -> RolloutServerParams:
        if self.remote and not self.server.startswith(("http://", "https://")):
            raise ValueError(f"rollout.server={self.server!r} is neither 'native' nor an http(s) URL")
        if self.remote and not self.directory:  # pushes go through the engine's launch directory
            raise ValueError("rollout.directory is empty: a remote engine is pushed weights through the "
                             "checkpoint directory it was launched on; give that path")
        return self


class GRPOParams(GRPOOptions, TextStageParams):
    """The RL stage's policy side: GRPO's, and PPO's when PipelineParams.rl='ppo'."""

    max_prompt_len: int = Field(24, ge=2, description="prompt ids kept (left-padded)")
    rollout: RolloutServerParams = Field(default_factory=RolloutServerParams,
                                         description="async: where the rollouts are drawn")

    @model_validator(mode="after")
    def _where(self) -> GRPOParams:
        if self.rollout.remote and self.mode != "async":
            raise ValueError(f"rollout.server={self.rollout.server!r} is a remote engine, which draws ahead "
                             "of the trainer: set mode='async'")
        return self


class DistillParams(DistillOptions, TextStageParams):
    """On-policy distillation of the policy (the student) from the teacher checkpoint `teacher`,
    or the teacher an engine serves at `teacher_url` as `teacher_model`, on the GRPO stage's
    prompts; with lmbda < 1, on the SFT conversations, whose last assistant turns are the data's
    completions (docs/distill.md, The pipeline stage)."""

    max_prompt_len: int = Field(24, ge=2, description="prompt ids kept (left-padded)")
    rollout: RolloutServerParams = Field(default_factory=RolloutServerParams,
                                         description="where the student draws its samples, pushed its "
                                         "weights before each sampled step ('native': in this process)")

    # Stages keyed before the student could draw on an engine keep their keys while it draws here.
    LATER: ClassVar[frozenset[str]] = DistillOptions.LATER | {"rollout"}

    @field_validator("teacher")
    @classmethod
    def _checkpoint(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isfile(os.path.join(value, "config.json")):
            raise ValueError(f"distill.teacher={value!r} is not a Hugging Face checkpoint directory (no config.json)")
        return value


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


class ToolParams(EpisodeOptions):
    """Tool episodes (data.source='tools'): their shape and each calculator worker's limits. GRPO
    and evaluation both run them (dew_lib.rollouts.EpisodeRollout)."""

    wall_seconds: float = Field(60.0, gt=0, description="each calculator worker's wall and CPU deadline "
                                "for its episode")
    memory_mb: int = Field(512, ge=64, description="each calculator worker's memory limit in MiB")
    alive: int = Field(64, ge=2, description="evaluation: episodes (worker processes) open at once")


PPOParams = PPOOptions  # the PPO stage's critic side; its policy side is GRPOParams


class EvalParams(Params):
    max_new_tokens: int = Field(16, ge=1, description="answer budget")
    batch: int = Field(100, ge=1, description="prompts generated at once")
    samples: int = Field(8, ge=0, description="answers drawn per prompt at `temperature` besides "
                         "the greedy one, for the sampled accuracy (mean@k); 0: greedy only")
    temperature: float = Field(1.0, gt=0, description="temperature of the drawn answers (GRPO "
                               "samples at 1.0 by default)")
    seed: int = Field(0, description="seeds the drawn answers: every stage draws with the same keys")
    limit: int | None = Field(None, ge=1, description="evaluate only the first this many held-out "
                              "rows (empty: all of them)")


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
    tools: ToolParams = ToolParams()
    rl: Literal["grpo", "ppo"] = Field("grpo", description="the RL stage's algorithm, and the name it "
                                       "runs and is recorded under: 'grpo' (group-relative advantages) or "
                                       "'ppo' (a critic and GAE; grpo.mode='sync'). Its policy side is the "
                                       "grpo block either way; PPO adds the ppo block")
    ppo: PPOParams = PPOParams()
    distill: DistillParams = DistillParams()
    stages: tuple[Literal["sft", "dpo", "grpo", "distill"], ...] = Field(
        ("sft", "dpo", "grpo"), description="stages to run, in order; 'grpo' is the RL stage, trained "
        "with the algorithm `rl` names; 'distill' distils distill.teacher (or the teacher served at "
        "distill.teacher_url) into the policy on the GRPO prompts (with distill.lmbda < 1, on the "
        "SFT conversations and their answers)")
    tracking: TrackerOptions = Field(default_factory=TrackerOptions, description="TensorBoard, MLflow and "
                                     "W&B runs of every training stage, beside the run store (docs/trackers.md)")

    def stage_name(self, stage: str) -> str:
        """The name a stage of `stages` runs under: the RL stage takes its algorithm's."""
        return self.rl if stage == "grpo" else stage

    @model_validator(mode="after")
    def _code_has_no_pairs(self) -> PipelineParams:
        if self.data.source in ("code", "tools") and "dpo" in self.stages:
            raise ValueError(f"data.source={self.data.source!r} has no preference pairs for DPO; choose "
                             "stages without 'dpo', e.g. stages=['sft', 'grpo']")
        return self

    @model_validator(mode="after")
    def _teacher_given(self) -> PipelineParams:
        if "distill" in self.stages and self.distill.teacher is None and self.distill.teacher_url is None:
            raise ValueError("stages has 'distill' and both distill.teacher and distill.teacher_url are empty: give "
                             "the teacher's Hugging Face checkpoint directory in distill.teacher, with the student's "
                             "tokenizer (e.g. the policy an SFT stage of a larger model wrote), or the base URL of "
                             "an engine serving it in distill.teacher_url (with distill.teacher_model)")
        return self

    @model_validator(mode="after")
    def _ppo_in_step(self) -> PipelineParams:
        if self.rl == "ppo" and self.grpo.mode != "sync":
            raise ValueError("rl='ppo' draws its episodes in step with the trainer (its critic values them "
                             "at the weights that sampled): set grpo.mode='sync', or use rl='grpo' for "
                             "asynchronous rollouts")
        if self.rl == "ppo":
            try:
                self.grpo.check_ppo()
            except ValueError as error:
                raise ValueError(f"rl='ppo': {error} (the grpo block's fields)") from None
        return self

    @model_validator(mode="after")
    def _routes_recorded(self) -> PipelineParams:
        if self.grpo.routing_replay == "none":
            return self
        if self.model.pretrained is None and not self.model.experts:
            raise ValueError(f"grpo.routing_replay={self.grpo.routing_replay!r} replays the experts each token "
                             "was routed to, and the embedded decoder has none: set model.experts (and "
                             "model.experts_per_token), or leave routing_replay='none'")
        return self

    @model_validator(mode="after")
    def _episodes_fit(self) -> PipelineParams:
        width = self.tools.max_prompt_len + max(self.grpo.max_new_tokens, self.evaluation.max_new_tokens)
        if self.data.source == "tools" and self.model.pretrained is None and width > self.model.max_seq_len:
            raise ValueError(f"tools.max_prompt_len + the response budget ({width} ids) exceeds "
                             f"model.max_seq_len={self.model.max_seq_len}; lower tools.max_prompt_len or raise "
                             "model.max_seq_len")
        return self

    @model_validator(mode="after")
    def _files_need_a_tokenizer(self) -> PipelineParams:
        if (self.data.source == "files" and self.data.tokenizer is None
                and not has_tokenizer(self.model.pretrained)):
            model = ("model.pretrained is empty (the embedded decoder takes its vocabulary from the "
                     "tokenizer)" if self.model.pretrained is None else
                     f"model.pretrained={self.model.pretrained!r} ships no tokenizer files")
            raise ValueError(f"data.source='files' needs a tokenizer to read your files and size the "
                             f"model, and data.tokenizer is empty while {model}; set data.tokenizer to "
                             "a tokenizer directory (e.g. shared/data/tokenizers/qwen3), or "
                             "model.pretrained to a checkpoint that has one")
        return self

