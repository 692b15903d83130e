"""The DPO family's fixture from TRL 1.12's own trainers (run by `tools/parity_dpo.py --family`).

Writes tests/fixtures/parity/dpo_family_trl.json. Every case runs a TRL trainer's loss method,
unbound, on a stand-in `self` whose settings come from TRL's own config class, and a stand-in
model. The model's "logits" carry the given per-token log-probs in one channel, and TRL's
`selective_log_softmax` and `nn.CrossEntropyLoss` are replaced, in the trainer modules only, by
functions that read that channel: the log-softmax step is the model's (Dew's `score_targets` is
checked against transformers elsewhere); every step after it (masking, sums, averages, the
losses, the NLL means, the KL baseline, the logged metrics) is TRL's code. Gradients are torch
autograd through it, with respect to the per-token log-probs.

    cases (kind "pair", Dew's PreferencePairs layout [B, 2, S], 0 chosen, 1 rejected):
      sigmoid, ipo, hinge, robust   DPOTrainer._compute_loss, loss_type [name], reference sums
                                    given (precompute_ref_log_probs)
      cdpo                          TRL 1.12's DPOTrainer reads no label_smoothing for
                                    'sigmoid', so cDPO runs CPOTrainer.cpo_loss (loss_type
                                    'sigmoid', the conservative formula) on the log-ratios
      simpo, cpo_simpo              CPOTrainer.get_batch_loss_metrics, loss_type 'simpo'
                                    (cpo_simpo: cpo_alpha 1 and label smoothing)
      orpo                          ORPOTrainer.get_batch_loss_metrics (the NLL over prompt and
                                    completion: attention_mask marks every real token)
    inputs: token_log_probs float32 [B, 2, S], completion_mask int32 [B, 2, S], attention_mask
      int32 [B, 2, S] (1 up to the last completion token), reference_log_probs float32 [B, 2]
    outputs: loss [], metrics (TRL's logged means), pair_loss, chosen_rewards, rejected_rewards
      [B] (DPOTrainer: TRL run on each pair alone; CPO/ORPO: the per-pair vectors their loss
      functions return, ORPO's with the sign it enters the loss), grad_token_log_probs [B, 2, S]

    cases (kind "kto", TRL's unpaired layout, B rows):
      kto, kto_clamped              KTOTrainer._compute_loss; kto_clamped's reference puts the
                                    mismatched pairs' mean log-ratio below 0, so the baseline
                                    clamps to 0
    inputs: token_log_probs [B, S], completion_mask [B, S], label int32 [B], kl_token_log_probs
      [B, S] (row i: prompt i with completion i-1, as TRL rotates), kl_completion_mask [B, S],
      reference_log_probs [B], reference_kl_log_probs [B]
    outputs: loss [], metrics (kl, rewards/chosen, rewards/rejected, logps/...), kl [],
      grad_token_log_probs [B, S] (the KL rows get none: TRL scores them under no_grad)
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from types import MethodType, SimpleNamespace

import _parity_io as io

SEED = 20261206
PAIRS, LENGTH, EXAMPLES = 6, 10, 8
SPANS = [((2, 7), (2, 9)), ((4, 10), (4, 5)), ((1, 3), (1, 10)), ((3, 8), (3, 8)),
         ((5, 9), (5, 6)), ((2, 6), (2, 4))]  # (start, stop) of each pair's chosen and rejected completion


class _Accelerator:
    device = None

    @staticmethod
    def gather(tensor):
        return tensor

    gather_for_metrics = gather

    @staticmethod
    def unwrap_model(model):
        return model


class _Channel:
    """A model whose logits are the given per-token log-probs: row `input_ids[:, 0]` of `table`,
    shifted so that position t carries log p(token t + 1), in a vocabulary of one."""

    training = True

    def __init__(self, torch, table):
        self.torch, self.table = torch, table  # [rows, S]

    def __call__(self, input_ids=None, *args, **kwargs):
        rows = self.table[input_ids[:, 0]]
        shifted = self.torch.cat([rows[:, 1:], self.torch.zeros_like(rows[:, :1])], dim=1)
        return SimpleNamespace(logits=shifted[..., None], aux_loss=None)


def _read_channel(logits, index):
    return logits[..., 0] + 0.0  # a fresh tensor: TRL writes zeros into it in place


class _CrossEntropy:
    """nn.CrossEntropyLoss (mean, ignore_index -100) with the log-softmax read from the channel."""

    def __call__(self, logits, labels):
        kept = (labels != -100).to(logits.dtype)
        return -(logits[:, 0] * kept).sum() / kept.sum()


class _NN:
    """torch.nn, but CrossEntropyLoss is `_CrossEntropy`."""

    def __init__(self, nn):
        self._nn = nn

    def __getattr__(self, name):
        return _CrossEntropy if name == "CrossEntropyLoss" else getattr(self._nn, name)


def patch_modules(torch) -> dict:
    """Point the trainer modules at the channel readers; returns the modules, keyed by trainer."""
    import trl.experimental.cpo.cpo_trainer as cpo
    import trl.experimental.orpo.orpo_trainer as orpo
    import trl.trainer.dpo_trainer as dpo
    import trl.trainer.kto_trainer as kto

    for module in (dpo, kto, cpo, orpo):
        module.selective_log_softmax = _read_channel
    for module in (cpo, orpo):
        module.nn = _NN(torch.nn)
    return {"dpo": dpo, "kto": kto, "cpo": cpo, "orpo": orpo}


def _pair_inputs(torch):
    generator = torch.Generator().manual_seed(SEED)
    token_log_probs = -torch.rand(PAIRS, 2, LENGTH, generator=generator) * 2.0 - 0.05
    completion_mask = torch.zeros(PAIRS, 2, LENGTH, dtype=torch.int64)
    attention_mask = torch.zeros(PAIRS, 2, LENGTH, dtype=torch.int64)
    for pair, sides in enumerate(SPANS):
        for side, (start, stop) in enumerate(sides):
            completion_mask[pair, side, start:stop] = 1
            attention_mask[pair, side, :stop] = 1
    stacked = _stack(token_log_probs)
    kept = _stack(completion_mask)[:, 1:] != 0
    policy = torch.where(kept, stacked[:, 1:], torch.zeros(())).sum(1).reshape(2, PAIRS).T
    reference = policy + torch.randn(PAIRS, 2, generator=generator) * 2.0
    reference[0] = policy[0]  # a pair equal to its reference
    return token_log_probs, completion_mask, attention_mask, reference


def _stack(pairs):
    """[B, 2, ...] -> [2B, ...] as TRL batches pairs: every chosen row, then every rejected row."""
    return pairs.transpose(0, 1).reshape(2 * pairs.shape[0], *pairs.shape[2:])


def _dpo_self(torch, modules, loss_type, **config):
    from trl import DPOConfig

    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, loss_type=[loss_type], report_to=[], use_cpu=True, bf16=False, **config)
    return SimpleNamespace(
        beta=args.beta, precompute_ref_logps=True, loss_types=args.loss_type,
        loss_weights=args.loss_weights or [1.0], ld_alpha=args.ld_alpha,
        f_divergence_type=args.f_divergence_type, f_alpha_divergence_coef=args.f_alpha_divergence_coef,
        label_smoothing=args.label_smoothing, use_weighting=args.use_weighting, aux_loss_enabled=False,
        accelerator=_Accelerator, _total_train_tokens=0, args=args,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )


def _run_dpo(torch, trl_self, tokens, completion_mask, reference):
    from trl.trainer.dpo_trainer import DPOTrainer

    pairs = tokens.shape[0]
    model = _Channel(torch, _stack(tokens))
    trl_self.model = model
    trl_self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    ids = torch.zeros(2 * pairs, LENGTH, dtype=torch.int64)
    ids[:, 0] = torch.arange(2 * pairs)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "completion_mask": _stack(completion_mask),
              "ref_chosen_logps": reference[:, 0], "ref_rejected_logps": reference[:, 1]}
    loss = DPOTrainer._compute_loss(trl_self, model, inputs, return_outputs=False)
    metrics = {k: float(v[-1]) for k, v in trl_self._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}
    return loss, metrics


def dpo_case(torch, modules, name, loss_type, inputs, **config):
    tokens, completion_mask, attention_mask, reference = inputs
    trl_self = _dpo_self(torch, modules, loss_type, **config)
    leaf = tokens.clone().requires_grad_(True)
    loss, metrics = _run_dpo(torch, trl_self, leaf, completion_mask, reference)
    loss.backward()
    per_pair = defaultdict(list)
    for pair in range(PAIRS):
        one, logged = _run_dpo(torch, trl_self, tokens[pair:pair + 1], completion_mask[pair:pair + 1],
                               reference[pair:pair + 1])
        per_pair["pair_loss"].append(float(one))
        per_pair["chosen_rewards"].append(logged["rewards/chosen"])
        per_pair["rejected_rewards"].append(logged["rewards/rejected"])
    return _pair_case(torch, name, {"loss_type": loss_type, "beta": trl_self.beta,
                                    "label_smoothing": trl_self.label_smoothing},
                      "trl.trainer.dpo_trainer.DPOTrainer._compute_loss", inputs, loss, metrics,
                      per_pair, leaf.grad)


def cdpo_case(torch, modules, inputs, beta, label_smoothing):
    """cDPO: CPOTrainer.cpo_loss ('sigmoid', label-smoothed) fed the log-ratios to the reference."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tokens, completion_mask, attention_mask, reference = inputs
    with tempfile.TemporaryDirectory() as tmp:
        args = CPOConfig(output_dir=tmp, loss_type="sigmoid", beta=beta, label_smoothing=label_smoothing,
                         report_to=[], use_cpu=True, bf16=False)
    trl_self = SimpleNamespace(alpha=args.alpha, loss_type=args.loss_type, beta=args.beta,
                               label_smoothing=args.label_smoothing, accelerator=_Accelerator)
    leaf = tokens.clone().requires_grad_(True)
    kept = _stack(completion_mask)[:, 1:] != 0
    policy = torch.where(kept, _stack(leaf)[:, 1:], torch.zeros(())).sum(1).reshape(2, PAIRS).T
    losses, chosen, rejected = CPOTrainer.cpo_loss(trl_self, policy[:, 0] - reference[:, 0],
                                                   policy[:, 1] - reference[:, 1])
    loss = losses.mean()
    loss.backward()
    per_pair = {"pair_loss": losses.tolist(), "chosen_rewards": chosen.tolist(), "rejected_rewards": rejected.tolist()}
    metrics = {"rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean())}
    return _pair_case(torch, "cdpo", {"loss_type": "sigmoid", "beta": beta, "label_smoothing": label_smoothing},
                      "trl.experimental.cpo.CPOTrainer.cpo_loss(loss_type='sigmoid') on policy - reference",
                      inputs, loss, metrics, per_pair, leaf.grad)


def _free_batch(torch, tokens, completion_mask, attention_mask):
    """CPO/ORPO's tokenized batch: row ids in column 0, labels -100 off the completion."""
    batch = {}
    for side, name in enumerate(("chosen", "rejected")):
        ids = torch.zeros(PAIRS, LENGTH, dtype=torch.int64)
        ids[:, 0] = torch.arange(PAIRS) + side * PAIRS
        batch[f"{name}_input_ids"] = ids
        batch[f"{name}_attention_mask"] = attention_mask[:, side]
        batch[f"{name}_labels"] = torch.where(completion_mask[:, side] != 0, ids, torch.full_like(ids, -100))
    return batch


def free_case(torch, modules, name, trainer, inputs, **config):
    """SimPO (CPOTrainer) or ORPO (ORPOTrainer) through get_batch_loss_metrics."""
    tokens, completion_mask, attention_mask, reference = inputs
    if trainer == "cpo":
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
        loss_name = "cpo_loss"
    else:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
        loss_name = "odds_ratio_loss"
    with tempfile.TemporaryDirectory() as tmp:
        args = Config(output_dir=tmp, report_to=[], use_cpu=True, bf16=False, **config)
    trl_self = SimpleNamespace(
        beta=args.beta, loss_type=getattr(args, "loss_type", None),
        label_smoothing=getattr(args, "label_smoothing", 0.0),
        cpo_alpha=getattr(args, "cpo_alpha", None), simpo_gamma=getattr(args, "simpo_gamma", None),
        alpha=getattr(args, "alpha", 0.0), is_encoder_decoder=False, pad_token_id=0, padding_value=0,
        aux_loss_enabled=False,
        accelerator=_Accelerator, get_batch_logps=Trainer.get_batch_logps,
        concatenated_inputs=Trainer.concatenated_inputs,
    )
    trl_self.concatenated_forward = MethodType(Trainer.concatenated_forward, trl_self)
    captured = {}

    def capture(self, *args):
        captured["out"] = getattr(Trainer, loss_name)(self, *args)
        return captured["out"]

    setattr(trl_self, loss_name, MethodType(capture, trl_self))
    leaf = tokens.clone().requires_grad_(True)
    model = _Channel(torch, _stack(leaf))
    loss, logged = Trainer.get_batch_loss_metrics(trl_self, model, _free_batch(torch, tokens, completion_mask,
                                                                                attention_mask))
    loss.backward()
    losses, chosen, rejected = captured["out"][:3]
    sign = -1.0 if trainer == "orpo" else 1.0  # ORPO subtracts its term from the NLL
    per_pair = {"pair_loss": (sign * losses).tolist(), "chosen_rewards": chosen.tolist(),
                "rejected_rewards": rejected.tolist()}
    metrics = {k: float(v) for k, v in logged.items()}
    options = {"loss_type": name if trainer == "orpo" else "simpo", "beta": args.beta,
               "label_smoothing": trl_self.label_smoothing}
    if trainer == "cpo":
        options.update(simpo_gamma=args.simpo_gamma, cpo_alpha=args.cpo_alpha)
    return _pair_case(torch, name, options, f"trl.experimental.{trainer}.{Trainer.__name__}.get_batch_loss_metrics",
                      inputs, loss, metrics, per_pair, leaf.grad)


def _pair_case(torch, name, options, called, inputs, loss, metrics, per_pair, grad):
    tokens, completion_mask, attention_mask, reference = inputs
    return {
        "name": name, "kind": "pair", "options": options, "called": called,
        "inputs": {"token_log_probs": io.encode(tokens), "completion_mask": io.encode(completion_mask.to(torch.int32)),
                   "attention_mask": io.encode(attention_mask.to(torch.int32)),
                   "reference_log_probs": io.encode(reference)},
        "outputs": {"loss": io.encode(loss.detach()), "metrics": metrics,
                    **{k: io.encode(torch.tensor(v, dtype=torch.float32)) for k, v in per_pair.items()},
                    "grad_token_log_probs": io.encode(grad)},
    }


def _kto_inputs(torch, clamped):
    generator = torch.Generator().manual_seed(SEED + 1)
    tokens = -torch.rand(EXAMPLES, LENGTH, generator=generator) * 2.0 - 0.05
    kl_tokens = -torch.rand(EXAMPLES, LENGTH, generator=generator) * 2.0 - 0.05
    prompts = [2, 4, 1, 3, 5, 2, 3, 1]
    completions = [5, 3, 7, 4, 2, 6, 3, 5]
    mask = torch.zeros(EXAMPLES, LENGTH, dtype=torch.int64)
    kl_mask = torch.zeros(EXAMPLES, LENGTH, dtype=torch.int64)
    for row in range(EXAMPLES):
        mask[row, prompts[row]:prompts[row] + completions[row]] = 1
        other = completions[row - 1]  # TRL's rotation: row i takes completion i-1, row 0 the last
        kl_mask[row, prompts[row]:min(prompts[row] + other, LENGTH)] = 1
    label = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0], dtype=torch.int32)
    policy = (tokens[:, 1:] * mask[:, 1:]).sum(1)
    policy_kl = (kl_tokens[:, 1:] * kl_mask[:, 1:]).sum(1)
    reference = policy + torch.randn(EXAMPLES, generator=generator)
    shift = torch.rand(EXAMPLES, generator=generator) * 0.5 + 0.1
    reference_kl = policy_kl + (shift if clamped else -shift)  # clamped: mean log-ratio below 0
    return tokens, mask, label, kl_tokens, kl_mask, reference, reference_kl


