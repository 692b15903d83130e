"""Shared fixtures: tiny float32 models and deterministic batches."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

# No persistent compilation cache, in this process or any a test starts. Measured on a clean
# 2-core clone, one cache shared by every process saved nothing (the suite took 1,468.9 s with
# it, 1,467.9 s without): the suite compiles about 1,100 distinct programs of 50 ms or more,
# nearly each once, and a process already reuses its own identical programs (program_cache.py).
# An earlier try also crashed xdist workers in CI while they loaded executables, most likely at
# the kernel's memory-map limit (vm.max_map_count, 65,530; a CPU executable holds about six maps,
# and the workers then kept every module's programs, which _compilation_per_module now drops).
# Nor does JAX's jax_share_binary_between_hosts (process 0 compiles, the others load) work for
# the multi-process jobs: on CPU each process's devices hash to another key, so process 1 waits
# for a program process 0 shared under a different one until the job's gloo setup times out.
for variable in [name for name in os.environ if name.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))]:
    del os.environ[variable]

import jax  # noqa: E402

# Python's cyclic garbage collector checks its youngest objects every 700 new containers, and
# each hundredth check grows into a walk of the whole heap of JAX and Prefect objects. Tracing
# makes containers by the hundred thousand: test_trainer.py ran 1,135 young collections and 9 of
# the whole heap. Every 20,000 instead (measured with gc.callbacks): test_trainer.py spent 0.33 s
# collecting against 1.25 s (of 24 s of CPU), test_retrain_rules.py 2.15 s against 3.62 s. This
# holds in each process that imports this module (the test workers, the worker scripts and
# run_on_host_devices' scripts); the library's own processes keep Python's default.
gc.set_threshold(20_000)

# Most tests compile tiny programs and run them a few times, so XLA's optimizing passes cost more
# than they save. With most of them off (jax_disable_most_optimizations: LLVM at -O0, no expensive
# passes) a module takes about a third less CPU time, the tiny Prefect pipelines included; the HLO
# is the same, only the machine code is plainer. A module with a test marked `optimized` keeps them:
# big arrays (the GSM8K pipeline's 151,669-id head took 2.2x the CPU time compiled plainly), or
# values compared with fixtures recorded from optimized programs. The choice also holds in every
# process a test starts, through the environment. DEW_TEST_PLAIN_COMPILE=0 compiles all fully.
#
# Compiling plainly also sets two XLA:CPU options, the same in every process of a test: the
# pytest process through the option of each compile below, the processes a test starts through
# XLA_FLAGS (a test that sets its own XLA_FLAGS passes these on: xla_flags()).
# - The fusion emitters (the MLIR ones) off: the older loop emitters generate each fusion instead,
#   which halves what compiling a tiny training step costs. Results move by float rounding (a tiny
#   decoder's logits by 7e-7).
# - Each program's machine code generated as one LLVM module, not split into parts compiled on
#   threads (xla_cpu_parallel_codegen_split_count=1). The two cores are busy with two workers
#   anyway, and every part repeated the per-module work: a tiny SFT step took 28% less CPU time to
#   compile, test_distributed.py 20% less CPU time in all (184 s against 229 s).
PLAIN = os.environ.get("DEW_TEST_PLAIN_COMPILE", "1") != "0"
_OPTIMIZED_MODULES: set[str] = set()
PLAIN_XLA_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
PLAIN_XLA_FLAGS = " ".join(f"--{name}={str(value).lower()}" for name, value in PLAIN_XLA_OPTIONS.items())
_UNTOUCHED_XLA_FLAGS = os.environ.get("XLA_FLAGS")


def _plain_compile_options():
    """Wrap JAX's compile options (a private function: its one hook for a per-compile XLA option)
    so that a plain compile also sets PLAIN_XLA_OPTIONS. Where a JAX release moves it, the
    tests compile as before, only slower."""
    from jax._src import compiler

    original = getattr(compiler, "get_compile_options", None)
    switch = getattr(compiler, "_DISABLE_MOST_OPTIMIZATIONS", None)
    if original is None or switch is None or getattr(original, "plain_options", False):
        return

    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        if switch.value:
            env_options_overrides = {**(env_options_overrides or {}), **PLAIN_XLA_OPTIONS}
        return original(*args, env_options_overrides=env_options_overrides, **kwargs)

    get_compile_options.plain_options = True
    compiler.get_compile_options = get_compile_options


if PLAIN:
    _plain_compile_options()

# Identical programs compiled again in one process (the same tiny model in a new Trainer) reuse
# the executable: program_cache.py. DEW_TEST_PROGRAM_CACHE=0 compiles each; with
# DEW_TEST_PROGRAM_CACHE_LOG=FILE each module appends what it compiled and reused.
PROGRAM_CACHE = os.environ.get("DEW_TEST_PROGRAM_CACHE", "1") != "0"
if PROGRAM_CACHE:
    import program_cache

    program_cache.install()


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a process a test starts: `flags` and, while the module compiles plainly,
    what plain compiling adds (above); any host device count already there gives way to `flags`."""
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in flag]
    return " ".join([*kept, *flags])


