"""Write tests/fixtures/chat/trl_qwen3.json and trl_qwen3_formats.json: token ids and masks as TRL's
SFT and DPO trainers make them.

    python tools/parity_chat.py [--tokenizer DIR] [--out FILE] [--formats-out FILE]

Run it with any Python 3.11+. It creates tools/.venv-trl (git-ignored) on first use, installs
torch 2.13.0 (the CPU wheel) and then TRL 1.12.0 there, and runs itself again inside that venv.
Dew's tests read the fixture and never import torch or TRL.

What it records: for each conversation (system prompts, several turns, reasoning content, tool
calls with tool schemas, tool responses, and a GSM8K row) the `input_ids` and the assistant mask
(`labels != -100`) that `SFTTrainer(..., args=SFTConfig(assistant_only_loss=True))` prepares.

TRL only accepts a chat template byte-identical to one it ships, which it then swaps for its own
training template with `{% generation %}` markers. The Qwen3 tokenizer in shared/data carries an
older revision of Qwen3's template that TRL refuses, so this script sets TRL's own copy of the
Qwen3 template on it, lets the trainer swap in its training template, and stores that training
template (the one the ids and masks came from) in the fixture. The test hands the same template
to ChatMessages and expects identical ids and masks.

The formats fixture holds two more record shapes. Prompt-completion conversations (`prompt` and
`completion` message lists) as SFTTrainer prepares them with the same training template and
`assistant_only_loss=True` (trained tokens: completion mask and assistant mask both 1). Preference
pairs in TRL's conversational form (`prompt`, `chosen`, `rejected` message lists) as DPOTrainer
tokenizes them with the tokenizer's own chat template: prompt ids, chosen ids and rejected ids,
the answers' ids being what follows the prompt (rendered with the generation prompt) in each full
render.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "tools" / ".venv-trl"
TRL_VERSION = "1.12.0"
TORCH_VERSION = "2.13.0"
DEFAULT_TOKENIZER = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3"
DEFAULT_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "chat" / "trl_qwen3.json"
DEFAULT_FORMATS_OUT = ROOT / "tests" / "fixtures" / "chat" / "trl_qwen3_formats.json"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def conversations(gsm8k: Path) -> list[dict]:
    """The fixture's conversations: each a {messages, tools} row as TRL's dataset takes it."""
    first = json.loads(gsm8k.read_text(encoding="utf-8").splitlines()[0])
    return [
        {"messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name a primary colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another one?"},
            {"role": "assistant", "content": "Blue."},
        ], "tools": None},
        {"messages": [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "reasoning_content": "91 = 7 * 13, so it has divisors.",
             "content": "No, 91 = 7 x 13."},
            {"role": "user", "content": "And 97?"},
            {"role": "assistant", "reasoning_content": "No prime up to 9 divides 97.",
             "content": "Yes, 97 is prime."},
        ], "tools": None},
        {"messages": [
            {"role": "system", "content": "Use tools when they help."},
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "reasoning_content": "I should call the weather tool.", "content": "",
             "tool_calls": [{"type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "name": "get_weather", "content": "{\"temp_c\": 18, \"sky\": \"cloudy\"}"},
            {"role": "assistant", "reasoning_content": "The tool answered.",
             "content": "It is 18 C and cloudy in Paris."},
        ], "tools": [WEATHER]},
        {"messages": [
            {"role": "user", "content": "Compute 6*7 and 3*5."},
            {"role": "assistant", "content": "Calling the tool twice.",
             "tool_calls": [
                 {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}},
                 {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 5}}},
             ]},
            {"role": "tool", "name": "multiply", "content": "42"},
            {"role": "tool", "name": "multiply", "content": "15"},
            {"role": "assistant", "content": "6*7 = 42 and 3*5 = 15."},
        ], "tools": [MULTIPLY, WEATHER]},
        {"messages": [
            {"role": "user", "content": "Weather in Oslo, then tell me a joke."},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "name": "get_weather", "content": "-3 C, snow"},
            {"role": "assistant", "content": "<think>\nCold. Now a joke.\n</think>\n\nIt is -3 C with snow. "
                                             "Why did the snowman smile? He saw the snowblower coming."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You're welcome."},
        ], "tools": [WEATHER]},
        {"messages": [
            {"role": "user", "content": first["question"]},
            {"role": "assistant", "content": first["answer"]},
        ], "tools": None},
    ]


def prompt_completions(gsm8k: Path) -> list[dict]:
    """Prompt-completion rows for SFT: one turn, a multi-turn prompt, a tool call in the completion."""
    first = json.loads(gsm8k.read_text(encoding="utf-8").splitlines()[0])
    return [
        {"prompt": [{"role": "user", "content": first["question"]}],
         "completion": [{"role": "assistant", "content": first["answer"]}], "tools": None},
        {"prompt": [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Name a primary colour."},
                    {"role": "assistant", "content": "Red."},
                    {"role": "user", "content": "Another one?"}],
         "completion": [{"role": "assistant", "content": "Blue."}], "tools": None},
        {"prompt": [{"role": "system", "content": "Use tools when they help."},
                    {"role": "user", "content": "What's the weather in Paris?"}],
         "completion": [
             {"role": "assistant", "reasoning_content": "I should call the weather tool.", "content": "",
              "tool_calls": [{"type": "function",
                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "name": "get_weather", "content": "{\"temp_c\": 18, \"sky\": \"cloudy\"}"},
             {"role": "assistant", "reasoning_content": "The tool answered.",
              "content": "It is 18 C and cloudy in Paris."}],
         "tools": [WEATHER]},
    ]


def preferences() -> list[dict]:
    """Conversational preference rows for DPO: one turn, a system prompt and history, tools."""
    return [
        {"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
         "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5"}], "tools": None},
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Name a primary colour."},
                    {"role": "assistant", "content": "Red."},
                    {"role": "user", "content": "Another one?"}],
         "chosen": [{"role": "assistant", "content": "Blue."}],
         "rejected": [{"role": "assistant", "content": "Purple, which is a primary colour."}], "tools": None},
        {"prompt": [{"role": "user", "content": "Is it cold in Oslo?"}],
         "chosen": [{"role": "assistant", "content": "Let me check the weather in Oslo for you."}],
         "rejected": [{"role": "assistant", "content": "Oslo is always warm."}], "tools": [WEATHER]},
    ]


def ensure_venv() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    check = subprocess.run([str(python), "-c", f"import trl, torch; assert trl.__version__ == '{TRL_VERSION}'"],
                           capture_output=True)
    if check.returncode != 0:
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        # torch first, pinned to the CPU wheel these machines keep on disk, so that TRL's
        # dependency on torch does not pull a CUDA build.
        subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
        subprocess.run([*pip, f"trl=={TRL_VERSION}"], check=True)
    return python


def wheel_sha256(python: Path) -> str:
    """sha256 of the TRL release wheel: the wheel carries no git commit, so this names the build."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([str(python), "-m", "pip", "download", "--quiet", "--no-deps", "-d", folder,
                        f"trl=={TRL_VERSION}"], check=True)
        (wheel,) = Path(folder).glob("trl-*.whl")
        return f"{wheel.name} sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}"


