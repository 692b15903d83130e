"""The layout's rules, read from the source: which package may import which, and module size.

    records       imports nothing else of dew_lib
    store         imports only records (so `dew sql` never loads JAX)
    objectives    no threads, no executors, no rollouts: pure losses
    dew_lib       never imports Prefect, flows or tasks
    a stage job   its processes (tasks.stage_job, tasks.stage_run) load no Prefect
    tasks         never imports flows (flows sequence tasks, not the other way round)

Imports are read with `ast`, function-local ones included, so a lazy import breaks a rule too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Every module name `path` imports, absolute, function-local imports included."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(package: str, forbidden) -> list[str]:
    return sorted(f"{path.relative_to(ROOT)} imports {name}"
                  for path in modules(package) for name in imported(path) if forbidden(name))


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_records_import_nothing_else_of_dew_lib():
    assert offenders("dew_lib/records", lambda n: under(n, "dew_lib") and not under(n, "dew_lib.records")) == []


def test_the_store_imports_only_records():
    allowed = ("dew_lib.store", "dew_lib.records")
    assert offenders("dew_lib/store", lambda n: under(n, "dew_lib") and not under(n, *allowed)) == []


def test_objectives_are_pure_losses():
    forbidden = ("threading", "concurrent", "queue", "dew_lib.rollouts")
    assert offenders("dew_lib/objectives", lambda n: under(n, *forbidden)) == []


def test_the_library_never_imports_prefect_flows_or_tasks():
    assert offenders("dew_lib", lambda n: under(n, "prefect", "flows", "tasks")) == []


def test_tasks_never_import_flows():
    assert offenders("tasks", lambda n: under(n, "flows")) == []


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for package in ("dew_lib", "tasks", "flows", "deployments")
            for p in modules(package) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_a_rule_breaker_is_caught(tmp_path):
    # The reader sees a function-local import, the way a lazy import would sneak JAX into records.
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from dew_lib.rollouts.packing import pack\n    import threading\n")
    assert imported(module) >= {"dew_lib.rollouts.packing", "dew_lib.rollouts.packing.pack", "threading"}


@pytest.mark.parametrize("package", ["dew_lib.store", "dew_lib.records", "dew_lib.cli", "dew_lib.train.launch"])
def test_the_store_the_records_the_cli_and_the_launcher_load_no_jax(package):
    probe = (f"import sys, {package}; "
             "print(sorted(m for m in ('jax', 'flax', 'optax', 'prefect') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("package", ["dew_lib.sampling", "dew_lib.objectives", "dew_lib.rollouts",
                                     "dew_lib.inference", "dew_lib.diffusion", "dew_lib.train",
                                     "dew_lib.recipes", "dew_lib.models", "dew_lib.data"])
def test_each_package_imports_first(package):
    # An import cycle only shows when its module is the first one loaded.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT, env=env, check=True)


def test_a_stage_job_process_loads_no_prefect():
    # What each process of a stage's job imports (python -m tasks.stage_job): the stage body and
    # everything it trains with, but not Prefect, which only the task that launches the job needs.
    probe = "import sys, tasks.stage_job, tasks.stage_run; print(sorted(m for m in sys.modules if under(m)))"
    probe = "under = lambda m: m == 'prefect' or m.startswith('prefect.')\n" + probe
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"