@pytest.fixture(scope="module", autouse=True)
def _compilation_per_module(request):
    """Compile with the effort the module needs (above), and drop every compiled executable once
    the module is done. A worker runs hundreds of modules, and JAX keeps what each compiled for
    the life of the process: without this a worker's memory grows with every module it has run."""
    plain = PLAIN and request.module.__name__ not in _OPTIMIZED_MODULES
    jax.config.update("jax_disable_most_optimizations", plain)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1" if plain else "0"  # and every process it starts
    if plain:
        os.environ["XLA_FLAGS"] = " ".join([_UNTOUCHED_XLA_FLAGS or "", PLAIN_XLA_FLAGS]).strip()
    yield
    jax.config.update("jax_disable_most_optimizations", False)
    os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    if _UNTOUCHED_XLA_FLAGS is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = _UNTOUCHED_XLA_FLAGS
    jax.clear_caches()
    if PROGRAM_CACHE:
        program_cache.clear(request.module.__name__, os.environ.get("DEW_TEST_PROGRAM_CACHE_LOG"))
    gc.collect()


# The workplace's public data sits beside the repository; DEW_SHARED_DATA points elsewhere.
SHARED_DATA = os.environ.get("DEW_SHARED_DATA") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


def tiny_model(**overrides):
    from dew_lib import models

    options = dict(vocab_size=32, emb_features=16, num_layers=2, num_heads=4, num_kv_heads=2,
                   mlp_features=32, max_seq_len=32, qk_norm=True)
    options.update(overrides)
    return models.build("causal_transformer", **options)