def inside(args) -> None:
    """Runs in tools/.venv-trl: tokenize through SFTTrainer and write the fixture."""
    import datasets
    import torch
    import transformers
    import trl
    from trl import SFTConfig, SFTTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    shipped = Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"
    tokenizer.chat_template = shipped.read_text(encoding="utf-8")
    rows = conversations(Path(args.gsm8k))
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    out, templates = [], set()
    for row in rows:
        # One dataset per conversation: Arrow unifies the structs of all rows of a dataset (a
        # string tool-call argument in one row and a mapping in another cannot share a column).
        dataset = datasets.Dataset.from_list(
            [{"messages": row["messages"], "tools": json.dumps(row["tools"]) if row["tools"] else None}]
        )
        with tempfile.TemporaryDirectory() as folder:
            trainer = SFTTrainer(
                model=model, processing_class=tokenizer, train_dataset=dataset,
                args=SFTConfig(output_dir=folder, assistant_only_loss=True, max_length=None, packing=False,
                               report_to="none", use_cpu=True),
            )
        templates.add(trainer.chat_template)
        seen = dataset[0]  # the row as TRL's tokenizing function received it
        prepared = trainer.train_dataset[0]
        out.append({
            "messages": seen["messages"],
            "tools": json.loads(seen["tools"]) if seen["tools"] else None,
            "input_ids": list(prepared["input_ids"]),
            "assistant_masks": [int(label != -100) for label in prepared["labels"]],
        })
    (template,) = templates
    write_formats(args, model, template)
    fixture = {
        "about": "ids and assistant masks from TRL SFTTrainer(assistant_only_loss=True); "
                 "written by tools/parity_chat.py",
        "trl_version": trl.__version__,
        "trl_revision": args.revision,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizer": Path(args.tokenizer).name,
        "template_source": "trl/chat_templates/qwen3.jinja set on the tokenizer, swapped by SFTTrainer "
                           "for its training template (stored here)",
        "chat_template": template,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "conversations": out,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(fixture, indent=1, ensure_ascii=False)
    text = re.sub(r"\[(\s*-?\d+,?)+\s*\]", lambda m: json.dumps(json.loads(m.group(0))), text)  # ids on one line
    Path(args.out).write_text(text + "\n", encoding="utf-8")
    tokens = sum(len(c["input_ids"]) for c in out)
    print(f"wrote {args.out}: {len(out)} conversations, {tokens} tokens, TRL {trl.__version__}")


def write_formats(args, model, sft_template: str) -> None:
    """Runs in tools/.venv-trl: prompt-completion rows through SFTTrainer, preference rows through
    DPOTrainer, written to the formats fixture."""
    import datasets
    import transformers
    import trl
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    shipped = Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja"
    tokenizer.chat_template = shipped.read_text(encoding="utf-8")
    completions = []
    for row in prompt_completions(Path(args.gsm8k)):
        dataset = datasets.Dataset.from_list(
            [{"prompt": row["prompt"], "completion": row["completion"],
              "tools": json.dumps(row["tools"]) if row["tools"] else None}])
        with tempfile.TemporaryDirectory() as folder:
            trainer = SFTTrainer(
                model=model, processing_class=tokenizer, train_dataset=dataset,
                args=SFTConfig(output_dir=folder, assistant_only_loss=True, max_length=None, packing=False,
                               report_to="none", use_cpu=True),
            )
        assert trainer.chat_template == sft_template
        seen, prepared = dataset[0], trainer.train_dataset[0]
        completions.append({
            "prompt": seen["prompt"], "completion": seen["completion"],
            "tools": json.loads(seen["tools"]) if seen["tools"] else None,
            "input_ids": list(prepared["input_ids"]),
            "trained": [int(label != -100) for label in prepared["labels"]],
        })
    own = transformers.AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    pairs = []
    for row in preferences():
        dataset = datasets.Dataset.from_list(
            [{"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"],
              "tools": json.dumps(row["tools"]) if row["tools"] else None}])
        with tempfile.TemporaryDirectory() as folder:
            trainer = DPOTrainer(
                model=model, ref_model=copy.deepcopy(model), processing_class=own, train_dataset=dataset,
                args=DPOConfig(output_dir=folder, max_length=None, report_to="none", use_cpu=True),
            )
        seen, prepared = dataset[0], trainer.train_dataset[0]
        pairs.append({
            "prompt": seen["prompt"], "chosen": seen["chosen"], "rejected": seen["rejected"],
            "tools": json.loads(seen["tools"]) if seen["tools"] else None,
            "prompt_ids": list(prepared["prompt_ids"]), "chosen_ids": list(prepared["chosen_ids"]),
            "rejected_ids": list(prepared["rejected_ids"]),
        })
    fixture = {
        "about": "prompt-completion ids and trained-token masks from TRL SFTTrainer(assistant_only_loss=True) "
                 "with its Qwen3 training template, and conversational preference ids from TRL DPOTrainer "
                 "with the tokenizer's own template; written by tools/parity_chat.py",
        "trl_version": trl.__version__,
        "trl_revision": args.revision,
        "transformers_version": transformers.__version__,
        "tokenizer": Path(args.tokenizer).name,
        "sft_chat_template": sft_template,
        "prompt_completions": completions,
        "preferences": pairs,
    }
    text = json.dumps(fixture, indent=1, ensure_ascii=False)
    text = re.sub(r"\[(\s*-?\d+,?)+\s*\]", lambda m: json.dumps(json.loads(m.group(0))), text)
    Path(args.formats_out).write_text(text + "\n", encoding="utf-8")
    print(f"wrote {args.formats_out}: {len(completions)} prompt-completion rows, {len(pairs)} preference pairs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    parser.add_argument("--gsm8k", default=str(DEFAULT_GSM8K))
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--formats-out", default=str(DEFAULT_FORMATS_OUT))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--revision", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args)
        return
    python = ensure_venv()
    revision = wheel_sha256(python)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(python), __file__, "--inside", "--revision", revision, "--tokenizer", args.tokenizer,
                    "--gsm8k", args.gsm8k, "--out", args.out, "--formats-out", args.formats_out],
                   check=True, env=env)


if __name__ == "__main__":
    main()
