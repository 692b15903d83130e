"""Dew against TRL on the same DPO, GRPO and PPO updates, on CPU.

Both sides train the same Llama-architecture decoder (bench/common.py's LLAMA_8M shapes, float32)
on the same token counts: DPO on 8 pairs per update, GRPO on 8 prompts x 4 completions x 32 new
tokens with the same reward on decoded text, PPO on 32 completions of 32 new tokens with a
critic of the policy's shape (one epoch, one minibatch, a reply cut at its length graded as it
is on both sides). TRL's PPO grades with a reward model (its trainer takes no function), so its
update also runs one forward pass of a third decoder; Dew's grades decoded text. Each side runs
in its own process; rounds alternate and each prints the median seconds per update after
warm-up; the ratio is TRL / Dew.

Needs torch and TRL (`pip install torch==2.13.0 trl` in the venv that runs this). TRL's PPO
trainer lives in `trl.experimental.ppo` up to TRL 1.12.0 and is gone from 1.13.0 on; with a TRL
that lacks it the PPO rows say so and the others still run.
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
EOS = 1  # t1, the tokenizer's EOS; a random policy seldom draws it
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

    prompt = sequences(0, PAIRS, PROMPT)
    chosen, rejected = sequences(1, PAIRS, COMPLETION), sequences(2, PAIRS, COMPLETION)
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


def dew_ppo(steps: int) -> float:
    import itertools

    import jax
    import optax

    from dew_lib import Dataset, Trainer, models
    from dew_lib.objectives import PPOObjective, ValueHead
    from dew_lib.recipes import OneTurn
    from dew_lib.rollouts import EpisodeRollout, PPORollout
    from dew_lib.sampling import Sampling
    from dew_lib.train.sinks import MemorySink

    def verify(task, episode):
        return reward_text(text(episode.transitions[-1].action.tokens))

    prompts = {"task_id": np.arange(PROMPTS, dtype=np.int32), "prompt": sequences(3, PROMPTS, PROMPT).astype(np.int32),
               "prompt_length": np.full(PROMPTS, PROMPT, np.int32)}
    model = models.build("causal_transformer", **CONFIG)
    objective = PPOObjective(model, PROMPT + NEW - 1, critic=ValueHead(models.build("causal_transformer", **CONFIG)),
                             beta=0.05)
    episodes = EpisodeRollout(objective.policy(), OneTurn, verify, max_prompt_tokens=PROMPT, max_new_tokens=NEW,
                              max_turns=1, groups=GROUPS, sampling=Sampling(temperature=1.0, eos_id=EOS),
                              truncation="score")
    sink = MemorySink()
    Trainer(objective, optax.adamw(1e-5), key=jax.random.key(0), rollout=PPORollout(objective, episodes)).fit(
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
    prompt = sequences(0, PAIRS, PROMPT)
    chosen, rejected = sequences(1, PAIRS, COMPLETION), sequences(2, PAIRS, COMPLETION)
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


def trl_has_ppo() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl.experimental.ppo") is not None


def trl_ppo(steps: int) -> float:
    import copy

    from datasets import Dataset
    from transformers import LlamaForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    work = tempfile.mkdtemp()
    tokenizer = word_tokenizer(work)
    rows = PROMPTS * GROUPS
    prompts = np.repeat(sequences(3, PROMPTS, PROMPT), GROUPS, axis=0)  # Dew's 8 prompts x 4 samples
    data = Dataset.from_dict({"input_ids": [r.tolist() for r in prompts] * (steps + 2)})
    model = torch_llama(CONFIG, threads()).train()

    def scorer():
        config = copy.deepcopy(model.config)
        config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
        return LlamaForSequenceClassification(config).float()

    ends: list[float] = []

    class Clock(TrainerCallback):  # TRL's PPO loop calls only on_step_end per update
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    config = PPOConfig(output_dir=work, per_device_train_batch_size=rows, num_mini_batches=1, num_ppo_epochs=1,
                       response_length=NEW, total_episodes=rows * (steps + 2), learning_rate=1e-5,
                       temperature=1.0, stop_token="eos", kl_coef=0.05, local_rollout_forward_batch_size=rows,
                       num_sample_generations=0, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                       dataloader_num_workers=0)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=model, ref_model=copy.deepcopy(model).eval(),
                         reward_model=scorer().eval(), value_model=scorer(), train_dataset=data,
                         callbacks=[Clock()])
    trainer.train()
    return statistics.median(np.diff(ends)[1:].tolist())


SIDES = {"dew_dpo": dew_dpo, "dew_grpo": dew_grpo, "dew_ppo": dew_ppo,
         "trl_dpo": trl_dpo, "trl_grpo": trl_grpo, "trl_ppo": trl_ppo}


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
    sides = [side for side in SIDES if side != "trl_ppo" or trl_has_ppo()]
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        order = sides if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            seconds[side].append(in_subprocess(__file__, side, str(args.steps))["seconds"])
    median = {side: statistics.median(values) for side, values in seconds.items()}
    report(f"seconds per update, median of {args.rounds} alternating rounds ({threads()} threads)", [
        ("DPO, 8 pairs x 64 ids: Dew / TRL", f"{median['dew_dpo']:.3f} / {median['trl_dpo']:.3f} s"),
        ("DPO speed-up (TRL / Dew)", f"{median['trl_dpo'] / median['dew_dpo']:.2f}x (target >= 1x)"),
        ("GRPO, 8 x 4 x 32 new: Dew / TRL", f"{median['dew_grpo']:.3f} / {median['trl_grpo']:.3f} s"),
        ("GRPO speed-up (TRL / Dew)", f"{median['trl_grpo'] / median['dew_grpo']:.2f}x (target >= 2x)"),
        *ppo_rows(median),
        ("rounds (s)", json.dumps({k: [round(x, 3) for x in v] for k, v in seconds.items()})),
    ])
    return 0


def ppo_rows(median: dict[str, float]) -> list[tuple[str, str]]:
    if "trl_ppo" not in median:
        import trl

        return [("PPO, 32 x 32 new with a critic: Dew", f"{median['dew_ppo']:.3f} s"),
                ("PPO speed-up (TRL / Dew)", f"not measured: TRL {trl.__version__} has no PPO trainer "
                 "(trl.experimental.ppo ends at 1.12.0)")]
    return [("PPO, 32 x 32 new with a critic: Dew / TRL", f"{median['dew_ppo']:.3f} / {median['trl_ppo']:.3f} s"),
            ("PPO speed-up (TRL / Dew)", f"{median['trl_ppo'] / median['dew_ppo']:.2f}x (target >= 1x)")]


if __name__ == "__main__":
    sys.exit(main())
