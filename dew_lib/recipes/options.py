"""Every stage's options, declared once: name, type, default, bounds, description, and the rules
between fields.

These pydantic models are what the builders (build.py, episodes.py, flow.py), the Recipe
(chain.py) and `optimizer` read, and what the pipeline's Prefect forms and parameters files are
made of: tasks/params.py adds only what the pipeline itself decides (data lengths, processes,
deadlines) by subclassing them. A new option is one field here; it then shows in the UI's form,
is read from a parameters file or a deployment, and reaches the builders with no copying.

The defaults are the embedded demo's (a small decoder on two-number arithmetic, docs/pipeline.md),
so the library and the forms agree; where a default differs from TRL's or verl's the field says so.
Every check names the field and what it accepts; a rule between fields is a validator here, and
nowhere else.

`LATER` on a class names fields added after stages were first fingerprinted: a stage's key counts
them only when they are set away from their defaults, so finished stages of earlier runs are still
reused (tasks/train.py `stage_inputs`). `RENAMED` maps a field's earlier name to its name now: a
parameters file or deployment that still uses the earlier name is read with a warning, and a
stage's key reads the field under its earlier name and value, so renaming it kept every key.

The distill stage's options are declared in options_distill.py, on the bases here.

Not here: data specs (the loaders' own lengths), the pipeline's own choices (tasks/params.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import optax
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dew_lib.models import dit, lora
from dew_lib.models.quantize import quantize_base
from dew_lib.objectives import GRPOObjective, split_optimizer
from dew_lib.objectives.dpo import check_family
from dew_lib.options import lag_bound
from dew_lib.sampling import Sampling

Band = tuple[float, float]


@dataclasses.dataclass(frozen=True)
class Renamed:
    """A field's name now, what its value adds to the value it had under the earlier name, and
    the fields that took over that one value as well (keyed as the earlier field while equal)."""

    name: str
    shift: int = 0
    also: tuple[str, ...] = ()


class Options(BaseModel):
    """Frozen, and unknown fields are refused, so a typo is an error, not a no-op."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    LATER: ClassVar[frozenset[str]] = frozenset()
    RENAMED: ClassVar[dict[str, Renamed]] = {}

    @model_validator(mode="before")
    @classmethod
    def _earlier_names(cls, data: Any) -> Any:
        """Read a field given under its earlier name (a parameters file from before the rename)."""
        if not isinstance(data, dict) or not cls.RENAMED.keys() & data.keys():
            return data
        data = dict(data)
        for earlier, now in cls.RENAMED.items():
            if earlier not in data:
                continue
            if now.name in data:
                raise ValueError(f"{cls.__name__} was given both {earlier!r} and {now.name!r}, which is its "
                                 f"name now; keep only {now.name!r}")
            value = data.pop(earlier)
            data[now.name] = value + now.shift if now.shift and isinstance(value, int) else value
            for field in now.also:
                data.setdefault(field, data[now.name])
            shifted = f" (= {earlier} + {now.shift})" if now.shift else ""
            warnings.warn(f"{cls.__name__}.{earlier} is now {now.name}{shifted}; read {earlier}={value!r} "
                          f"as {now.name}={data[now.name]!r}: rename it in your parameters",
                          FutureWarning, stacklevel=2)
        return data

    def key_fields(self, exclude: set[str] | frozenset[str] = frozenset()) -> dict:
        """The fields as a stage's key reads them: JSON values, renamed fields under their earlier
        names and values, so a rename changes no key."""
        dumped = self.model_dump(mode="json", exclude=set(exclude))
        for earlier, now in self.RENAMED.items():
            if now.name in dumped:
                value = dumped.pop(now.name)
                if all(dumped.get(field) == value for field in now.also):
                    for field in now.also:
                        dumped.pop(field, None)
                dumped[earlier] = value - now.shift if now.shift and isinstance(value, int) else value
        return dumped


class TrainOptions(Options):
    """What every stage's training loop and optimizer read."""

    steps: int = Field(ge=1, description="optimizer steps")
    batch: int = Field(16, ge=1, description="rows (SFT), pairs (DPO), prompts (GRPO) or groups "
                       "(Flow-GRPO) per step")
    learning_rate: float = Field(1e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(1e-4, ge=0, description="decoupled weight decay (AdamW; optax's default)")
    schedule: Literal["constant", "warmup_cosine"] = Field(
        "constant", description="'constant', or 'warmup_cosine': a linear warmup over a tenth of the "
        "steps (50 at most), then a cosine decay to a tenth of the rate at the last step")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the update's global gradient "
                                        "norm to this (empty: no clipping)")
    log_every: int = Field(10, ge=1, description="steps per logged metric window")
    checkpoint_every: int = Field(50, ge=1, description="steps between checkpoints (a retry resumes there)")

    LATER: ClassVar[frozenset[str]] = frozenset({"weight_decay", "schedule", "max_grad_norm", "lora"})


