"""Dew against TRL on the same DPO and GRPO updates, on CPU.

Both sides train the same Llama-architecture decoder (bench/common.py's LLAMA_8M shapes, float32)
on the same token counts: DPO on 8 pairs per update, GRPO on 8 prompts x 4 completions x 32 new
tokens with the same reward on decoded text. Each side runs in its own process; rounds alternate
and each prints the median seconds per update after warm-up; the ratio is TRL / Dew.

Needs TRL and torch (`pip install torch==2.13.0 trl` in the venv that runs this).
Run: `python bench/peers.py [--rounds 3 --steps 6]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import LLAMA_8M, in_subprocess, report, threads, torch_llama  # noqa: E402

PROMPT, COMPLETION, PAIRS, PROMPTS, GROUPS, NEW = 32, 32, 8, 8, 4, 32
CONFIG = dict(LLAMA_8M, max_seq_len=128)


def reward_text(completion: str) -> float:
    """The reward both sides use: how often token 't7' appears, read from decoded text."""
    return completion.split().count("t7") / NEW


def word_tokenizer(directory: str):
    """A word-level tokenizer whose words 't0'..'tN' are exactly ids 0..N, for both sides."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token="t0",
                                        eos_token="t1", bos_token=None)
    tokenizer.save_pretrained(directory)
    return tokenizer


def text(ids) -> str:
    return " ".join(f"t{int(i)}" for i in ids)


def sequences(seed: int, rows: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, CONFIG["vocab_size"], (rows, length))


# ----- Dew -----------------------------------------------------------------------------------------

def dew_dpo(steps: int) -> float:
    import itertools

    import jax
    import optax

    from dew_lib import Dataset, Trainer, models
    from dew_lib.objectives import DPOObjective
    from dew_lib.train.sinks import MemorySink

    prompt, chosen, rejected = sequences(0, PAIRS, PROMPT), sequences(1, PAIRS, COMPLETION), sequences(2, PAIRS, COMPLETION)
    ids = np.stack([np.concatenate([prompt, chosen], 1), np.concatenate([prompt, rejected], 1)], 1)
    mask = np.zeros_like(ids)
    mask[:, :, PROMPT:] = 1
    batch = {"input_ids": ids.astype(np.int32), "completion_mask": mask.astype(np.int32)}
    model = models.build("causal_transformer", **CONFIG)
    trainer = Trainer(DPOObjective(model, PROMPT + COMPLETION - 1, beta=0.1), optax.adamw(1e-5),
                      key=jax.random.key(0))
    sink = MemorySink()
    trainer.fit(Dataset(train=lambda p: itertools.repeat(batch), batch=PAIRS), steps=steps + 2,
                log_every=1, sinks=[sink])
    return statistics.median(1 / m["steps_per_second"] for _, m in sink.history[2:])


def dew_grpo(steps: int) -> float:
    import itertools

    import jax
    import optax

    from dew_lib import Dataset, Trainer, models
    from dew_lib.objectives import GRPOObjective
    from dew_lib.rollouts import SampledRollout
    from dew_lib.sampling import Sampling
    from dew_lib.train.sinks import MemorySink

    prompts = {"prompt": sequences(3, PROMPTS, PROMPT).astype(np.int32),
               "prompt_length": np.full(PROMPTS, PROMPT, np.int32)}
    model = models.build("causal_transformer", **CONFIG)
    objective = GRPOObjective(model, PROMPT + NEW - 1, beta=0.0)
    rollout = SampledRollout(objective, reward=lambda s, c, g, e: reward_text(c), groups=GROUPS,
                             max_new_tokens=NEW, sampling=Sampling(temperature=1.0), decode=text)
    sink = MemorySink()
    Trainer(objective, optax.adamw(1e-5), key=jax.random.key(0), rollout=rollout).fit(
        Dataset(train=lambda p: itertools.repeat(prompts), batch=PROMPTS), steps=steps + 2,
        log_every=1, sinks=[sink])
    return statistics.median(1 / m["steps_per_second"] for _, m in sink.history[2:])


# ----- TRL -----------------------------------------------------------------------------------------

