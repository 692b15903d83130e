"""The pipeline on a mixture-of-experts decoder: `model.experts` makes the embedded decoder sparse,
SFT and async GRPO (each batch drawn under the weights it trains) train it through the Prefect
flow, GRPO replays the routes its native server recorded, the run store holds each call's routes
beside its ids, and GRPO raises held-out accuracy.

The task is small enough for a two-layer MoE decoder to learn in seconds and keeps the demo's
shape: "What is 437 + 0?" answered `437 + 0 = \\boxed{437}`, where half of the SFT answers are
off by one or ten, as the demo's careless teacher writes them. SFT learns the format and the
slips; GRPO, graded against the true answers on prompts SFT saw, removes the slips on 100
numbers no stage trained on."""

import json
import random

import pytest
from test_pipeline import query

from dew_lib.data.byte_bpe import train_byte_bpe
from dew_lib.models import load_pretrained
from tasks.params import PipelineParams

pytest.importorskip("prefect")

LAYERS, EXPERTS, TOP_K = 2, 4, 2


@pytest.fixture(scope="module")
def harness(prefect_harness):
    yield


def copy_task(directory) -> dict:
    """The data block of a pipeline on the task above: its files and a tokenizer trained on them."""
    rng = random.Random(0)
    numbers = list(range(100, 1000))
    rng.shuffle(numbers)
    train, held_out = numbers[:800], numbers[800:900]

    def turns(n, answer=None):
        asked = [{"role": "user", "content": f"What is {n} + 0?"}]
        return asked + ([] if answer is None else [{"role": "assistant", "content": f"{n} + 0 = \\boxed{{{answer}}}"}])

    taught = [turns(n, n + rng.choice([1, 10]) if rng.random() < 0.5 else n) for n in train * 4]
    paths = {name: directory / f"{name}.jsonl" for name in ("chat", "prompts", "eval")}
    paths["chat"].write_text("".join(json.dumps({"messages": m}) + "\n" for m in taught))
    for name, drawn in (("prompts", train), ("eval", held_out)):
        paths[name].write_text("".join(json.dumps({"prompt": turns(n), "ground_truth": str(n),
                                                   "data_source": "arithmetic"}) + "\n" for n in drawn))
    tokenizer = directory / "tokenizer"
    train_byte_bpe((f"<|im_start|>user\n{m[0]['content']}<|im_end|>\n<|im_start|>assistant\n{m[1]['content']}"
                    "<|im_end|>" for m in taught[:1000]), vocab_size=300, directory=str(tokenizer))
    return dict(source="files", chat_path=str(paths["chat"]), prompts_path=str(paths["prompts"]),
                eval_path=str(paths["eval"]), tokenizer=str(tokenizer))


@pytest.mark.slow
def test_sft_and_grpo_train_an_moe_decoder_and_grpo_replays_its_routes_and_raises_held_out_accuracy(
        harness, tmp_path):
    from flows.pipeline import pipeline

    model = dict(emb_features=64, num_layers=LAYERS, num_heads=2, mlp_features=128, max_seq_len=64,
                 experts=EXPERTS, experts_per_token=TOP_K, expert_features=32)
    params = PipelineParams(
        root=str(tmp_path / "runs"), data=copy_task(tmp_path), model=model, stages=["sft", "grpo"],
        sft=dict(steps=200, batch=16, max_length=48, log_every=50, checkpoint_every=200),
        grpo=dict(steps=30, batch=8, groups=8, learning_rate=3e-4, max_new_tokens=16, log_every=5,
                  checkpoint_every=30, mode="async", ahead=0, max_lag=0, routing_replay="rollout"),
        evaluation=dict(batch=50, max_new_tokens=16, samples=8))
    outcome = pipeline(params)
    run, root = outcome["run"], params.root
    stages = dict(query(root, f"SELECT stage, status FROM stages WHERE run = '{run}'"))
    assert {stages[s] for s in ("sft", "grpo", "eval-grpo")} == {"completed"}
    # Every call of the GRPO stage carries its [prompt + sampled, layers, k] routes.
    calls = query(root, f"SELECT len(prompt_ids) + len(sampled_ids), len(routed_experts), routed_shape "
                        f"FROM calls WHERE run = '{run}' AND stage = 'grpo'")
    assert len(calls) >= 30 * 8 * 8
    assert all(shape == [LAYERS, TOP_K] and routed == ids * LAYERS * TOP_K for ids, routed, shape in calls)
    # Both training stages report the router's load-balancing term; the policy is an MoE checkpoint.
    names = query(root, f"SELECT stage, count(*) FROM metrics WHERE run = '{run}' AND name = 'router/aux_loss' "
                        "GROUP BY stage ORDER BY stage")
    assert [stage for stage, _ in names] == ["grpo", "sft"]
    loaded = load_pretrained(outcome["policy"])
    assert (loaded.model.experts, loaded.model.experts_per_token) == (EXPERTS, TOP_K)
    # SFT copies the number and slips about half the time; GRPO with replayed routes removes most
    # slips on the held-out numbers. With ahead=0 and max_lag=0 the async stage draws each batch
    # under the weights it trains, so the run does not depend on timing: greedy 100% before and
    # after, sampled 42.6% -> 78.4%, the same alone and beside another run. (With a batch drawn
    # ahead, how far it got before the next weights arrived moved greedy accuracy: once 7 points
    # down under three busy test workers.)
    greedy, sampled = outcome["accuracy"], outcome["sampled_accuracy"]
    assert 0.3 < sampled["sft"] < 0.65, sampled
    assert sampled["grpo"] > sampled["sft"] + 0.2, sampled
    assert greedy["grpo"] >= greedy["sft"] - 0.03, greedy  # near its ceiling already
