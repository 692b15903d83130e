"""`make run`: the most complete job Dew runs today, end to end on two CPU cores.

1. Generate arithmetic problems from a seed and train a byte-level BPE tokenizer with a ChatML
   template on them (nothing is downloaded).
2. Render each conversation with the chat template; prompt tokens are USER, the answer and its
   end-of-turn token are ASSISTANT; pack conversations into fixed-width rows.
3. Measure exact-answer accuracy of greedy answers on held-out problems, fine-tune a small
   decoder with LMObjective(loss_role=ASSISTANT), checkpointing as it goes, and measure again.

Rerunning continues from the checkpoint in the output directory; `--fresh` starts over.
The later pipeline stages (DPO, GRPO, evaluation in the run store) join this when they land.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
    steps: int = 800
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


def render(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """Token ids of one conversation and the role of each id."""
    prompt = prompt_ids(tokenizer, problem)
    answer = tokenizer.encode(solution(problem) + tokenizer.eos_token, add_special_tokens=False)
    return prompt + answer, [Role.USER] * len(prompt) + [Role.ASSISTANT] * len(answer)


def pack_rows(conversations, width: int) -> dict[str, np.ndarray]:
    """First-fit packing of (ids, roles) pairs into rows of `width` ids with segments/positions."""
    rows: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    for ids, roles in conversations:
        if len(ids) > width:
            raise ValueError(f"a conversation of {len(ids)} tokens does not fit rows of {width}")
        for index, free in enumerate(room):
            if free >= len(ids):
                rows[index].append((ids, roles))
                room[index] -= len(ids)
                break
        else:
            rows.append([(ids, roles)])
            room.append(width - len(ids))
    out = {name: np.zeros((len(rows), width), dtype)
           for name, dtype in (("text", np.int32), ("text_roles", np.int8),
                               ("text_segment_ids", np.int32), ("text_positions", np.int32))}
    for r, row in enumerate(rows):
        at = 0
        for segment, (ids, roles) in enumerate(row, start=1):
            end = at + len(ids)
            out["text"][r, at:end] = ids
            out["text_roles"][r, at:end] = roles
            out["text_segment_ids"][r, at:end] = segment
            out["text_positions"][r, at:end] = np.arange(len(ids))
            at = end
    return out


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

    import jax
    import optax

    from dew_lib import Dataset, LMObjective, Trainer, models
    from dew_lib.data.byte_bpe import train_byte_bpe

    started = time.perf_counter()
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.join(config.directory, "jax_cache")))
    print(f"[1/4] data: {config.train_problems} training and {config.test_problems} test problems "
          f"(seed {config.seed}); tokenizer with a ChatML template", flush=True)
    train = problems(config.train_problems, seed=config.seed)
    tests = problems(config.test_problems, seed=config.seed + 1)
    corpus = itertools.chain.from_iterable(
        (f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n{solution(p)}<|im_end|>",)
        for p in train[:4000])
    tokenizer = train_byte_bpe(corpus, vocab_size=config.vocab_size,
                               directory=os.path.join(config.directory, "tokenizer"))
    packed = pack_rows((render(tokenizer, p) for p in train), config.seq_len + 1)
    rows = len(packed["text"])
    print(f"      {rows} packed rows of {config.seq_len + 1} ids; vocabulary {len(tokenizer)}", flush=True)

    def stream(partition):
        order = np.random.default_rng(config.seed).permutation(rows)
        for step in itertools.count():
            start = (step * config.batch) % (rows - config.batch + 1)
            pick = order[start:start + config.batch]
            yield {name: values[pick] for name, values in packed.items()}

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
    print(f"[3/4] SFT: {config.steps} steps of {config.batch} rows, loss on assistant tokens only; "
          f"checkpoints in {config.directory}/sft", flush=True)
    state = trainer.fit(Dataset(train=stream, batch=config.batch), steps=config.steps,
                        log_every=50, directory=os.path.join(config.directory, "sft"),
                        checkpoint_every=200)
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
