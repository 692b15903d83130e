"""A stand-in for Harbor's `harbor trials start`: one trial whose harness chats with the model.

It takes the flags HarborSource passes (Harbor's `trials start`: -p/--path, -a/--agent,
-m/--model, --trials-dir, --trial-name, -e/--env, --agent-kwarg k=v, --agent-env K=V), runs a
small harness with the real `openai` client against the base URL the agent environment names,
scores it, and writes `<trials-dir>/<trial-name>/result.json` with the TrialResult fields Dew
reads (`verifier_result.rewards`, `exception_info`). Harbor itself needs Python 3.12 and a
container runtime; this stand-in runs no container.

The harness: the task's instruction.md as the user message, then `turns` (agent kwarg, default 2)
chat completions, each reply appended to the conversation with a "go on" user turn. The reward is
1.0 when the last reply has an even number of characters, else 0.0: deterministic in what the
model said. A `mode` file in the task directory makes the trial end otherwise:

    timeout     the harness stops after one call with AgentTimeoutError; the verifier still runs
    crash       the process exits 1 after one call, writing no result.json
    unscored    one call, then a result with an exception and no verifier result
    sleep       sleeps 120 s before calling (a trial to cancel)
    silent      no model call; scored 1.0
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import uuid
from pathlib import Path


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, sep, item = value.partition("=")
        if not sep:
            raise SystemExit(f"{flag} takes KEY=VALUE, got {value!r}")
        pairs[key] = item
    return pairs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="harbor")
    commands = parser.add_subparsers(dest="group", required=True)
    trials = commands.add_parser("trials").add_subparsers(dest="command", required=True)
    start = trials.add_parser("start")
    start.add_argument("-p", "--path", required=True, type=Path)
    start.add_argument("-a", "--agent", required=True)
    start.add_argument("-m", "--model", required=True)
    start.add_argument("--trials-dir", required=True, type=Path)
    start.add_argument("--trial-name", required=True)
    start.add_argument("-e", "--env", default=None)
    start.add_argument("--agent-kwarg", action="append", default=[])
    start.add_argument("--agent-env", action="append", default=[])
    args = parser.parse_args(argv)

    kwargs, env = _pairs(args.agent_kwarg, "--agent-kwarg"), _pairs(args.agent_env, "--agent-env")
    directory = args.trials_dir / args.trial_name
    directory.mkdir(parents=True, exist_ok=False)
    (directory / "config.json").write_text(json.dumps(
        {"argv": argv, "agent": args.agent, "model": args.model, "environment": args.env,
         "agent_kwargs": kwargs, "agent_env": env}))
    mode_file = args.path / "mode"
    mode = mode_file.read_text().strip() if mode_file.exists() else ""
    started = datetime.datetime.now(datetime.UTC).isoformat()

    import openai

    client = openai.OpenAI(base_url=env["OPENAI_BASE_URL"], api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": (args.path / "instruction.md").read_text().strip()}]
    if mode == "sleep":
        time.sleep(120)
    turns = 0 if mode == "silent" else 1 if mode in ("timeout", "crash", "unscored") else int(kwargs.get("turns", 2))
    reply = ""
    for turn in range(turns):
        answer = client.chat.completions.create(model=args.model, messages=messages, max_tokens=6, seed=turn)
        reply = answer.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    if mode == "crash":
        print("the harness crashed", file=sys.stderr)
        return 1

    exception = None
    if mode in ("timeout", "unscored"):
        kind = "AgentTimeoutError" if mode == "timeout" else "RuntimeError"
        exception = {"exception_type": kind, "exception_message": f"{mode} after one call",
                     "exception_traceback": "", "occurred_at": started}
    reward = 1.0 if mode == "silent" else float(len(reply) % 2 == 0)
    verifier = None if mode == "unscored" else {"rewards": {"reward": reward}}
    result = {
        "id": str(uuid.uuid4()), "task_name": args.path.name, "trial_name": args.trial_name,
        "trial_uri": directory.resolve().as_uri(), "task_id": {"path": str(args.path)},
        "agent_info": {"name": args.agent, "model_info": {"name": args.model}},
        "agent_result": {"n_input_tokens": None, "n_output_tokens": None},
        "verifier_result": verifier, "exception_info": exception,
        "started_at": started, "finished_at": datetime.datetime.now(datetime.UTC).isoformat(),
    }
    (directory / "result.json").write_text(json.dumps(result, indent=2))
    print(f"trial {args.trial_name} finished in {os.getpid()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
