"""How fast ChatMessages turns GSM8K into packed SFT batches, against apply_chat_template alone.

    .venv/bin/python bench/load_data.py [--tokenizer DIR] [--rows N] [--repeats 2]

GSM8K's train split (7473 rows) becomes [user question, assistant answer] conversations in a
JSONL file. Each measurement runs in a fresh subprocess:

- floor: `tokenizer.apply_chat_template(messages)` (rendering and tokenizing, nothing else) on
  every row, one call per row, with the tokenizer already loaded: the least work any loader
  that uses the chat template must do;
- dew, with 0, 1 and 2 workers: `ChatMessages(...).load(batch=16)` and reading batches until
  every conversation has been packed once. Dew renders each conversation once per prefix (three
  renders for a two-message chat), checks the prefixes, assigns roles and packs [16, 1024] rows.
  The tokenizer is loaded before the clock starts, as for the floor; the clock then covers
  `load()` (reading and checking the file), starting the worker processes and handing them the
  tokenizer, and every batch ("total"). "steady" leaves out everything up to the first batch.

It prints records/s and tokens/s of each, dew's rate as a ratio of the floor's, and the CPU
seconds each spent per 1000 records (all processes: a measure of work that other load on the
machine does not change; wall-clock rates do change with it, and 2 workers can only beat 1 when a
second core is free). Targets: dew with 1 worker at least 1/3 of the floor; 2 workers faster
than 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import show_cpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"

MEASURE = r"""
import glob, json, os, resource, sys, time
kind, path, tokenizer_dir, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def cpu():
    # this process plus its live children (the data workers), in seconds
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    for listing in glob.glob("/proc/self/task/*/children"):
        for pid in open(listing).read().split():
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except OSError:
                pass
    return total

rows = [json.loads(line)["messages"] for line in open(path, encoding="utf-8")]
if kind == "floor":
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.apply_chat_template(rows[0])  # compile the template outside the clock
    start, cpu_start = time.perf_counter(), cpu()
    tokens = sum(len(tokenizer.apply_chat_template(m)["input_ids"]) for m in rows)
    seconds = time.perf_counter() - start
    print(json.dumps({"records": len(rows), "tokens": tokens, "seconds": seconds, "steady": seconds,
                      "cpu": cpu() - cpu_start}))
else:
    from dew_lib.data import ChatMessages, Loading, Partition
    from dew_lib.data.tokenizer import load_tokenizer
    load_tokenizer(tokenizer_dir)  # as the floor, outside the clock
    start, cpu_start = time.perf_counter(), cpu()
    data = ChatMessages(path=path, tokenizer=tokenizer_dir, seq_len=1023,
                        loading=Loading(workers=workers, read_buffer=4)).load(batch=16)
    stream = data.stream(Partition())
    records = tokens = 0
    first = None
    while records < len(rows):
        batch = next(stream)
        segments = batch["text_segment_ids"]
        records += int(segments.max(axis=1).sum())
        tokens += int((segments > 0).sum())
        if first is None:
            first = time.perf_counter()
            first_records, first_tokens = records, tokens
    seconds = time.perf_counter() - start
    steady = time.perf_counter() - first
    print(json.dumps({"records": records, "tokens": tokens, "seconds": seconds, "steady": steady,
                      "cpu": cpu() - cpu_start,
                      "steady_records": records - first_records, "steady_tokens": tokens - first_tokens}))
"""


def measure(kind: str, path: str, tokenizer: str, workers: int = 0) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, kind, path, tokenizer, str(workers)],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "qwen3"))
    parser.add_argument("--gsm8k", default=str(SHARED / "gsm8k" / "train.jsonl"))
    parser.add_argument("--rows", type=int, default=None, help="use the first N rows (default: all)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each; the fastest counts")
    args = parser.parse_args()
    show_cpu()
    load = os.getloadavg()
    with open(args.gsm8k, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle][:args.rows]
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "gsm8k_chat.jsonl")
        with open(path, "w", encoding="utf-8") as out:
            for r in rows:
                out.write(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                                   {"role": "assistant", "content": r["answer"]}]}) + "\n")
        runs = {"floor": ("floor", 0), "dew, 0 workers": ("dew", 0), "dew, 1 worker": ("dew", 1),
                "dew, 2 workers": ("dew", 2)}
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, (kind, workers) in runs.items():
                result = measure(kind, path, args.tokenizer, workers)
                if name not in best or result["seconds"] < best[name]["seconds"]:
                    best[name] = result
    floor = best["floor"]
    floor_rate = floor["records"] / floor["seconds"]
    print(f"GSM8K train as chat: {len(rows)} conversations, tokenizer {Path(args.tokenizer).name}, "
          f"best of {args.repeats}; {os.cpu_count()} cores, load average before the runs {load[0]:.1f}")
    print(f"{'':16} {'records/s':>10} {'tokens/s':>10} {'ratio':>7}   {'steady rec/s':>12} {'ratio':>7}   "
          f"{'cpu s/1k rec':>12}")
    for name, r in best.items():
        rate = r["records"] / r["seconds"]
        tokens = r["tokens"] / r["seconds"]
        steady = r.get("steady_records", r["records"]) / r["steady"]
        print(f"{name:16} {rate:10.0f} {tokens:10.0f} {rate / floor_rate:7.2f}   {steady:12.0f} "
              f"{steady / floor_rate:7.2f}   {1000 * r['cpu'] / r['records']:12.2f}")
    one = best["dew, 1 worker"]["records"] / best["dew, 1 worker"]["seconds"]
    two = best["dew, 2 workers"]["records"] / best["dew, 2 workers"]["seconds"]
    print(f"targets: 1 worker >= 1/3 of floor: {one / floor_rate:.2f} "
          f"({'met' if one >= floor_rate / 3 else 'missed'}); 2 workers / 1 worker: {two / one:.2f} "
          f"({'met' if two > one else 'missed'})")


if __name__ == "__main__":
    main()
