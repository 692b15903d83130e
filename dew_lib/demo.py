"""`make run`: the most complete job Dew runs today, end to end on two CPU cores.

1. Generate arithmetic problems from a seed, write them as chat JSONL, and train a byte-level
   BPE tokenizer with a ChatML template on them (nothing is downloaded).
2. ChatMessages renders each conversation with the chat template, labels answer tokens
   ASSISTANT, and packs conversations into fixed-width rows.
3. Measure exact-answer accuracy of greedy answers on held-out problems, fine-tune a small
   decoder with LMObjective(loss_role=ASSISTANT), checkpointing as it goes, and measure again.

Rerunning continues from the checkpoint in the output directory; `--fresh` starts over.
The later pipeline stages (DPO, GRPO, evaluation in the run store) join this when they land.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

import numpy as np

from dew_lib.data.arithmetic import Problem, graded, problems, solution
from dew_lib.data.chat import Role


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    directory: str = "runs/demo"
    train_problems: int = 20_000
    test_problems: int = 200
    vocab_size: int = 320
    seq_len: int = 96
    batch: int = 16
    steps: int = 2000
    learning_rate: float = 3e-3
    emb_features: int = 128
    num_layers: int = 4
    num_heads: int = 4
    mlp_features: int = 384
    seed: int = 0


def prompt_ids(tokenizer, problem: Problem) -> list[int]:
    """The question rendered with the chat template, ending in the assistant header."""
    return tokenizer.apply_chat_template(problem.messages(False), add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def write_conversations(path: str, items: list[Problem]) -> None:
    """One `{"messages": [...]}` JSON line per problem: the layout ChatMessages reads."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for problem in items:
            out.write(json.dumps({"messages": problem.messages()}) + "\n")


def accuracy(model, variables, tokenizer, tests: list[Problem]) -> tuple[float, list[str]]:
    """Share of held-out problems whose greedy answer ends in the right number."""
    import jax

    from dew_lib.sampling import Sampling, generate

    prompts = [prompt_ids(tokenizer, p) for p in tests]
    width = max(map(len, prompts))
    batch = np.zeros((len(prompts), width), np.int32)
    for row, ids in enumerate(prompts):
        batch[row, width - len(ids):] = ids
    out = generate(model, variables, batch, np.array([len(p) for p in prompts]),
                   key=jax.random.key(0), max_new_tokens=12,
                   sampling=Sampling(temperature=0.0, eos_id=tokenizer.eos_token_id))
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    replies = [tokenizer.decode(tokens[i, : lengths[i]], skip_special_tokens=True)
               for i in range(len(tests))]
    return float(np.mean([graded(r, p.answer) for r, p in zip(replies, tests)])), replies


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--directory", default=DemoConfig.directory)
    parser.add_argument("--steps", type=int, default=DemoConfig.steps)
    parser.add_argument("--fresh", action="store_true", help="delete the output directory first")
    args = parser.parse_args(argv)
    config = DemoConfig(directory=args.directory, steps=args.steps)
    if args.fresh:
        shutil.rmtree(config.directory, ignore_errors=True)

    # On a CPU-only machine, one XLA device per core trains data parallel: the copies and
    # elementwise work between matmuls then run on both cores too.
    cores = os.cpu_count() or 1
    if cores > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={min(cores, 8)}")
    import jax
    import optax

    from dew_lib import LMObjective, Loading, Trainer, models
    from dew_lib.data import ChatMessages
    from dew_lib.data.byte_bpe import train_byte_bpe

    started = time.perf_counter()
    jax.config.update("jax_compilation_cache_dir",
                      os.path.abspath(os.path.join(config.directory, "jax_cache")))
    train = problems(config.train_problems, seed=config.seed)
    seen = {p.question for p in train}
    tests = [p for p in problems(4 * config.test_problems, seed=config.seed + 1)
             if p.question not in seen][: config.test_problems]
    print(f"[1/4] data: {len(train)} training problems, {len(tests)} held-out ones never seen in "
          f"training (seed {config.seed}); a byte-level BPE tokenizer with a ChatML template",
          flush=True)
    data_dir = os.path.join(config.directory, "data")
    write_conversations(os.path.join(data_dir, "train.jsonl"), train)
    write_conversations(os.path.join(data_dir, "val.jsonl"), tests)
    tokenizer_dir = os.path.join(config.directory, "tokenizer")
    corpus = (f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n{solution(p)}<|im_end|>"
              for p in train[:4000])
    tokenizer = train_byte_bpe(corpus, vocab_size=config.vocab_size, directory=tokenizer_dir)
    data = ChatMessages(path=os.path.join(data_dir, "train.jsonl"), tokenizer=tokenizer_dir,
                        seq_len=config.seq_len, val_path=os.path.join(data_dir, "val.jsonl"),
                        loading=Loading(workers=0, seed=config.seed)).load(batch=config.batch)

    model = models.build("causal_transformer", vocab_size=len(tokenizer),
                         emb_features=config.emb_features, num_layers=config.num_layers,
                         num_heads=config.num_heads, mlp_features=config.mlp_features,
                         max_seq_len=config.seq_len + 1)
    objective = LMObjective(model, seq_len=config.seq_len, loss_role=Role.ASSISTANT, ema_decay=None)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, 50, config.steps,
                                                  config.learning_rate / 10)
    trainer = Trainer(objective, optax.adamw(schedule), key=jax.random.key(config.seed))

    before, _ = accuracy(model, trainer.initial_state().params, tokenizer, tests)
    print(f"[2/4] before SFT: {before:.1%} of held-out answers exact", flush=True)
    print(f"[3/4] SFT on {jax.device_count()} device(s): {config.steps} steps of {config.batch} "
          f"packed rows, loss on assistant tokens only; checkpoints in {config.directory}/sft",
          flush=True)
    state = trainer.fit(data, steps=config.steps, log_every=50, eval_every=config.steps // 4,
                        directory=os.path.join(config.directory, "sft"), checkpoint_every=200)
    after, replies = accuracy(model, state.params, tokenizer, tests)
    print(f"[4/4] after SFT: {after:.1%} of held-out answers exact (before: {before:.1%})")
    for problem, reply in list(zip(tests, replies))[:5]:
        mark = "ok " if graded(reply, problem.answer) else "bad"
        print(f"      {mark} {problem.question!r} -> {reply!r}")
    print(f"done in {time.perf_counter() - started:.0f} s; "
          f"train-step compilations: {trainer.compilations['train_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
