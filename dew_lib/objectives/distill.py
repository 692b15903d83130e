"""DistillObjective: on-policy distillation of a student from a frozen teacher on packed rows.

The batch is the packed-rows layout (`dew_lib.rollouts.pack`, `[R, W]` with W = seq_len + 1), as
`DistillRollout` (rollouts/distill.py) builds it from the student's own samples or a dataset's
completions. Input position i predicts id i + 1; a prediction counts where `response_mask` marks
id i + 1 (sampled or completion ids, EOS included; never prompt or padding), which is TRL's
`labels != -100` after its shift.

Two losses, picked from `LOSSES` by name:

  "jsd"         TRL 1.12 `GKDTrainer.generalized_jsd_loss`: at every counted position the
                generalized Jensen-Shannon divergence between the student's and the teacher's whole
                next-token distributions at `temperature`; beta = 0 is the forward KL(teacher ||
                student), beta = 1 the reverse KL(student || teacher), in between
                beta KL(teacher || m) + (1 - beta) KL(student || m) with m = beta teacher +
                (1 - beta) student. Reduced as TRL's 'batchmean' with labels: summed over the
                counted positions and divided by their number. (TRL's GKDTrainer samples at its
                temperature but calls this loss at 1; `temperature` here is the loss's own.)
  "reverse_kl"  prime-rl's on-policy distillation (OPD): the per-token reverse KL on the sampled
                ids, log p_student(y_t) - log p_teacher(y_t), is a per-token negative advantage of
                a policy-gradient loss (the PPO surrogate of `algorithms`, on policy: ratio 1, so
                its gradient is -A grad log p). Its value is the mean sampled-token KL; it is an
                unbiased KL gradient only on the student's own samples (lmbda = 1).

The teacher is a frozen Dew decoder of the same vocabulary (possibly a larger config of the same
family) held like DPO's reference: `reference_params` returns its variables, so the Trainer keeps
them in `TrainState.ema` with decay 1 (sharded with the state, saved in checkpoints) and hands them
to `terms` as `reference`; `ema_decay` is 1.0 and they are never updated.

Or the teacher is remote (`teacher=RemoteTeacher(...)`, dew_lib/inference/remote_teacher.py, with
no `teacher_model`): an engine that reports only its log-prob of each given id. Then DistillRollout
asks it for the rows it packs and puts them in the batch as `teacher_log_probs` `[R, W]` (aligned
to `input_ids`), which the loss reads where the local teacher's `score_targets` would be: the same
"reverse_kl" loss and metrics. `ema_decay` is None (nothing to hold in the state). The engine's
log-probs are its raw model's, so only `temperature=1` is served, and "jsd" (every beta: even
beta = 1 is the exact reverse KL over the whole vocabulary) needs the teacher's whole distribution
and is refused.

Metrics (each `(sum, count)`): loss; kl, the mean per-token reverse KL on the sampled ids
(log p_student - log p_teacher at `temperature`); tokens; completions/mean_length;
on_policy (share of rows the student sampled, when the batch says); entropy of the student (jsd
only, where the whole distribution is at hand). Validation (`evaluate`, on packed rows such as a
held-out set's completions): the exact per-position reverse KL over the vocabulary, the sampled-
token kl and the loss, scored against the teacher variables the objective was built with.

Not here: sampling and the on-policy/dataset mix (rollouts/distill.py), the HTTP requests to a
remote teacher (inference/remote_teacher.py), chunked JSD over a large vocabulary (the jsd loss holds the
`[R, W - 1, V]` logits of both models), a mixture-of-experts student's router terms, the
pipeline stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.data.dataset import describe
from dew_lib.models import lora
from dew_lib.objectives import algorithms
from dew_lib.objectives.base import LossTerms, Metrics, Objective, check_token_ids
from dew_lib.objectives.lm import dropout_rngs, score_targets
from dew_lib.objectives.policy import check_pretrained, check_seq_len, initial_variables
from dew_lib.options import choice

FIELDS = ("input_ids", "text_segment_ids", "text_positions", "response_mask")
ALIGNED = FIELDS + ("session_index", "session_weights", "on_policy", "teacher_log_probs")
REMOTE = "teacher_log_probs"  # [R, W]: a remote teacher's log-prob of each id, aligned to input_ids


# ----- the divergences, on plain logits ---------------------------------------------------------

def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float = 1.0):
    """Per-position generalized JSD `[...]` of logits `[..., V]`, summed over the vocabulary,
    with TRL 1.12's `generalized_jsd_loss` definitions (see the module docstring). beta is a
    Python number: 0 and 1 are TRL's exact KL branches, with no mixture."""
    student = jax.nn.log_softmax(student_logits / temperature, axis=-1)
    teacher = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
    if beta == 0:
        return _kl(teacher, student)  # forward KL(teacher || student)
    if beta == 1:
        return _kl(student, teacher)  # reverse KL(student || teacher)
    b = jnp.asarray(beta, student.dtype)
    mixture = jnp.logaddexp(student + jnp.log1p(-b), teacher + jnp.log(b))
    return b * _kl(teacher, mixture) + (1 - b) * _kl(student, mixture)


