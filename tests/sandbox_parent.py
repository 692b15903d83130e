"""A parent that starts sandboxed programs and then waits to be SIGKILLed by the test.

Usage: sandbox_parent.py RUNNER MARKER, RUNNER one of process/namespace. Each of two programs
forks a child; all of them sleep with MARKER in their command line, so the test finds them in
/proc. Prints "submitted" once the programs are handed to the fleet.
"""

import sys
import time

from dew_lib.sandbox import NamespaceRunner, ProcessRunner, Program, SandboxFleet, SandboxLimits

runner = {"process": ProcessRunner, "namespace": NamespaceRunner}[sys.argv[1]]()
fleet = SandboxFleet(runner, limits=SandboxLimits(wall_seconds=120), workers=2)
source = "import os, time\nos.fork()\ntime.sleep(120)\n"
for _ in range(2):
    fleet.submit(Program(files={"main.py": source}, argv=("python3", "main.py", sys.argv[2])))
print("submitted", flush=True)
time.sleep(120)