def kto_case(torch, modules, name, clamped, **config):
    from trl import KTOConfig
    from trl.trainer.kto_trainer import KTOTrainer

    tokens, mask, label, kl_tokens, kl_mask, reference, reference_kl = _kto_inputs(torch, clamped)
    with tempfile.TemporaryDirectory() as tmp:
        args = KTOConfig(output_dir=tmp, report_to=[], use_cpu=True, bf16=False, **config)
    leaf = tokens.clone().requires_grad_(True)
    model = _Channel(torch, torch.cat([leaf, kl_tokens]))
    trl_self = SimpleNamespace(
        model=model, beta=args.beta, loss_type=args.loss_type, desirable_weight=args.desirable_weight,
        undesirable_weight=args.undesirable_weight, calculate_KL=True, precompute_ref_logps=True,
        use_liger_kernel=False, aux_loss_enabled=False, accelerator=_Accelerator, _total_train_tokens=0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    trl_self._compute_kl_logps = MethodType(KTOTrainer._compute_kl_logps, trl_self)
    ids = torch.zeros(EXAMPLES, LENGTH, dtype=torch.int64)
    ids[:, 0] = torch.arange(EXAMPLES)
    kl_ids = ids.clone()
    kl_ids[:, 0] += EXAMPLES
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
              "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(ids), "KL_completion_mask": kl_mask,
              "label": label.bool(), "ref_logps": reference, "ref_KL_logps": reference_kl}
    loss = KTOTrainer._compute_loss(trl_self, model, inputs, return_outputs=False)
    loss.backward()
    metrics = {k: float(v[-1]) for k, v in trl_self._metrics["train"].items()
               if k == "kl" or k.startswith(("rewards/", "logps/"))}
    return {
        "name": name, "kind": "kto", "called": "trl.trainer.kto_trainer.KTOTrainer._compute_loss",
        "options": {"loss_type": "kto", "beta": args.beta, "desirable_weight": args.desirable_weight,
                    "undesirable_weight": args.undesirable_weight},
        "inputs": {"token_log_probs": io.encode(tokens), "completion_mask": io.encode(mask.to(torch.int32)),
                   "label": io.encode(label), "kl_token_log_probs": io.encode(kl_tokens),
                   "kl_completion_mask": io.encode(kl_mask.to(torch.int32)),
                   "reference_log_probs": io.encode(reference), "reference_kl_log_probs": io.encode(reference_kl)},
        "outputs": {"loss": io.encode(loss.detach()), "metrics": metrics,
                    "kl": io.encode(torch.tensor(metrics["kl"], dtype=torch.float32)),
                    "grad_token_log_probs": io.encode(leaf.grad)},
    }