def _kl(log_p, log_q):
    """KL(p || q) over the last axis from log-probabilities (torch's kl_div(log_q, log_p,
    log_target=True) summed over the vocabulary)."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def generalized_jsd_loss(student_logits, teacher_logits, mask=None, *, beta: float = 0.5,
                         temperature: float = 1.0):
    """TRL's reduced loss ('batchmean'): with `mask` `[B, T]` (TRL's labels != -100) the sum over
    the counted positions divided by their number (at least 1); without it the sum over every
    position divided by the batch size B."""
    jsd = generalized_jsd(student_logits, teacher_logits, beta, temperature)  # [B, T]
    if mask is None:
        return jsd.sum() / max(jsd.shape[0], 1)
    mask = mask.astype(jsd.dtype)
    return (jsd * mask).sum() / jnp.maximum(mask.sum(), 1)


def opd_surrogate(student_log_probs, teacher_log_probs, mask):
    """prime-rl's OPD loss per token `[R, T]` and the sampled-token reverse KL it is built on.

    The advantage of each sampled id is -(log p_student - log p_teacher), detached, and the loss
    is `algorithms.ppo_loss` with the proximal policy the detached student itself (on policy:
    the ratio is 1 and never clips), so d loss = (log p_s - log p_t) d log p_s.
    """
    kl = algorithms.k1(student_log_probs, teacher_log_probs)  # [R, T]
    advantages = -jax.lax.stop_gradient(kl)
    surrogate = algorithms.ppo_loss(student_log_probs, jax.lax.stop_gradient(student_log_probs),
                                    advantages, mask, None, algorithms.Clip())
    return surrogate.loss, kl


# ----- the objective ---------------------------------------------------------------------------

class Scored(NamedTuple):
    """What one loss computes of a packed batch: the per-token loss and sampled-token reverse KL
    `[R, T]`, and the student's entropy per position (None where the loss does not have it)."""

    loss: jax.Array
    kl: jax.Array
    entropy: jax.Array | None


def _jsd_terms(objective: DistillObjective, params, teacher, rows, key, teacher_scores=None) -> Scored:
    del teacher_scores  # a remote teacher is refused for jsd
    inputs, targets, segments, positions = rows
    student = objective.model.apply(params, inputs, segments, positions,
                                    rngs=dropout_rngs(key)).astype(jnp.float32)  # [R, T, V]
    teacher_logits = objective.teacher_model.apply(teacher, inputs, segments, positions).astype(jnp.float32)
    jsd = generalized_jsd(student, teacher_logits, objective.beta, objective.temperature)  # [R, T]
    log_s = jax.nn.log_softmax(student / objective.temperature, axis=-1)
    log_t = jax.nn.log_softmax(teacher_logits / objective.temperature, axis=-1)
    picked_s = jnp.take_along_axis(log_s, targets[..., None], axis=-1)[..., 0]
    picked_t = jnp.take_along_axis(log_t, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_s) * log_s, axis=-1)
    return Scored(jsd, jax.lax.stop_gradient(picked_s - picked_t), jax.lax.stop_gradient(entropy))


def _reverse_kl_terms(objective: DistillObjective, params, teacher, rows, key, teacher_scores=None) -> Scored:
    inputs, targets, segments, positions = rows
    student, _ = score_targets(objective.model, params, inputs, targets, segments, positions,
                               temperature=objective.temperature, dropout_key=key)
    if teacher_scores is None:  # a local teacher; a remote one's come in the batch
        teacher_scores, _ = score_targets(objective.teacher_model, teacher, inputs, targets, segments,
                                          positions, temperature=objective.temperature)
    loss, kl = opd_surrogate(student, teacher_scores, None)
    return Scored(loss, jax.lax.stop_gradient(kl), None)


LOSSES: dict[str, Callable[..., Scored]] = {"jsd": _jsd_terms, "reverse_kl": _reverse_kl_terms}


def _check_remote(teacher_model, loss: str, beta: float, temperature: float) -> None:
    """Refuse what a teacher that reports only its raw log-prob of each given id cannot serve."""
    if teacher_model is not None:
        raise ValueError("DistillObjective got a RemoteTeacher as teacher and a teacher_model too; a remote "
                         "teacher runs on its engine: leave teacher_model out")
    if loss != "reverse_kl":
        raise ValueError(
            f"DistillObjective(loss={loss!r}, beta={beta}) compares the teacher's whole next-token "
            "distribution with the student's (beta=1 too: the exact reverse KL over the vocabulary), and a "
            "RemoteTeacher reports only its log-prob of each sampled id; use loss='reverse_kl' (the "
            "sampled-token reverse KL, prime-rl's OPD), or a local teacher (teacher_model and its "
            "variables) for jsd")
    if temperature != 1.0:
        raise ValueError(f"DistillObjective.temperature={temperature}: a RemoteTeacher's engine reports its raw "
                         "model's log-probs (temperature 1); use temperature=1.0, or a local teacher")


