"""`python -m flows` (what `make run` runs): the whole pipeline on the embedded defaults.

On a CPU-only machine, one XLA device per core lets the Trainer run data parallel, so the work
between matmuls runs on every core too; this has to be decided before JAX starts.
"""

import os
import sys

cores = os.cpu_count() or 1
if cores > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={min(cores, 8)}")

from flows.pipeline import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