def build(torch) -> dict:
    """Every case, and what ran them."""
    import trl.experimental.cpo.cpo_trainer as cpo
    import trl.experimental.orpo.orpo_trainer as orpo
    import trl.trainer.dpo_trainer as dpo
    import trl.trainer.kto_trainer as kto

    sources = {**io.source_sha256(dpo), **io.source_sha256(kto), **io.source_sha256(cpo), **io.source_sha256(orpo)}
    modules = patch_modules(torch)
    _Accelerator.device = torch.device("cpu")
    inputs = _pair_inputs(torch)
    cases = [
        dpo_case(torch, modules, "sigmoid", "sigmoid", inputs, beta=0.1),
        cdpo_case(torch, modules, inputs, beta=0.1, label_smoothing=0.2),
        dpo_case(torch, modules, "ipo", "ipo", inputs, beta=0.1),
        dpo_case(torch, modules, "hinge", "hinge", inputs, beta=0.5),
        dpo_case(torch, modules, "robust", "robust", inputs, beta=0.1, label_smoothing=0.1),
        free_case(torch, modules, "simpo", "cpo", inputs, loss_type="simpo", beta=2.0, simpo_gamma=0.5,
                  cpo_alpha=0.0),
        free_case(torch, modules, "cpo_simpo", "cpo", inputs, loss_type="simpo", beta=2.0, simpo_gamma=1.0,
                  cpo_alpha=1.0, label_smoothing=0.1),
        free_case(torch, modules, "orpo", "orpo", inputs, beta=0.1),
        kto_case(torch, modules, "kto", False, beta=0.1),
        kto_case(torch, modules, "kto_clamped", True, beta=0.5, desirable_weight=1.0, undesirable_weight=1.5),
    ]
    assert cases[-1]["outputs"]["metrics"]["kl"] == 0.0 < cases[-2]["outputs"]["metrics"]["kl"]
    return {
        "generator": "tools/parity_dpo.py --family",
        "seed": SEED,
        "reference": {**io.installed("trl"), "source_sha256": sources,
                      "versions": io.versions("torch", "transformers", "accelerate"),
                      "called": "each case's `called`, on given per-token log-probs (module docstring)"},
        "cases": cases,
    }
