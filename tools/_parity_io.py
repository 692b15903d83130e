"""Shared plumbing for the torch-side parity scripts (tools/parity_dpo.py, tools/parity_grpo.py).

Two jobs: make a tools venv that holds the reference package beside the CPU build of torch and
re-run the calling script inside it, and write fixtures as JSON whose arrays say their own dtype
and shape. Fixture arrays are encoded as {"dtype": "float32", "shape": [2, 3], "data": [[...]]};
float32 values are written as the exact decimal of the float32 number, so `np.asarray(data,
dtype)` gives back the same bits. `load_array` in this module is the decoder the tests can copy.

Not here: any reference math (each script calls the reference itself), anything Dew imports.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "parity"
TORCH = "torch==2.13.0+cpu"  # the CPU wheel; a plain "torch==2.13.0" could resolve to a CUDA build
_INSIDE = "DEW_PARITY_INSIDE_VENV"


def _torch_requirement() -> str:
    wheels = glob.glob("/opt/wheels/torch-2.13.0+cpu-*.whl")
    return wheels[0] if wheels else TORCH


def run_in_venv(script: str, venv: Path, package: str, version: str, *, no_deps: bool,
                extras: list[str]) -> None:
    """Re-run `script` inside `venv`, creating it first when it lacks the pinned reference.

    The reference wheel is downloaded on its own and installed from the file, so pip records its
    sha256 in the dist-info's direct_url.json, which the fixture then quotes. With `no_deps`, only
    `extras` are installed beside it (verl pulls in GPU stacks otherwise). Returns only when
    already inside the venv; otherwise exits with the child's status.
    """
    if os.environ.get(_INSIDE) == str(venv):
        return
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m, torch; "
         f"print(torch.__version__, torch.version.cuda, m.version({package!r}))"],
        capture_output=True, text=True,
    )
    if probe.returncode != 0 or probe.stdout.split() != ["2.13.0+cpu", "None", version]:
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run(pip + [_torch_requirement(), "numpy"], check=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([str(python), "-m", "pip", "download", "--quiet", "--no-deps",
                            f"{package}=={version}", "-d", tmp], check=True)
            (wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
            subprocess.run(pip + (["--no-deps"] if no_deps else []) + [wheel], check=True)
        if extras:
            subprocess.run(pip + extras, check=True)
    env = dict(os.environ, **{_INSIDE: str(venv)})
    sys.exit(subprocess.run([str(python), script, *sys.argv[1:]], env=env).returncode)


def installed(package: str) -> dict:
    """Version, wheel sha256 (from direct_url.json when installed from a file) and location."""
    import importlib.metadata as metadata

    dist = metadata.distribution(package)
    direct = dist.read_text("direct_url.json")
    sha = None
    if direct:
        info = json.loads(direct).get("archive_info", {})
        sha = info.get("hashes", {}).get("sha256") or info.get("hash", "").removeprefix("sha256=")
    return {"package": package, "version": dist.version, "wheel_sha256": sha or None}


def source_sha256(module) -> dict:
    """sha256 of a module's source file, keyed by its path inside site-packages."""
    path = Path(module.__file__)
    parts = path.parts
    inside = parts[parts.index("site-packages") + 1:] if "site-packages" in parts else [path.name]
    key = "/".join(inside)
    return {key: hashlib.sha256(path.read_bytes()).hexdigest()}


def versions(*packages: str) -> dict:
    import importlib.metadata as metadata

    return {name: metadata.version(name) for name in packages}


def encode(value) -> dict:
    """A torch tensor, numpy array or Python number as {"dtype", "shape", "data"}."""
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype == np.bool_:
        array = array.astype(np.int32)
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise ValueError("fixture arrays must be finite")
    return {"dtype": str(array.dtype), "shape": list(array.shape), "data": array.tolist()}


def load_array(entry: dict):
    """Inverse of `encode` (numpy only)."""
    import numpy as np

    return np.asarray(entry["data"], dtype=entry["dtype"]).reshape(entry["shape"])


def write(name: str, document: dict) -> Path:
    """Write `document` under tests/fixtures/parity: indented structure, each array on one line."""
    arrays: list = []

    def pull(node):
        if isinstance(node, dict):
            if set(node) == {"dtype", "shape", "data"}:
                arrays.append(node["data"])
                return dict(node, data=f"@@array{len(arrays) - 1}@@")
            return {key: pull(value) for key, value in node.items()}
        if isinstance(node, list):
            return [pull(value) for value in node]
        return node

    text = json.dumps(pull(document), indent=1, allow_nan=False)
    for number, data in enumerate(arrays):
        text = text.replace(f'"@@array{number}@@"', json.dumps(data, separators=(",", ":")), 1)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / name
    path.write_text(text + "\n")
    return path
