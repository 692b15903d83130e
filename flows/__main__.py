"""`python -m flows` (what `make run` runs): the whole pipeline on the embedded defaults.

On a CPU-only machine, one XLA device per core lets the Trainer run data parallel, so the work
between matmuls runs on every core too; this has to be decided before JAX starts.

Without a configured Prefect API, Prefect would start a temporary server of its own that a killed
run leaves behind; this starts the same server as a child that dies with this process
(tasks/lifetimes.py), with Prefect's telemetry off.
"""

import os
import sys

from tasks import lifetimes

lifetimes.quiet_prefect()  # before Prefect is imported

cores = os.cpu_count() or 1
if cores > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={min(cores, 8)}")

if not {"-h", "--help"} & set(sys.argv[1:]):
    lifetimes.temporary_prefect_server()

from flows.pipeline import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
