"""A parent that enters a SubprocessEnvironment, prints the worker's pid, then SIGKILLs itself.

Usage: dying_parent.py ISOLATION MARKER. The worker (square.py) carries MARKER in its argv so
the test can find it, and whatever it started, in /proc.
"""

import os
import signal
import sys

from dew_lib.records import EpisodeId, Task
from dew_lib.rollouts.subprocess_environment import SubprocessEnvironment
from dew_lib.sandbox import SandboxLimits

isolation, marker = sys.argv[1], sys.argv[2]
here = os.path.dirname(os.path.abspath(__file__))
if isolation == "namespace":
    files = {"square.py": os.path.join(here, "square.py"),
             "tool_worker.py": os.path.join(here, "..", "..", "dew_lib", "tool_worker.py")}
    for name, path in files.items():
        with open(path) as f:
            files[name] = f.read()
    command = ("python3", "square.py", marker)
else:
    files, command = {}, (sys.executable, os.path.join(here, "square.py"), marker)
factory = SubprocessEnvironment(command, SandboxLimits(wall_seconds=120), isolation=isolation, files=files)
env = factory(Task("t", {"prompt": [1], "turns": 3}), EpisodeId(task="t", group=0, sample=0, attempt=0, seed=0))
env.__enter__()
env.reset()
print(env.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
