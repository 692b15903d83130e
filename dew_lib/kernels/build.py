"""Compile a kernel's C++ source into a cached shared library and register its FFI handlers."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=fast")


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled or loaded on this machine."""


def cache_dir() -> Path:
    if os.environ.get("DEW_KERNEL_CACHE"):
        return Path(os.environ["DEW_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dew" / "kernels"


def compiler() -> str:
    name = os.environ.get("CXX", "c++")
    found = shutil.which(name)
    if found is None:
        raise KernelBuildError(
            f"no C++ compiler: `{name}` is not on PATH. Dew's CPU attention kernel compiles on "
            "first use; install one (Debian/Ubuntu: apt-get install g++) or point CXX at it, "
            "or pick attention_kernel='blockwise', which needs none")
    return found


def _cpu_features() -> str:
    """What `-march=native` depends on: the CPU's flags where Linux lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(name: str) -> Path:
    """The shared library of `name`.cc, compiled now unless the cache holds this build."""
    source = SOURCES / f"{name}.cc"
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([
        source.read_text(), cxx, version, jaxlib.__version__, " ".join(FLAGS), _cpu_features(),
    ]).encode()).hexdigest()[:16]
    library = cache_dir() / f"{name}-{key}.so"
    if library.exists():
        return library
    log.warning("compiling %s for this CPU into %s (once per machine, a few seconds)", source.name,
                library.parent)
    # each process writes its own file and renames it into place, so concurrent builds agree
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
    except OSError as error:
        raise KernelBuildError(f"cannot write the kernel cache {library.parent} ({error}); point "
                               "DEW_KERNEL_CACHE at a writable folder") from error
    os.close(fd)
    command = [cxx, *FLAGS, "-isystem", jax.ffi.include_dir(), str(source), "-o", partial]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(partial)
        raise KernelBuildError(f"compiling {source} failed ({' '.join(command)}):\n{done.stderr}")
    os.replace(partial, library)
    return library


@functools.cache
def load_causal_attention() -> None:
    """Registers `dew_causal_attention_forward` and `_backward` with JAX for the CPU."""
    library = ctypes.cdll.LoadLibrary(str(build("causal_attention")))
    for target, symbol in (("dew_causal_attention_forward", library.DewCausalAttentionForward),
                           ("dew_causal_attention_backward", library.DewCausalAttentionBackward)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