class LoRAOptions(Options):
    """Low-rank adapters on the policy (dew_lib.models.lora, docs/lora.md): with a rank, the
    stage trains adapters on its frozen starting weights, and its reference is those weights
    with the adapters off. The defaults other than `rank` are PEFT's (and `lora.LoRA`'s)."""

    ADAPTERS: ClassVar[Callable[..., lora.LoRA]] = lora.LoRA  # the model's adapter config
    ATTACH: ClassVar[Callable[..., tuple[Any, Any]]] = staticmethod(lora.attach)

    rank: int = Field(0, ge=0, description="the adapters' rank r; 0: no adapters, every weight trains")
    alpha: float = Field(8.0, gt=0, description="the adapters add alpha / r * (x A) B (PEFT's lora_alpha)")
    targets: tuple[str, ...] | Literal["all-linear"] = Field(
        ("q_proj", "v_proj"), description="the projections adapted, among q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj; 'all-linear': all seven (the output head never is)")
    rslora: bool = Field(False, description="scale by alpha / sqrt(r) rather than alpha / r (rank-stabilised)")
    dropout: float = Field(0.0, ge=0, lt=1, description="share of a projection's input dropped on the adapters' "
                           "path in training (PEFT's lora_dropout)")
    # Left out of a dump while "none", so the stages keyed before it existed keep their keys.
    quantize: Literal["none", "int8", "nf4"] = Field(
        "none", exclude_if=lambda value: value == "none",
        description="the frozen base's layer projections under the adapters (QLoRA): 'none' (as loaded), "
        "'int8' (int8 with a float32 scale per output channel), 'nf4' (4-bit NormalFloat with an absmax "
        "per block of 64; needs qwix); needs a rank")

    @model_validator(mode="after")
    def _reads(self) -> LoRAOptions:
        if self.quantize != "none" and self.rank == 0:
            raise ValueError(f"lora.quantize={self.quantize!r} quantizes the frozen base under adapters, and lora.rank "
                             "is 0 (no adapters, every weight trains): set lora.rank > 0, or lora.quantize='none'")
        self.config()
        return self

    def config(self) -> lora.LoRA | None:
        """The adapters these options ask for; None at rank 0."""
        if self.rank == 0:
            return None
        try:
            return self.ADAPTERS(rank=self.rank, alpha=self.alpha, targets=self.targets, rslora=self.rslora,
                                 dropout=self.dropout)
        except ValueError as error:
            raise ValueError(f"lora: {error}") from None

    def attach(self, model, variables, key) -> tuple[Any, Any]:
        """`(model, variables)` with fresh adapters (A drawn from `key`) when a rank is set, else
        as given, as they are when they already carry these adapters. The adapters go on the
        starting weights, which a stage must have; with `quantize`, the base is then quantized once."""
        config = self.config()
        if config is None:
            return model, variables
        if not (getattr(model, "lora", None) == config and lora.has_adapters(variables)):
            if variables is None:
                raise ValueError("lora.rank is set but the stage has no starting weights: adapters train on a "
                                 "frozen model, so start from a trained policy, or set lora.rank=0")
            model, variables = self.ATTACH(model, variables, config, key)
        if self.quantize != "none" and not getattr(model, "quantized", False):
            model, variables = quantize_base(model, variables, bits={"int8": 8, "nf4": 4}[self.quantize])
        return model, variables


class DiTLoRAOptions(LoRAOptions):
    """Low-rank adapters on a SimpleDiT's block projections (models/dit.py)."""

    ADAPTERS = dit.DiTLoRA
    ATTACH = staticmethod(dit.attach)

    targets: tuple[str, ...] | Literal["all-linear"] = Field(
        ("qkv", "attention_out"), description="the block projections adapted, among qkv, attention_out, "
        "mlp_in, mlp_out; 'all-linear': all four")
    quantize: Literal["none"] = Field("none", exclude_if=lambda value: value == "none",
                                      description="'none': the DiT's base is never quantized")


