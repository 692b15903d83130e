"""Write tests/fixtures/flow/flow_grpo_sde.json: the released Flow-GRPO SDE step on fixed tensors.

    python tools/parity_flow.py --repo PATH [--revision REV] [--out FILE]

PATH is a clone of the public Flow-GRPO repository (yifan123/flow_grpo; a bare clone works).
The script reads `flow_grpo/diffusers_patch/sd3_sde_with_logprob.py` and
`flow_grpo/stat_tracking.py` at REV with `git show`, loads them as modules (their diffusers
imports are stubbed: only the scheduler's `sigmas` and `index_for_timestep` are used, and the
noise sampler is never called because every call passes `prev_sample`), and records what they
compute. Nothing of that code is copied into Dew. It runs itself inside tools/.venv-flow
(created on first use with torch 2.13.0, the CPU wheel kept on local disk, and numpy).

What it records, for two schedules and two noise levels:
- each transition's inputs (state, velocity, a second "reference" velocity, the next state
  drawn from the released transition) and the released outputs: `prev_sample_mean`,
  `std_dev_t`, `sqrt(-dt)` and the mean per-coordinate `log_prob`;
- the released SD3 trainer's KL regularizer for that transition, evaluated with the expression
  of scripts/train_sd3.py (`((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t ** 2)`,
  then the batch mean), from the released step's two means;
- `PerPromptStatTracker.update` advantages for float64 rewards of contiguous prompt groups.
Tests compare Dew's transition, joint log density (divided by the coordinate count), conditional
KL (times the elapsed time) and group advantages with these numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "tools" / ".venv-flow"
TORCH_VERSION = "2.13.0"
REPOSITORY = "yifan123/flow_grpo"
SDE_FILE = "flow_grpo/diffusers_patch/sd3_sde_with_logprob.py"
STATS_FILE = "flow_grpo/stat_tracking.py"
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "flow" / "flow_grpo_sde.json"


def ensure_venv() -> None:
    """Re-run inside tools/.venv-flow (creating it) unless torch is importable here."""
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"torch=={TORCH_VERSION}", "numpy"],
                       check=True)
    os.execv(str(python), [str(python), *sys.argv])


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def load_released(repo: Path, revision: str, directory: Path):
    """Import the released SDE step and stat tracker from `revision`, diffusers stubbed."""
    import torch

    def never(*args, **kwargs):
        raise AssertionError("the parity script always passes prev_sample; randn_tensor must not run")

    stubs = {
        "diffusers": types.ModuleType("diffusers"),
        "diffusers.utils": types.ModuleType("diffusers.utils"),
        "diffusers.utils.torch_utils": types.ModuleType("diffusers.utils.torch_utils"),
        "diffusers.schedulers": types.ModuleType("diffusers.schedulers"),
        "diffusers.schedulers.scheduling_flow_match_euler_discrete":
            types.ModuleType("diffusers.schedulers.scheduling_flow_match_euler_discrete"),
    }
    stubs["diffusers.utils.torch_utils"].randn_tensor = never
    stubs["diffusers.schedulers.scheduling_flow_match_euler_discrete"].FlowMatchEulerDiscreteScheduler = object
    sys.modules.update(stubs)
    modules = {}
    for name, path in (("released_sde", SDE_FILE), ("released_stats", STATS_FILE)):
        target = directory / f"{name}.py"
        target.write_text(git(repo, "show", f"{revision}:{path}"), encoding="utf-8")
        spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[name] = module
    del torch
    return modules["released_sde"], modules["released_stats"]


class Scheduler:
    """What the released step reads from a diffusers FlowMatchEulerDiscreteScheduler."""

    def __init__(self, times):
        import torch

        self.sigmas = torch.tensor(times, dtype=torch.float32)  # ends at 0, as diffusers appends it
        self.timesteps = self.sigmas[:-1] * 1000.0

    def index_for_timestep(self, timestep):
        matches = (self.timesteps == timestep).nonzero()
        assert len(matches) == 1, f"timestep {timestep} is not on the schedule"
        return int(matches[0, 0])


def schedule(steps: int, shift: float):
    """Dew's Process.times: evenly spaced from 1 to 0, then t -> shift t / (1 + (shift - 1) t),
    in float64 rounded once to float32."""
    import numpy as np

    t = np.linspace(1.0, 0.0, steps, dtype=np.float64)
    if shift != 1.0:
        t = shift * t / (1.0 + (shift - 1.0) * t)
    return t.astype(np.float32)


def short(values):
    """float32 values as the shortest decimals that read back to the same float32."""
    import numpy as np

    array = np.asarray(values, np.float32)
    return np.vectorize(lambda v: float(str(v)), otypes=[float])(array).tolist()


def nhwc(tensor):
    return short(tensor.permute(0, 2, 3, 1).contiguous().numpy())


def record_case(step_fn, steps: int, shift: float, noise_level: float, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    times = schedule(steps, shift)
    scheduler = Scheduler(times.tolist())
    rows, channels, size = 3, 2, 4
    transitions = []
    for j in range(steps - 1):
        x = torch.randn(rows, channels, size, size, generator=generator)
        v = torch.randn(rows, channels, size, size, generator=generator)
        v_ref = v + 0.1 * torch.randn(rows, channels, size, size, generator=generator)
        eps = torch.randn(rows, channels, size, size, generator=generator)
        t = scheduler.timesteps[j].repeat(rows)
        # sqrt(-dt) as the released step forms it (newer revisions can also return it)
        sqrt_dt = torch.sqrt(-(scheduler.sigmas[j + 1] - scheduler.sigmas[j])).repeat(rows).view(-1, 1, 1, 1)
        _, _, mean, std_dev_t = step_fn(scheduler, v, t, x, noise_level=noise_level, prev_sample=x)[:4]
        drawn = mean + std_dev_t * sqrt_dt * eps
        _, log_prob, mean, std_dev_t = step_fn(scheduler, v, t, x, noise_level=noise_level,
                                               prev_sample=drawn)[:4]
        _, _, mean_ref, _ = step_fn(scheduler, v_ref, t, x, noise_level=noise_level, prev_sample=drawn)[:4]
        # scripts/train_sd3.py, the beta > 0 branch of the training loop:
        kl_loss = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)
        transitions.append({
            "t": short(times[j]), "t_next": short(times[j + 1]),
            "x": nhwc(x), "v": nhwc(v), "v_ref": nhwc(v_ref), "next": nhwc(drawn),
            "mean": nhwc(mean), "mean_ref": nhwc(mean_ref),
            "std_dev_t": short(std_dev_t.reshape(-1)), "sqrt_dt": short(sqrt_dt.reshape(-1)),
            "log_prob": short(log_prob), "kl_loss": short(torch.mean(kl_loss)),
        })
    return {"steps": steps, "shift": shift, "noise_level": noise_level, "times": short(times),
            "transitions": transitions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="a clone of yifan123/flow_grpo")
    parser.add_argument("--revision", default="HEAD")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    ensure_venv()
    import numpy as np
    import torch

    revision = git(args.repo, "rev-parse", f"{args.revision}^{{commit}}").strip()
    with tempfile.TemporaryDirectory() as tmp:
        released_sde, released_stats = load_released(args.repo, revision, Path(tmp))
    step_fn = released_sde.sde_step_with_logprob
    cases = [record_case(step_fn, 6, 1.0, 0.7, 0), record_case(step_fn, 5, 3.0, 1.0, 1)]

    rng = np.random.default_rng(2)
    rewards = rng.normal(size=12) * 10.0 ** rng.integers(-3, 3, size=12)
    rewards[8:12] = 0.25  # a group whose rewards are all equal: zero advantages
    prompts = [f"prompt {i // 4}" for i in range(12)]
    advantages = released_stats.PerPromptStatTracker().update(prompts, rewards)

    fixture = {
        "about": "released Flow-GRPO SDE step, KL regularizer and group advantages on fixed tensors; "
                 "written by tools/parity_flow.py",
        "repository": REPOSITORY,
        "revision": revision,
        "files": {SDE_FILE: git(args.repo, "rev-parse", f"{revision}:{SDE_FILE}").strip(),
                  STATS_FILE: git(args.repo, "rev-parse", f"{revision}:{STATS_FILE}").strip()},
        "torch_version": torch.__version__,
        "layout": "arrays are [rows, height, width, channels] (the released code ran on NCHW)",
        "cases": cases,
        "groups": {"size": 4, "prompts": prompts, "rewards": rewards.tolist(),
                   "advantages": np.asarray(advantages, np.float64).tolist()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out} from {REPOSITORY}@{revision}")


if __name__ == "__main__":
    main()
