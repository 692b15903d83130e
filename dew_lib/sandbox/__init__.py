"""Run untrusted programs with hard limits: Program in, Outcome out, through a SandboxFleet.

    from dew_lib.sandbox import NamespaceRunner, Program, SandboxFleet
    with SandboxFleet(NamespaceRunner(), workers=4) as fleet:
        outcome = fleet.run(Program(files={"main.py": "print(2 + 2)"}, argv=("python3", "main.py")))
    outcome.verdict, outcome.stdout  # (Verdict.COMPLETED, '4\n')

Runners, weakest to strongest: ProcessRunner (rlimits and a hard kill, no isolation),
NamespaceRunner (bubblewrap: no network, read-only system, private temp, process-count limit),
ContainerRunner (a fresh Docker container per program). docs/sandbox.md says what each does
not isolate.

Not here: scoring completions (dew_lib.rewards.CodeReward).
"""

from dew_lib.sandbox.container import ContainerRunner
from dew_lib.sandbox.fleet import Runner, SandboxFleet
from dew_lib.sandbox.launcher import SandboxUnavailable
from dew_lib.sandbox.limits import SandboxLimits
from dew_lib.sandbox.namespace import NamespaceRunner
from dew_lib.sandbox.process import ProcessRunner
from dew_lib.sandbox.program import Outcome, Program, Verdict

__all__ = ["ContainerRunner", "NamespaceRunner", "Outcome", "ProcessRunner", "Program", "Runner",
           "SandboxFleet", "SandboxLimits", "SandboxUnavailable", "Verdict"]