class Adapted(Options):
    """A stage that can train low-rank adapters in place of every weight."""

    lora: LoRAOptions = Field(LoRAOptions.model_validate({}), description="low-rank adapters (rank 0: off)")


class SFTOptions(Adapted, TrainOptions):
    steps: int = Field(3200, ge=1, description="optimizer steps")
    learning_rate: float = Field(3e-3, gt=0, description="peak AdamW learning rate")
    weight_decay: float = Field(0.1, ge=0, description="AdamW's decoupled weight decay; 0.1 lets the "
                                "embedded decoder settle on the carry rule at every seed (docs/pipeline.md)")
    schedule: Literal["constant", "warmup_cosine"] = Field(
        "warmup_cosine", description="'warmup_cosine': a linear warmup over a tenth of the steps (50 "
        "at most), then a cosine decay to a tenth of the rate; or 'constant'")

    LATER = frozenset({"schedule", "max_grad_norm", "lora"})


class DPOOptions(Adapted, TrainOptions):
    steps: int = Field(120, ge=1, description="optimizer steps")
    learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate")
    beta: float = Field(1.0, gt=0, description="the scale of the log-ratio to the reference (larger "
                        "stops pushing sooner; TRL's default is 0.1, the demo's small policy needs 1.0)")
    nll_weight: float = Field(1.0, ge=0, description="weight of the chosen answers' NLL added to the "
                              "DPO loss (RPO; TRL's rpo_alpha); 0 is plain DPO. Only the reference losses "
                              "(sigmoid, ipo, hinge, robust) add it: set 0 for simpo, orpo and kto")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "kto"] = Field(
        "sigmoid", description="the preference loss, under TRL 1.12's names (docs/rl.md): 'sigmoid' "
        "(DPO; cDPO with label_smoothing), 'ipo', 'hinge', 'robust'; 'simpo' and 'orpo' hold no "
        "reference; 'kto' trains each answer alone, chosen ones as desirable, rejected as undesirable")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="the probability that a preference "
                                   "label is flipped: cDPO for 'sigmoid', rDPO for 'robust', and 'simpo' "
                                   "(others refuse it)")
    simpo_gamma: float = Field(0.5, ge=0, description="'simpo': the target margin gamma; the sigmoid reads "
                               "(mean chosen - mean rejected log-prob - gamma / beta)")
    cpo_alpha: float = Field(0.0, ge=0, description="'simpo': weight of CPO's chosen NLL (0: SimPO as "
                             "published; TRL's CPOConfig default is 1.0)")
    desirable_weight: float = Field(1.0, gt=0, description="'kto': weight of the desirable (chosen) answers' loss")
    undesirable_weight: float = Field(1.0, gt=0, description="'kto': weight of the undesirable (rejected) "
                                      "answers' loss")

    LATER = TrainOptions.LATER | {"loss_type", "label_smoothing", "simpo_gamma", "cpo_alpha", "desirable_weight",
                                  "undesirable_weight"}

    @model_validator(mode="after")
    def _family(self) -> DPOOptions:
        check_family("DPOOptions", self.loss_type, self.beta, self.label_smoothing, self.simpo_gamma,
                     self.cpo_alpha, self.nll_weight)
        return self


