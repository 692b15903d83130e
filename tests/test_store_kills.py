"""Superseded generations are reclaimed, also after crashes: real SIGKILLs of a writer process.

The writer is tests/store_worker.py, compacting on every write so that kills land in generation
swaps, snapshot builds and link moves. Fifty times (or as many as fit in 45 s on a loaded
machine, at least 20) it resumes a stage from a little before its last committed update and is
SIGKILLed after a random number of updates, at a random moment; then it finishes the stage. The
store must hold the same rows as a clean run's, and once the last publish is GRACE_SECONDS old,
the next query must leave each stream one generation and one snapshot (docs/store.md), with the
store's bytes within 2x a clean run's. Unpublished generations of a stage no writer reopens are
reclaimed by a writer of another run.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dew_lib.store import Store, snapshot
from dew_lib.store.parts import Stream
from dew_lib.store.rows import metrics_table, now

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(os.path.dirname(__file__), "store_worker.py")
STEPS, PROMPTS, SAMPLES = 100, 4, 4
CYCLES, CYCLE_SECONDS, MIN_CYCLES = 50, 45.0, 20  # 50 take ~35 s on an idle 2-core machine


@pytest.fixture
def ram_path(tmp_path):
    """A folder in memory (/dev/shm) where the machine has one, else `tmp_path`. The store fsyncs
    every file it writes, which on a disk is most of a writer's time; a SIGKILL, unlike a power
    cut, loses nothing that fsync would have kept, so the kills test the same on either."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="dew-test-", dir="/dev/shm")
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def start(path, *extra):
    return subprocess.Popen(
        [sys.executable, WORKER, str(path), "r", "grpo", "--steps", str(STEPS), "--prompts", str(PROMPTS),
         "--compact-after", "2", "--keep-loose", "0", "--merge-after", "2", *map(str, extra)],
        env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def census(path):
    """Generations per stream, snapshots, leftover temporary files and bytes of a project's store."""
    store = os.path.join(path, "store")
    gens, leftovers = {}, []
    for table in os.listdir(os.path.join(store, ".gens")):
        if table.startswith("_"):
            continue
        home = os.path.join(store, ".gens", table, "r", "grpo")
        gens[table] = sum(name.startswith("g") for name in os.listdir(home))
        leftovers += os.listdir(os.path.join(home, "tmp"))
    snaps = os.listdir(os.path.join(store, ".snaps"))
    size = sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(store)
               for name in names if not os.path.islink(os.path.join(folder, name)))
    return {"gens": gens, "snapshots": sum(n.endswith(".duckdb") for n in snaps),
            "leftovers": leftovers + [n for n in snaps if n.startswith("tmp-")], "bytes": size}


def query(path):
    out = subprocess.run([sys.executable, "-m", "dew_lib.cli", "sql", "--csv", "--store", str(path),
                          "SELECT count(*) AS n, count(DISTINCT update) AS updates FROM sessions"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[1]


@pytest.mark.slow
def test_kill_resume_cycles_leave_one_generation_per_stream_and_a_clean_runs_bytes(ram_path):
    clean, killed = ram_path / "clean", ram_path / "killed"
    done = start(clean)
    assert done.wait(timeout=300) == 0, done.stderr.read()[-3000:]
    rng, committed, kills, cycles = random.Random(0), -1, 0, 0
    cycling_from = time.monotonic()
    while cycles < CYCLES and (cycles < MIN_CYCLES or time.monotonic() - cycling_from < CYCLE_SECONDS):
        cycles += 1
        writer = start(killed, "--start", max(0, committed - rng.randint(0, 2)))
        wanted, seen = rng.randint(0, 3), 0
        for line in writer.stdout:
            if line.startswith("committed"):
                committed, seen = max(committed, int(line.split()[1])), seen + 1
                if seen > wanted:
                    break
        time.sleep(rng.random() * 0.03)  # anywhere in the next update: a part, a swap, a publish
        writer.send_signal(signal.SIGKILL)
        kills += writer.wait() == -signal.SIGKILL
    cycling = time.monotonic() - cycling_from
    final = start(killed, "--start", max(0, committed - 2))
    assert final.wait(timeout=300) == 0, final.stderr.read()[-3000:]
    ended = time.monotonic()
    right_after = census(clean), census(killed)
    time.sleep(max(0.0, snapshot.GRACE_SECONDS + 0.5 - (time.monotonic() - ended)))
    rows = f"{STEPS * PROMPTS * SAMPLES},{STEPS}"
    assert query(clean) == rows and query(killed) == rows  # every update, once; and the query collects
    clean_after, killed_after = census(clean), census(killed)
    print(f"\n{cycles} cycles ({kills} SIGKILLs, {committed + 1} updates committed) in {cycling:.0f} s; "
          f"right after the last writer: clean {right_after[0]}, killed {right_after[1]}; "
          f"after {snapshot.GRACE_SECONDS:.0f} s and one query: clean {clean_after}, killed {killed_after}, "
          f"bytes {killed_after['bytes'] / clean_after['bytes']:.2f}x the clean run's")
    assert kills == cycles >= MIN_CYCLES
    assert right_after[1]["bytes"] <= 2 * right_after[0]["bytes"]
    for found in (clean_after, killed_after):
        assert set(found["gens"].values()) == {1} and found["snapshots"] == 1 and found["leftovers"] == []
    assert killed_after["bytes"] <= 2 * clean_after["bytes"]


def test_generations_a_killed_writer_never_published_go_with_the_next_writer(tmp_path):
    store = Store(tmp_path)
    store.create()
    stream = Stream(store.directory, "metrics", "gone", "sft", "step", compact_after=2, keep_loose=0,
                    on_change=lambda: None)  # a writer that dies before it publishes ...
    for step in range(4):
        stream.write(step, metrics_table({"loss": 1.0}, run="gone", stage="sft", step=step, when=now()))
    home = os.path.dirname(stream.gen)
    number = int(os.path.basename(stream.gen)[1:])
    shutil.copytree(stream.gen, os.path.join(home, f"g{number + 1:06d}"))  # ... in a swap it never linked
    with open(os.path.join(home, "tmp", "half-written.tmp"), "wb") as f:  # ... and in a write
        f.write(b"x" * 1000)
    assert len([n for n in os.listdir(home) if n.startswith("g")]) > 2
    with store.writer("other", background=False) as writer, writer.stage("sft") as stage:  # another run
        stage.metrics(0, {"loss": 1.0})
    assert sorted(os.listdir(home)) == [os.path.basename(stream.gen), "tmp"]
    assert os.listdir(os.path.join(home, "tmp")) == []
    assert store.rows("SELECT count(*) FROM metrics WHERE run = 'gone'")[1] == [(4,)]


def test_a_live_writers_unlinked_generation_is_left_alone(tmp_path):
    store = Store(tmp_path)
    with store.writer("live", background=False) as writer, writer.stage("sft") as stage:
        stage.metrics(0, {"loss": 1.0})
        home = os.path.dirname(stage.streams["metrics"].gen)
        building = os.path.join(home, "g999999")  # what its next swap may be building now
        os.makedirs(building)
        Store(tmp_path).writer("other", background=False).close()  # its sweep runs beside the live writer
        assert os.path.isdir(building)
        os.rmdir(building)
