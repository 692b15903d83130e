"""Sampled accuracy of saved policies under several evaluation keys: is a stage's change real?

The pipeline's evaluation draws its answers with one set of keys (`evaluation.seed`), the same at
every stage, so two stages are compared draw by draw. Near 99% a stage that changes almost
nothing can still flip a few draws that sat on the edge between two ids; this script draws the
same answers again under `--keys` other seeds and prints, per policy, the right draws under each
key and their total, which tells such an edge apart from an effect every key shows.

    .venv/bin/python tools/sampled_keys.py runs/demo/data \\
        runs/demo/sft/latest/policy runs/demo/dpo/latest/policy runs/demo/grpo/latest/policy

Answers are graded as the pipeline grades them (each row's data source, tasks/rewards.py).
Keys are `first_seed`, `first_seed + 1`, ...; the pipeline's own is `evaluation.seed` (0).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dew_lib.models.pretrained import load_pretrained  # noqa: E402
from tasks.data import read_eval  # noqa: E402
from tasks.evaluate import draw_answers, prompt_ids  # noqa: E402
from tasks.params import EvalParams, RewardParams  # noqa: E402
from tasks.rewards import TaskReward, score_all  # noqa: E402


def drawn_answers(pretrained, variables, rows: list[dict], params: EvalParams, key: int) -> list[str]:
    """`params.samples` answers per row drawn under `key`, in the evaluation's order (draw j of
    row i at j * len(rows) + i)."""
    prompts = [prompt_ids(pretrained.tokenizer, row["prompt"]) for row in rows] * params.samples
    drawn = draw_answers(pretrained.model, variables, pretrained.tokenizer, prompts, params,
                         temperature=params.temperature, seed=key)
    return [text for text, _, _ in drawn]


def right_draws(policy: str, rows: list[dict], params: EvalParams, keys: range) -> list[int]:
    """Right answers among `params.samples` draws per row, under each key in `keys`."""
    pretrained, variables = load_pretrained(policy)
    counts = []
    with TaskReward(RewardParams()) as grader:
        for key in keys:
            answers = drawn_answers(pretrained, variables, rows, params, key)
            scores, _ = score_all(grader, rows * params.samples, answers)
            counts.append(sum(score >= 1.0 for score in scores))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="the run's data directory (eval.jsonl), e.g. runs/demo/data")
    parser.add_argument("policies", nargs="+", help="Hugging Face policy directories to compare")
    parser.add_argument("--keys", type=int, default=10, help="evaluation keys (default 10)")
    parser.add_argument("--first-seed", type=int, default=1, help="seed of the first key (default 1)")
    parser.add_argument("--samples", type=int, default=8, help="draws per prompt and key (default 8)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=100, help="prompts drawn at once; with the run's "
                        "evaluation.batch and --first-seed 0 the first key repeats the run's own draws")
    args = parser.parse_args(argv)
    rows = read_eval(os.path.join(args.data, "eval.jsonl"))
    params = EvalParams(samples=args.samples, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                        batch=args.batch)
    keys = range(args.first_seed, args.first_seed + args.keys)
    print(f"right draws of {len(rows)} prompts x {args.samples} under keys {keys.start}..{keys.stop - 1}")
    for policy in args.policies:
        counts = right_draws(policy, rows, params, keys)
        total = len(keys) * len(rows) * args.samples
        print(f"{policy}: {' '.join(map(str, counts))}  total {sum(counts):,} of {total:,} "
              f"({100 * sum(counts) / total:.2f}%)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