class GRPOOptions(Adapted, TrainOptions):
    """One GRPO stage: sampling, the loss and its corrections, and, with mode 'async', the
    schedule of the RolloutScheduler (docs/rl.md)."""

    steps: int = Field(60, ge=1, description="optimizer steps")
    learning_rate: float = Field(5e-5, gt=0, description="AdamW learning rate (on the demo, 5e-5 gained "
                                 "more than 5e-6 and 1e-4 at the seeds measured; docs/pipeline.md)")
    batch: int = Field(8, ge=1, description="prompts per step")
    groups: int = Field(8, ge=2, description="completions drawn per prompt (the group; >= 2, since "
                        "group-relative advantages compare each completion with the others)")
    max_new_tokens: int = Field(16, ge=1, description="response budget per completion")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts (greedy "
                               "draws carry no group-relative signal, so 0 is refused)")
    beta: float = Field(0.01, ge=0, description="KL coefficient to the frozen starting policy (0: no "
                        "reference is kept; verl's kl_loss_coef)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="per-token estimate of the KL to the reference (Schulman's k1, k2, k3)")
    advantage_estimator: Literal["group", "mean", "rloo"] = Field(
        "group", description="'group': reward minus the group mean over the group's standard "
        "deviation (GRPO); 'mean': minus the mean only (Dr.GRPO); 'rloo': minus the mean of the others")
    policy_loss: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo", description="'ppo': the clipped token ratio (GRPO, DAPO); 'gspo': the clipped "
        "length-normalised sequence ratio; 'cispo': the clipped ratio as a stopped weight on "
        "REINFORCE (every token keeps its gradient)")
    epsilon_low: float = Field(0.2, ge=0, lt=1, description="the ratio is clipped below at 1 - epsilon_low")
    epsilon_high: float = Field(0.2, ge=0, description="the ratio is clipped above at 1 + epsilon_high "
                                "(DAPO's clip-higher: 0.28)")
    dual_clip: float | None = Field(3.0, gt=1, description="'ppo' loss: bound -A * ratio at this where "
                                    "the advantage is negative (verl's clip_ratio_c); empty: off")
    aggregation: Literal["token-mean", "session-mean"] = Field(
        "token-mean", description="how per-token losses reduce: over every sampled token of the batch, "
        "or per session first, so long answers weigh no more than short ones")
    sequence_mask: Band | None = Field(None, description="reject a whole chain whose summed "
                                       "log-ratio to the behavior policy leaves this (low, high) band "
                                       "of ratios; empty: off")
    geometric_mask: Band | None = Field(None, description="reject a whole chain whose mean per-token "
                                        "ratio to the behavior policy leaves this (low, high) band; empty: off")
    mode: Literal["sync", "async"] = Field(
        "sync", description="'sync': each batch's completions are drawn on the trainer's device "
        "before its update (SampledRollout); 'async': the RolloutScheduler draws them on a rollout "
        "server `ahead` batches early while the trainer updates")
    ahead: int = Field(1, ge=0, description="async: task batches submitted before the trainer reaches them")
    max_lag: int = Field(1, ge=0, description="async: most updates a trained rollout may be behind "
                         "(at least ahead + sync_every - 1)")
    sync_every: int = Field(1, ge=1, description="async: push weights to the server every this many updates")
    oversample: int = Field(0, ge=0, description="async: extra completions per prompt; the first "
                            "`groups` to finish are trained, the stragglers cancelled")
    max_attempts: int = Field(3, ge=1, description="async: failed attempts per sample before its group is given up")
    timeout: float | None = Field(None, gt=0, description="async: seconds after which a running "
                                  "rollout is cancelled and drawn again")
    slots: int = Field(32, ge=1, description="async: requests the rollout server decodes together")
    tensor_parallel_size: int = Field(1, ge=1, description="async: local devices the native rollout server "
                                      "splits the model and its KV cache across (1: one device)")
    behavior_importance: float = Field(2.0, ge=1, description="async: TIS cap on the proximal over "
                                       "behavior likelihood ratio, which lagged rollouts need (>= 1: a "
                                       "cap below 1 would shrink every on-policy token)")
    proximal: Literal["in_update", "bypass"] = Field(
        "in_update", description="async: the policy the clipped ratio compares with. 'in_update': the "
        "weights the update trains (AReaL's decoupled PPO), with each lagged token weighted by the "
        "behavior_importance cap; 'bypass': none, the ratio is current over behavior (verl's bypass "
        "mode: the clip also bounds the lag's drift, and behavior_importance is not used). Sync "
        "rollouts train under the weights that drew them, so their proximal policy is exact")
    routing_replay: Literal["none", "rollout"] = Field(
        "none", description="a mixture-of-experts policy: 'rollout' trains each token through the experts "
        "it was routed to when drawn (verl's R3: recorded by Dew's own sampler and server, and by vLLM and "
        "SGLang run with --enable-return-routed-experts), 'none' lets the trainer's router choose again "
        "(docs/moe.md)")

    LATER = TrainOptions.LATER | {"kl_estimator", "advantage_estimator", "policy_loss", "epsilon_low",
                                  "epsilon_high", "dual_clip", "aggregation", "sequence_mask",
                                  "geometric_mask", "proximal", "routing_replay"}

    @model_validator(mode="after")
    def _schedule(self) -> GRPOOptions:
        if self.mode == "async":
            lag_bound("GRPOOptions", self.max_lag, self.ahead, self.sync_every)
        elif self.proximal != "in_update":
            raise ValueError(f"GRPOOptions.proximal={self.proximal!r} chooses the proximal policy of lagged "
                             "rollouts, and mode='sync' has none (each batch trains under the weights that "
                             "drew it); set mode='async', or leave proximal='in_update'")
        for name in ("sequence_mask", "geometric_mask"):
            band = getattr(self, name)
            if band is not None and not 0 <= band[0] < 1 < band[1]:
                raise ValueError(f"GRPOOptions.{name}={band} must satisfy 0 <= low < 1 < high: it bounds "
                                 "the ratio of the training policy to the behavior policy")
        return self

    def objective(self, model, variables, width: int, *, lagged: bool = False) -> GRPOObjective:
        """The GRPOObjective these options choose, on rows `width` ids wide, with `variables` as
        the frozen reference. lagged: rollouts may come from older weights (async), so the
        objective caps the proximal over behavior ratio at `behavior_importance` (TIS), unless
        `proximal` is 'bypass', whose ratio already is current over behavior."""
        capped = lagged and self.proximal == "in_update"
        correction = {"behavior_importance": self.behavior_importance} if capped else {}
        return GRPOObjective(model, width - 1, pretrained=variables, beta=self.beta, policy_loss=self.policy_loss,
                             epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                             dual_clip=self.dual_clip, aggregation=self.aggregation,
                             sequence_mask=self.sequence_mask, geometric_mask=self.geometric_mask,
                             kl_estimator=self.kl_estimator, sampling_temperature=self.temperature,
                             routing_replay=self.routing_replay, **correction)

    def sampling(self, eos_id: int | Sequence[int] | None) -> Sampling:
        """How the rollouts draw: at `temperature`, ending at `eos_id` (the tokenizer's end-of-turn
        id or ids; None: only the budget ends a completion)."""
        return Sampling(temperature=self.temperature, eos_id=eos_id)

    def check_ppo(self) -> None:
        """Refuse what PPO's objective does not train: it clips the token ratio ('ppo') with
        token-mean aggregation, its advantages come from GAE, and it corrects lag only by TIS."""
        chosen = {name: getattr(self, name) for name, plain in PPO_POLICY.items() if getattr(self, name) != plain}
        if chosen:
            wanted = ", ".join(f"{name}={value!r}" for name, value in PPO_POLICY.items())
            raise ValueError(f"PPO trains with {wanted} (its critic and GAE replace the group baseline); "
                             f"the GRPO options set {', '.join(f'{k}={v!r}' for k, v in chosen.items())}: "
                             "reset them, or train GRPO")


# What PPO's objective trains; GRPO's options that PPO reads must keep these values.
PPO_POLICY = {"policy_loss": "ppo", "aggregation": "token-mean", "advantage_estimator": "group",
              "sequence_mask": None, "geometric_mask": None, "proximal": "in_update"}


class EpisodeOptions(Options):
    """The shape of a tool episode: how many turns, how much context a turn reads."""

    max_turns: int = Field(2, ge=1, description="model turns per episode (a call, then the answer)")
    max_prompt_len: int = Field(64, ge=1, description="ids a turn may read: the prompt, earlier turns "
                                "and the tool's answers; a longer context truncates the episode (the "
                                "library's EpisodeRollout.max_prompt_tokens)")
    workers: int = Field(8, ge=1, description="threads that step the episodes' tools at once")

    RENAMED = {"max_context": Renamed("max_prompt_len")}


class PPOOptions(Options):
    """PPO with a critic in place of GRPO's group baseline: a ValueHead on a copy of the starting
    policy, GAE targets, one-turn prompts trained as one-turn episodes. The policy side (sampling,
    clip range, KL) is the GRPO options'."""

    value_coefficient: float = Field(0.5, ge=0, description="weight of the critic's value loss")
    value_clip: float = Field(0.2, gt=0, description="how far a value may move from the one recorded at "
                              "sampling before its error is clipped (verl's cliprange_value)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per sampled token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    epochs: int = Field(1, ge=1, description="passes over each collection of episodes (each pass "
                        "counts `minibatches` of the stage's steps)")
    minibatches: int = Field(1, ge=1, description="slices each pass is trained in, one step each")
    critic_learning_rate: float | None = Field(5e-4, gt=0, description="the critic's AdamW rate, 10x "
                                               "the policy's default as in verl (empty: the policy's "
                                               "learning_rate, which leaves the critic far behind)")


class ImageTrainOptions(TrainOptions):
    """The image stages' training: plain Adam, unclipped (their checkpoints hold Adam's state)."""

    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (0: plain Adam)")
    max_grad_norm: float | None = Field(None, gt=0, description="clip the update's global gradient "
                                        "norm to this (empty: no clipping)")


class FlowPretrainOptions(ImageTrainOptions):
    """Flow-matching pre-training of an image model."""

    steps: int = Field(800, ge=1, description="optimizer steps")
    batch: int = Field(32, ge=1, description="images per step")
    learning_rate: float = Field(2e-3, gt=0, description="Adam learning rate")
    log_every: int = Field(100, ge=1, description="steps per logged metric window and preview")
    checkpoint_every: int = Field(200, ge=1, description="steps between checkpoints (a retry resumes there)")
    preview_steps: int = Field(11, ge=2, description="time points of the deterministic preview sampler")


class FlowGRPOOptions(ImageTrainOptions):
    """Flow-GRPO on an unconditioned image model: SDE rollouts scored by a reward."""

    lora: DiTLoRAOptions = Field(DiTLoRAOptions.model_validate({}), description="low-rank adapters on the DiT's blocks "
                                 "(rank 0: off)")

    steps: int = Field(40, ge=1, description="optimizer steps (one rollout each)")
    batch: int = Field(8, ge=1, description="groups per step (unconditioned: rows of fresh noise)")
    groups: int = Field(4, ge=2, description="samples per group (>= 2: a group of one has no relative "
                        "advantage)")
    learning_rate: float = Field(1e-3, gt=0, description="Adam learning rate")
    log_every: int = Field(5, ge=1, description="steps per logged metric window and preview")
    checkpoint_every: int = Field(20, ge=1, description="steps between checkpoints (a retry resumes there)")
    rollout_steps: int = Field(6, ge=2, description="time points of a rollout path (both ends: 6 is "
                               "five SDE transitions)")
    train_steps: int | None = Field(None, ge=1, description="train on the first this many "
                                    "transitions of each path (empty: all)")
    beta: float = Field(0.05, ge=0, description="weight of the transition KL to the pre-trained model")
    epsilon_low: float = Field(1e-4, gt=0, lt=1, description="the per-coordinate ratio is clipped below "
                               "at 1 - epsilon_low (the library's FlowGRPOObjective.clip_range)")
    epsilon_high: float = Field(1e-4, gt=0, description="the per-coordinate ratio is clipped above at "
                                "1 + epsilon_high (FlowGRPOObjective.clip_range_high)")
    noise_level: float = Field(0.7, ge=0, description="the SDE's exploration noise (a in "
                               "sigma = a sqrt(t / (1 - t)))")
    preview_steps: int = Field(11, ge=2, description="time points of the deterministic preview sampler")

    # One clip_range was both bounds: while they are equal, the key reads them as it.
    RENAMED = {"clip_range": Renamed("epsilon_low", also=("epsilon_high",))}


def _adam(rate: optax.ScalarOrSchedule, weight_decay: float) -> optax.GradientTransformation:
    """AdamW, or plain Adam without decay: the same updates, and the state earlier image-stage
    checkpoints hold, so they still restore."""
    return optax.adam(rate) if weight_decay == 0 else optax.adamw(rate, weight_decay=weight_decay)


def optimizer(options: TrainOptions, critic_learning_rate: float | None = None) -> optax.GradientTransformation:
    """The stage's optimizer: AdamW at `options.learning_rate` on `options.schedule`, its global
    gradient norm clipped to `max_grad_norm`. With `critic_learning_rate`, PPO's
    `{"policy", "critic"}` tree: the critic takes its own constant rate."""
    rate: optax.ScalarOrSchedule = options.learning_rate
    if options.schedule == "warmup_cosine":
        rate = optax.warmup_cosine_decay_schedule(0.0, options.learning_rate, min(50, options.steps // 10 + 1),
                                                  options.steps, options.learning_rate / 10)
    update = _adam(rate, options.weight_decay)
    if critic_learning_rate is not None:
        critic = _adam(critic_learning_rate, options.weight_decay)
        update = split_optimizer(update, critic)
    if options.max_grad_norm is None:
        return update
    return optax.chain(optax.clip_by_global_norm(options.max_grad_norm), update)


__all__ = ["DPOOptions", "EpisodeOptions", "FlowGRPOOptions", "FlowPretrainOptions", "GRPOOptions",
           "Options", "PPOOptions", "Renamed", "SFTOptions", "TrainOptions", "optimizer"]
