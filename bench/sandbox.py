"""What isolation costs: programs per second through SandboxFleet against plain subprocess.run.

    .venv/bin/python bench/sandbox.py [--programs 24] [--rounds 5] [--workers 1 2 4] [--image IMG]

Three workloads, each the same Program on both sides:
- true: `true`, no interpreter (the runner's fixed cost, undiluted);
- print: `python3 main.py` printing one line (the trivial program CodeReward runs);
- humaneval: CodeReward's assert harness on a HumanEval canonical solution (problems 0..N-1).

For each runner (process, namespace, and container when `docker info` answers) and each worker
count, rounds alternate between the fleet and the peer: a thread pool of the same size whose
threads make a temporary directory, write the files, `subprocess.run` the argv with the stdin
(in a new session, as the runners do, so Linux's per-session autogroup scheduling treats both
sides alike), and remove the directory. Each side's programs/s is the median over rounds; "cost" is the
peer's rate over the fleet's (1.0 = free). The machine's other load moves single rounds a lot;
compare the ratios, and run it twice.
Targets: namespace within 3x of subprocess.run on `print`; throughput rising from 1 to 2 workers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import show_cpu  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import report  # noqa: E402
from dew_lib.rewards.code import HARNESS, parse_tests  # noqa: E402
from dew_lib.sandbox import (  # noqa: E402
    ContainerRunner,
    NamespaceRunner,
    ProcessRunner,
    Program,
    SandboxFleet,
    SandboxLimits,
    SandboxUnavailable,
    Verdict,
)
from dew_lib.sandbox.launcher import PATH  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
LIMITS = SandboxLimits(wall_seconds=30, memory_bytes=512 << 20)


def workloads(count: int) -> dict[str, list[Program]]:
    with gzip.open(SHARED / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    checks = []
    for i in range(count):
        row = rows[i % len(rows)]
        tests = parse_tests(row)
        files = {"main.py": HARNESS, "solution.py": row["prompt"] + row["canonical_solution"],
                 "tests.json": json.dumps({"setup": tests.setup, "tests": list(tests.tests)})}
        checks.append(Program(files=files, argv=("python3", "main.py"), stdin="token\n"))
    return {
        "true": [Program(argv=("true",))] * count,
        "print": [Program(files={"main.py": "print('ok')"}, argv=("python3", "main.py"))] * count,
        "humaneval": checks,
    }


def plain(program: Program) -> None:
    """The peer: the same program with subprocess.run and nothing else."""
    job = tempfile.mkdtemp(prefix="dew-bench-")
    try:
        for name, content in program.files.items():
            with open(os.path.join(job, name), "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        # The same interpreter the sandbox finds on its PATH (not a shell shim earlier on ours).
        argv = [shutil.which(program.argv[0], path=PATH), *program.argv[1:]]
        # A new session like the runners' own: with the kernel's per-session autogroup
        # scheduling, a session gets its own CPU share on a busy machine, which would otherwise
        # count as a speed-up of the runners.
        done = subprocess.run(argv, cwd=job, input=program.stdin_bytes, capture_output=True,
                              timeout=LIMITS.wall_seconds, start_new_session=True)
        if done.returncode != 0:
            raise RuntimeError(f"peer run failed: {done.stderr[-500:]!r}")
    finally:
        shutil.rmtree(job)


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(runner, programs: list[Program], workers: int, rounds: int) -> dict:
    fleet_times, peer_times = [], []
    with SandboxFleet(runner, limits=LIMITS, workers=workers) as fleet, \
            ThreadPoolExecutor(max_workers=workers) as peer:
        fleet.map(programs[:workers])  # warm: page cache, the runner's first launch
        list(peer.map(plain, programs[:workers]))

        def run_fleet():
            bad = [o for o in fleet.map(programs) if o.verdict is not Verdict.COMPLETED]
            if bad:
                raise RuntimeError(f"fleet run failed: {bad[0]}")

        for _ in range(rounds):
            fleet_times.append(timed(run_fleet))
            peer_times.append(timed(lambda: list(peer.map(plain, programs))))
    n = len(programs)
    fleet_rate, peer_rate = n / statistics.median(fleet_times), n / statistics.median(peer_times)
    return dict(fleet=fleet_rate, peer=peer_rate, cost=peer_rate / fleet_rate)


def runners(image: str) -> dict:
    found = {"process": ProcessRunner()}
    try:
        found["namespace"] = NamespaceRunner()
    except SandboxUnavailable as error:
        print(f"namespace runner skipped: {error}")
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        found["container"] = ContainerRunner(image)
    else:
        print("container runner skipped: docker info does not answer")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=24, help="programs per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workloads", nargs="+", default=["true", "print", "humaneval"])
    parser.add_argument("--runners", nargs="+", default=["process", "namespace", "container"])
    parser.add_argument("--image", default=os.environ.get("DEW_SANDBOX_IMAGE", "python:3.12-slim"),
                        help="the container runner's image (needs python3; nothing is pulled)")
    args = parser.parse_args()
    show_cpu()
    programs = workloads(args.programs)
    results = {}
    for name, runner in runners(args.image).items():
        if name not in args.runners:
            continue
        for workload in args.workloads:
            rows = []
            for workers in args.workers:
                r = measure(runner, programs[workload], workers, args.rounds)
                results[f"{name}/{workload}/{workers}"] = r
                rows.append((f"{workers} worker{'s' if workers > 1 else ''}",
                             f"{r['fleet']:7.1f} programs/s vs subprocess.run {r['peer']:7.1f}  "
                             f"cost {r['cost']:.2f}x"))
            report(f"{name} runner, {workload} ({args.programs} programs, median of {args.rounds} rounds)", rows)
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