def pairs_batch():
    """Eight preference pairs of four ids that differ only in their third id; the last two ids
    are the completion. What the DPO tests train on."""
    import json

    from dew_lib.data import Loading, Partition, PreferencePairs

    rows = [{"chosen": [1, p, 3, 5], "rejected": [1, p, 4, 5],
             "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1]} for p in (2, 6, 7, 8)]
    spec = PreferencePairs(records=tuple(json.dumps(r) for r in rows * 2), seq_len=4,
                           loading=Loading(workers=0, threads=1, read_buffer=2))
    return next(iter(spec.load(batch=8).train(Partition())))


def fit_adapters(model, variables, steps=8):
    """`steps` AdamW steps of next-token training on four random rows, on a model whose
    `variables` hold LoRA adapters: the final state and the sink its metrics went to."""
    import optax

    from dew_lib import Dataset, LMObjective, Trainer
    from dew_lib.train.sinks import MemorySink

    batches, sink = list(lm_batches(0, 8, 9, count=4)), MemorySink()
    trainer = Trainer(LMObjective(model, seq_len=8, pretrained=variables, ema_decay=None), optax.adamw(1e-2),
                      key=jax.random.key(0))
    state = trainer.fit(Dataset(train=lambda p: itertools.cycle(batches), batch=8), steps=steps, log_every=4,
                        sinks=[sink])
    return state, sink


def dense_mask(segments):
    """The `[B, S, S]` mask of causal attention within segments, for the dense reference."""
    import jax.numpy as jnp

    s = segments.shape[1]
    return jnp.tril(jnp.ones((s, s), bool))[None] & (segments[:, :, None] == segments[:, None, :])


def lm_batches(seed: int, batch: int, width: int, vocab: int = 32, count: int | None = None):
    """A deterministic stream of random `text` batches."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(1, vocab, size=(batch, width)).astype(np.int32) for _ in range(count or 64)]
    stream = itertools.cycle(rows) if count is None else iter(rows)
    return ({"text": r} for r in stream)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """Under `-n N` (xdist's default `--dist load`), the tests that share a module-scoped
    fixture run on one worker, which builds it once (xdist_units.py)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist_units import make_scheduler

    return make_scheduler(config, log)


_SECONDS_BY_MODULE: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Add up each module's seconds (setup, call and teardown); under xdist the reports of every
    worker reach the controller, so the sum covers the whole session."""
    module = report.nodeid.split("::")[0]
    _SECONDS_BY_MODULE[module] = _SECONDS_BY_MODULE.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The modules that took longest, summed over their tests: where the suite's time goes."""
    if not _SECONDS_BY_MODULE:
        return
    ranked = sorted(_SECONDS_BY_MODULE.items(), key=lambda pair: -pair[1])
    total = sum(_SECONDS_BY_MODULE.values())
    terminalreporter.write_sep("=", f"slowest modules (of {total:.0f} s in tests, all workers together)")
    for module, seconds in ranked[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {module}")


def pytest_collection_finish(session):
    """Move everything alive after collection (every imported module: JAX, Prefect, flax, the
    test modules) out of the garbage collector's sight: it is never garbage, and each full
    collection walked all of it. The test workers ran about 110 full collections each (one at
    every module's end, the rest automatic) at about 0.5 s apiece, some 60 s of a worker's
    500 s of CPU (gc.callbacks); frozen, a full collection of the same modules took 0.19 s
    against 0.42 s."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Slow tests first: under xdist each worker then ends on short tests, not one of them on a
    two-minute run while the other idles (longest first). xdist orders the work units by their
    size and keeps this order within one size, and every worker reorders alike."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    _OPTIMIZED_MODULES.update(item.module.__name__ for item in items
                              if getattr(item, "module", None) and item.get_closest_marker("optimized"))


@pytest.fixture
def shared_data():
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"shared data not found at {SHARED_DATA}; set DEW_SHARED_DATA to its directory")
    return SHARED_DATA


@pytest.fixture
def chromium():
    """The headless browser's executable (tests/browser.py drives it); the test skips without one."""
    from browser import find_chromium

    path = find_chromium()
    if path is None:
        pytest.skip("chromium is not installed (`make browser-tools` installs it as root on Debian; "
                    "or apt-get install chromium)")
    return path


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect's test harness (a temporary API and database), started once per test process for
    every module that runs flows: starting it takes tens of seconds on a busy machine."""
    pytest.importorskip("prefect")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def run_on_host_devices(script: str, devices: int = 2, timeout: float = 120) -> str:
    """Run a Python `script` in a fresh process whose CPU is split into `devices` XLA devices
    (the count is fixed when JAX starts, so it cannot change inside this process); returns its
    stdout. The tests' directory is importable, so the script can use `conftest`."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")


def worker_job(processes, local_devices, recipes, out, *extra, check=True, env=None):
    """`dew launch` of tests/distributed_worker.py: `processes` processes of `local_devices` host
    devices each train `recipes` and write their final states to OUT-<recipe>.npz."""
    command = [sys.executable, "-m", "dew_lib.cli", "launch", "--processes", str(processes),
               "--local-devices", str(local_devices), "--", sys.executable, WORKER, recipes, str(out), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    if check:
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done


def npz_leaves(path):
    """The state leaves a worker saved, in tree order."""
    with np.load(path) as data:
        return [data[str(i)] for i in range(len(data.files))]


@contextlib.contextmanager
def run_log():
    """The messages of the flow and task run loggers while the block runs."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, loggers = Keep(level=logging.INFO), [logging.getLogger(n) for n in
                                                  ("prefect.task_runs", "prefect.flow_runs")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield lines
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def launched_serve(arguments, env=None, timeout=180):
    """`dew serve ARGUMENTS` in a subprocess, on the tests' JAX cache: yields the process, the
    line it printed when it started listening, and the list its output lines keep arriving in.
    Killed on the way out if the test has not stopped it."""
    import queue
    import threading
    import time

    environment = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **(env or {}))
    process = subprocess.Popen([sys.executable, "-m", "dew_lib.cli", "serve", *arguments],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        seen, deadline = [], time.monotonic() + timeout
        while not any("dew serve:" in line for line in seen):
            assert process.poll() is None and time.monotonic() < deadline, "".join(seen)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        yield process, next(line for line in seen if "dew serve:" in line), seen
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
