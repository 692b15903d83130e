"""Write verl's own agent-loop rows and GSM8K tool-agent prompts for the interop tests.

Run from the repository root with any Python 3.11:

    python3 tools/verl_interop_reference.py

It uses tools/.venv-verl (see tools/parity_grpo.py; the agent loop's own imports are added to
it) and writes tests/fixtures/verl/interop.json:

    reference: verl's package record and the sha256 of agent_loop.py and tool_agent_loop.py
    agent_loop_rows: AgentLoopOutput objects built and validated by verl's own pydantic class,
        filled the way verl's ToolAgentLoop fills them (tool_agent_loop.py): the prompt, then
        each assistant turn's ids (mask 1, the engine's log-probs) and each tool response (mask
        0, log-prob 0.0); routed_experts for prompt + response ids [tokens, layers, top_k];
        num_turns = user turns + assistant turns + 1; extra_fields with turn_scores and
        tool_rewards (what ToolAgentLoop adds) and min/max_global_steps (what the fully
        asynchronous trainer reads); then dumped with model_dump(). Row 0: two assistant turns
        around one tool answer; row 1: a single turn; both repeat one prompt (rollout.n = 2)
        with a second prompt in rows 2-3.
    gsm8k_rows: two GSM8K problems mapped exactly as verl's
        examples/data_preprocess/gsm8k_multiturn_w_tool.py maps them (data_source, prompt
        messages, ability, reward_model.ground_truth, extra_info with tools_kwargs and
        interaction_kwargs, its index), from shared/data/gsm8k when present, else two fixed
        problems.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parity_io as io  # noqa: E402
from parity_grpo import EXTRAS, VENV, VERL_VERSION  # noqa: E402

AGENT_LOOP_EXTRAS = ["hydra-core", "pillow", "datasets", "cachetools", "uvicorn", "fastapi"]  # what
# verl.experimental.agent_loop imports beyond core_algos' needs
SEED = 20261203
LAYERS, TOP_K = 2, 2
INSTRUCTION = "Let's think step by step and output the final answer after `####`."
SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
          "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after "
          "step by step solving the question, before generate final answer at least once and refine your "
          "answer if necessary. Put your final answer in the format of `#### <answer>`.")
FALLBACK = [("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to "
             "her friends in May. How many clips did Natalia sell altogether in April and May?",
             "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
             "altogether in April and May.\n#### 72"),
            ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
             "How much did she earn?",
             "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
             "$<<0.2*50=10>>10.\n#### 10")]


def _gsm8k_rows() -> list[dict]:
    import re

    path = io.ROOT.parent / "shared" / "data" / "gsm8k"
    problems = FALLBACK
    files = sorted(path.glob("**/*.jsonl")) if path.is_dir() else []
    if files:
        with open(files[0], encoding="utf-8") as handle:
            problems = [(r["question"], r["answer"]) for r in map(json.loads, handle.readlines()[:2])]
    rows = []
    for index, (question_raw, answer_raw) in enumerate(problems):
        solution = re.search("#### (\\-?[0-9\\.\\,]+)", answer_raw).group(0).split("#### ")[1].replace(",", "")
        question = question_raw + " " + INSTRUCTION
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": solution},
                     "extra_info": {"split": "train", "index": index, "answer": answer_raw, "question": question_raw,
                                    "need_tools_kwargs": True,
                                    "tools_kwargs": {
                                        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
                                    "interaction_kwargs": {"query": question, "ground_truth": solution}}})
    return rows


def _agent_rows(AgentLoopOutput, AgentLoopMetrics, np) -> list[dict]:
    rng = np.random.default_rng(SEED)
    rows = []
    for prompt_number in range(2):
        prompt = [151644, 872, 198, 100 + prompt_number, 101, 151645, 198, 151644, 77091, 198]
        for sample in range(2):
            turns = [[200 + sample, 201, 202, 151645]]
            tools = []
            if sample == 0:  # a tool call, its answer, and a second assistant turn
                tools = [[198, 151644, 872, 198, 300, 301, 151645, 198, 151644, 77091, 198]]
                turns.append([203, 204, 151645])
            response, mask, logprobs = [], [], []
            for k, turn in enumerate(turns):
                response += turn
                mask += [1] * len(turn)
                logprobs += (-rng.random(len(turn))).round(4).tolist()
                if k < len(tools):
                    response += tools[k]
                    mask += [0] * len(tools[k])
                    logprobs += [0.0] * len(tools[k])
            routed = rng.integers(0, 8, (len(prompt) + len(response), LAYERS, TOP_K)).astype(np.int16)
            output = AgentLoopOutput(
                prompt_ids=prompt, response_ids=response, response_mask=mask, response_logprobs=logprobs,
                routed_experts=routed, reward_score=float(sample == 0), num_turns=len(tools) + len(turns) + 1,
                metrics=AgentLoopMetrics(generate_sequences=0.5, tool_calls=0.1 * len(tools)),
                extra_fields={"min_global_steps": 3, "max_global_steps": 3 + len(tools)})
            output.extra_fields.update({"turn_scores": [], "tool_rewards": [0.0] * len(tools)})
            row = output.model_dump()
            row["routed_experts"] = routed.tolist()
            rows.append(row)
    return rows


def main() -> None:
    io.run_in_venv(__file__, VENV, "verl", VERL_VERSION, no_deps=True, extras=EXTRAS + AGENT_LOOP_EXTRAS)
    try:
        import verl.experimental.agent_loop.tool_agent_loop  # noqa: F401
    except ImportError:  # a venv parity_grpo.py made: add what the agent loop imports
        import subprocess

        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *AGENT_LOOP_EXTRAS], check=True)
    import numpy as np
    import verl.experimental.agent_loop.agent_loop as agent_loop
    import verl.experimental.agent_loop.tool_agent_loop as tool_agent_loop

    document = {
        "generator": "tools/verl_interop_reference.py",
        "seed": SEED,
        "reference": {**io.installed("verl"),
                      "source_sha256": {**io.source_sha256(agent_loop), **io.source_sha256(tool_agent_loop)},
                      "fields": list(agent_loop.AgentLoopOutput.model_fields)},
        "agent_loop_rows": _agent_rows(agent_loop.AgentLoopOutput, agent_loop.AgentLoopMetrics, np),
        "gsm8k_rows": _gsm8k_rows(),
    }
    path = io.ROOT / "tests" / "fixtures" / "verl" / "interop.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(io.ROOT)}: {len(document['agent_loop_rows'])} agent-loop rows, "
          f"{len(document['gsm8k_rows'])} GSM8K rows, verl {document['reference']['version']}")


if __name__ == "__main__":
    main()