class StepClock:
    """A transformers callback that records each optimizer step's wall time."""

    def __init__(self):
        self.times, self.started = [], None

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.times.append(time.perf_counter() - clock.started)

        return Clock()


def trl_dpo(steps: int) -> float:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    work = tempfile.mkdtemp()
    tokenizer = word_tokenizer(work)
    prompt, chosen, rejected = sequences(0, PAIRS, PROMPT), sequences(1, PAIRS, COMPLETION), sequences(2, PAIRS, COMPLETION)
    data = Dataset.from_dict({"prompt": [text(r) for r in prompt], "chosen": [" " + text(r) for r in chosen],
                              "rejected": [" " + text(r) for r in rejected]})
    clock = StepClock()
    config = DPOConfig(output_dir=work, per_device_train_batch_size=PAIRS, max_steps=steps + 2,
                       learning_rate=1e-5, beta=0.1, logging_steps=1, report_to=[], use_cpu=True,
                       save_strategy="no", bf16=False, dataloader_num_workers=0,
                       max_length=PROMPT + COMPLETION + 2)
    import copy

    model = torch_llama(CONFIG, threads()).train()
    reference = copy.deepcopy(model).eval()  # the frozen starting policy, as Dew keeps in its EMA
    rows = {k: v * (steps + 2) for k, v in data.to_dict().items()}
    trainer = DPOTrainer(model=model, ref_model=reference, args=config,
                         train_dataset=Dataset.from_dict(rows), processing_class=tokenizer,
                         callbacks=[clock.callback()])
    trainer.train()
    return statistics.median(clock.times[2:])


def trl_grpo(steps: int) -> float:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    work = tempfile.mkdtemp()
    tokenizer = word_tokenizer(work)
    prompts = sequences(3, PROMPTS, PROMPT)
    data = Dataset.from_dict({"prompt": [text(r) for r in prompts] * (steps + 2)})

    def reward(completions, **kwargs):
        return [reward_text(c) for c in completions]

    clock = StepClock()
    config = GRPOConfig(output_dir=work, per_device_train_batch_size=PROMPTS * GROUPS,
                        num_generations=GROUPS, max_completion_length=NEW, max_steps=steps + 2,
                        learning_rate=1e-5, beta=0.0, temperature=1.0, logging_steps=1,
                        report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                        dataloader_num_workers=0, shuffle_dataset=False)
    model = torch_llama(CONFIG, threads()).train()
    model.generation_config.eos_token_id = None  # both sides draw the whole budget
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock.callback()])
    trainer.train()
    return statistics.median(clock.times[2:])


SIDES = {"dew_dpo": dew_dpo, "dew_grpo": dew_grpo, "trl_dpo": trl_dpo, "trl_grpo": trl_grpo}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed updates per side per round")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "STEPS"))
    args = parser.parse_args(argv)
    if args.child:
        side, steps = args.child
        print(json.dumps({"seconds": SIDES[side](int(steps))}))
        return 0
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        order = list(SIDES) if round_ % 2 == 0 else list(reversed(SIDES))
        for side in order:
            seconds[side].append(in_subprocess(__file__, side, str(args.steps))["seconds"])
    median = {side: statistics.median(values) for side, values in seconds.items()}
    report(f"seconds per update, median of {args.rounds} alternating rounds ({threads()} threads)", [
        ("DPO, 8 pairs x 64 ids: Dew / TRL", f"{median['dew_dpo']:.3f} / {median['trl_dpo']:.3f} s"),
        ("DPO speed-up (TRL / Dew)", f"{median['trl_dpo'] / median['dew_dpo']:.2f}x (target >= 1x)"),
        ("GRPO, 8 x 4 x 32 new: Dew / TRL", f"{median['dew_grpo']:.3f} / {median['trl_grpo']:.3f} s"),
        ("GRPO speed-up (TRL / Dew)", f"{median['trl_grpo'] / median['dew_grpo']:.2f}x (target >= 2x)"),
        ("rounds (s)", json.dumps({k: [round(x, 3) for x in v] for k, v in seconds.items()})),
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
