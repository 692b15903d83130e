"""Run mypy (configured in pyproject.toml) and fail on any error that tools/mypy_baseline.txt
does not already hold, so the count of type errors can only go down.

    python tools/typecheck.py            # check: exit 1 on a new error, print the count
    python tools/typecheck.py --update   # rewrite the baseline after fixing errors (refused
                                         # while there are new ones: the baseline only shrinks)
    python tools/typecheck.py --update --accept-new   # also take new errors in, e.g. when code
                                         # moved to another file; the baseline's diff shows them

An error is keyed by file, code and message, without its line number, so editing a file above
an old error does not make it new; the baseline counts each key as often as it occurs. mypy
keeps its cache in .mypy_cache, so a second run takes about a second.

Not here: the configuration (pyproject.toml's [tool.mypy]); which files are checked is its
`files` list.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tools" / "mypy_baseline.txt"


def run_mypy() -> list[dict]:
    """mypy's errors (notes dropped), one dict per error, from its JSON output."""
    done = subprocess.run([sys.executable, "-m", "mypy", "--output", "json"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 2: mypy itself failed (a bad config, a crash)
        sys.exit(f"mypy failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    errors = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [e for e in errors if e["severity"] == "error"]


def key(error: dict) -> str:
    """The error without its position: file, code and message (other lines it names blanked)."""
    message = re.sub(r"\bline \d+", "line N", error["message"])
    return f"{error['file']}: [{error['code']}] {message}"


def read_baseline() -> collections.Counter:
    if not BASELINE.exists():
        return collections.Counter()
    return collections.Counter(line for line in BASELINE.read_text().splitlines() if line.strip())


def write_baseline(keys: collections.Counter) -> None:
    BASELINE.write_text("".join(f"{k}\n" for k in sorted(keys.elements())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline (only when nothing is new)")
    parser.add_argument("--accept-new", action="store_true",
                        help="with --update: take new errors into the baseline too (code moved between files)")
    args = parser.parse_args(argv)
    errors = run_mypy()
    found = collections.Counter(key(e) for e in errors)
    baseline = read_baseline()
    new = found - baseline
    fixed = sum((baseline - found).values())
    for error in errors:
        if new[key(error)] > 0:  # report the positions of the keys that grew
            print(f"{error['file']}:{error['line']}: error: {error['message']}  [{error['code']}]")
    total = sum(found.values())
    if new and not (args.update and args.accept_new):
        print(f"mypy: {sum(new.values())} new type error(s) not in {BASELINE.relative_to(ROOT)} "
              f"(listed above, with every occurrence of the same message); fix them")
        return 1
    if args.update:
        write_baseline(found)
        print(f"mypy: {total} errors; baseline rewritten ({fixed} fixed, {sum(new.values())} new accepted)")
        return 0
    hint = f"; {fixed} fixed: run `python tools/typecheck.py --update` to lower the baseline" if fixed else ""
    print(f"mypy: {total} errors, none new (baseline {sum(baseline.values())}){hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