class DistillObjective(Objective):
    """On-policy distillation of `model` (the student) from a frozen teacher.

    seq_len: the packed row width minus one. teacher_model, teacher: the teacher decoder and its
    full Flax variables (outer 'params' included); it must share the student's vocabulary. Or
    teacher: a `RemoteTeacher` and no teacher_model (loss "reverse_kl", temperature 1).
    loss: "jsd" (TRL's GKD generalized JSD) or "reverse_kl" (prime-rl's OPD). beta: the JSD's
    interpolation in [0, 1] (0 forward KL, 1 reverse KL; read by "jsd" only). temperature: both
    distributions are softmax(logits / temperature). pretrained: the student's starting
    variables (None: a fresh init).
    """

    def __init__(self, model, seq_len: int, *, teacher_model=None, teacher, loss: str = "jsd",
                 beta: float = 0.5, temperature: float = 1.0, pretrained: Any = None):
        check_seq_len("DistillObjective", model, seq_len)
        check_pretrained("DistillObjective", pretrained)
        choice("DistillObjective.loss", loss, tuple(LOSSES))
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"DistillObjective.beta must lie in [0, 1] (0: forward KL, 1: reverse KL, "
                             f"between: the generalized JSD), got {beta}")
        if not temperature > 0:
            raise ValueError(f"DistillObjective.temperature must be positive, got {temperature}")
        from dew_lib.inference.remote_teacher import RemoteTeacher  # here: inference imports objectives

        self.remote = isinstance(teacher, RemoteTeacher)
        if self.remote:
            _check_remote(teacher_model, loss, beta, temperature)
        else:
            self._check_local(model, seq_len, teacher_model, teacher)
        self.model = model
        self.seq_len = seq_len
        self.teacher_model = teacher_model
        self.teacher = teacher
        self.loss = loss
        self.beta = float(beta)
        self.temperature = float(temperature)
        self.pretrained = pretrained
        # TrainState.ema holds a local teacher, frozen; a remote one is nothing to hold
        self.ema_decay = None if self.remote else 1.0

    @staticmethod
    def _check_local(model, seq_len, teacher_model, teacher) -> None:
        if teacher_model is None:
            raise ValueError("DistillObjective.teacher_model is None: pass the teacher's decoder with its "
                             "variables as teacher, or a RemoteTeacher as teacher")
        check_seq_len("DistillObjective (the teacher)", teacher_model, seq_len)
        check_pretrained("DistillObjective.teacher", teacher)
        student_vocab = getattr(model, "vocab_size", None)
        teacher_vocab = getattr(teacher_model, "vocab_size", None)
        if student_vocab != teacher_vocab:
            raise ValueError(
                f"DistillObjective needs a teacher and a student that share a vocabulary: the student's "
                f"vocab_size is {student_vocab} and the teacher's is {teacher_vocab}. Distillation "
                "compares their next-token distributions id by id, so both must use one tokenizer; "
                "build the student with the teacher's tokenizer and vocab_size (or pick a teacher "
                "trained with the student's)"
            )
        if lora.has_adapters(teacher):
            raise ValueError("DistillObjective.teacher holds LoRA adapters; fold them into the base "
                             "first (dew_lib.models.lora.merged) so the teacher is one plain decoder")

    @property
    def width(self) -> int:
        """The packed row width this objective reads."""
        return self.seq_len + 1

    def init(self, key, variables=None):
        return initial_variables(self.model, self.pretrained, key, self.seq_len, variables)

    def reference_params(self, params):
        """The teacher's variables: what `TrainState.ema` holds, whatever the student's params."""
        del params
        return self.teacher

    # ----- host checks -----------------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse, on the host, a batch that is not packed rows of this width."""
        missing = [name for name in FIELDS if name not in batch]
        if missing:
            raise KeyError(
                f"DistillObjective needs the packed-rows fields {missing} (a Prompts batch must go "
                f"through DistillRollout first); the batch has {describe(batch)}"
            )
        shape = np.shape(batch["input_ids"])
        if len(shape) != 2 or shape[1] != self.width:
            raise ValueError(
                f"batch field 'input_ids' has shape {shape}, expected [rows, seq_len + 1] = "
                f"[rows, {self.width}]; DistillObjective(seq_len=...) must be the prompt width plus "
                "the response budget, less one"
            )
        for name in ALIGNED:
            expected = shape[:1] if name == "on_policy" else shape  # on_policy: one flag per row
            if name in batch and np.shape(batch[name]) != expected:
                raise ValueError(f"batch field {name!r} has shape {np.shape(batch[name])}, expected "
                                 f"{expected}: packed columns are aligned with input_ids {shape}")
        if self.remote and REMOTE not in batch:
            raise KeyError(f"DistillObjective with a remote teacher reads the teacher's log-probs from the batch "
                           f"field {REMOTE!r}, which DistillRollout adds (RemoteTeacher.annotate adds it to "
                           f"other packed rows); the batch has {describe(batch)}")
        check_token_ids("input_ids", batch["input_ids"], self.model)

    # ----- the loss ----------------------------------------------------------------------------
    @staticmethod
    def _rows(batch):
        ids = batch["input_ids"]
        return ids[:, :-1], ids[:, 1:], batch["text_segment_ids"][:, :-1], batch["text_positions"][:, :-1]

    def sampled_kl(self, params, teacher, batch) -> jax.Array:
        """Per-token reverse KL on the counted ids, log p_student - log p_teacher at
        `temperature`, `[R, W - 1]` (0 off `response_mask`): what a session's reward reads."""
        inputs, targets, segments, positions = self._rows(batch)
        student, _ = score_targets(self.model, params, inputs, targets, segments, positions,
                                   temperature=self.temperature)
        scores = self._teacher_scores(batch)
        if scores is None:
            scores, _ = score_targets(self.teacher_model, teacher, inputs, targets, segments, positions,
                                      temperature=self.temperature)
        return (student - scores) * batch["response_mask"][:, 1:]

    def _teacher_scores(self, batch):
        """A remote teacher's log-prob of each target `[R, W - 1]`, from the batch; None for a local one."""
        return batch[REMOTE][:, 1:].astype(jnp.float32) if self.remote else None

    def terms(self, params, batch, *, step, reference, key) -> LossTerms:
        del step
        if reference is None and not self.remote:
            raise ValueError("DistillObjective needs the teacher in TrainState.ema (its ema_decay is 1.0)")
        teacher = None if self.remote else jax.lax.stop_gradient(reference)
        mask = batch["response_mask"][:, 1:].astype(jnp.float32)  # [R, T]
        scored = LOSSES[self.loss](self, params, teacher, self._rows(batch), key, self._teacher_scores(batch))
        total, count = algorithms.token_mean(scored.loss, mask, None)
        metrics: Metrics = {
            "loss": (total, count),
            "kl": ((scored.kl * mask).sum(), count),
            "tokens": (count, jnp.ones(())),
        }
        if scored.entropy is not None:
            metrics["entropy"] = ((scored.entropy * mask).sum(), count)
        if "session_weights" in batch:  # each session's sampled ids sum to 1
            metrics["completions/mean_length"] = (count, batch["session_weights"][:, 1:].astype(jnp.float32).sum())
        if "on_policy" in batch:
            on_policy = batch["on_policy"].astype(jnp.float32)  # [R]
            metrics["on_policy"] = (on_policy.sum(), jnp.asarray(on_policy.shape[0], jnp.float32))
        return LossTerms(total, count, metrics)

    # ----- validation --------------------------------------------------------------------------
    def evaluate(self, params, batch) -> Metrics:
        """The exact reverse KL(student || teacher) per counted position (over the vocabulary),
        the sampled-token kl and the loss, against the teacher this objective was built with. A
        remote teacher gives no whole distribution: kl and loss only, from the batch's
        `teacher_log_probs` (`RemoteTeacher.annotate`)."""
        inputs, targets, segments, positions = self._rows(batch)
        mask = batch["response_mask"][:, 1:].astype(jnp.float32)
        if self.remote:
            scored = _reverse_kl_terms(self, params, None, (inputs, targets, segments, positions), None,
                                       self._teacher_scores(batch))
            return {"kl": ((scored.kl * mask).sum(), mask.sum()), "loss": ((scored.loss * mask).sum(), mask.sum())}
        student = self.model.apply(params, inputs, segments, positions).astype(jnp.float32)
        teacher = self.teacher_model.apply(self.teacher, inputs, segments, positions).astype(jnp.float32)
        exact = generalized_jsd(student, teacher, 1.0, self.temperature)  # [R, T]
        scored = LOSSES[self.loss](self, params, self.teacher, (inputs, targets, segments, positions), None)
        count = mask.sum()
        return {"reverse_kl": ((exact * mask).sum(), count), "kl": ((scored.kl * mask).sum(), count),
                "loss": ((scored.loss * mask).sum(), count)}


__all__ = ["LOSSES", "DistillObjective", "generalized_jsd", "generalized_jsd_loss", "opd_surrogate"]
