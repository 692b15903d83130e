"""Prefect flows: one per stage, and the pipeline that chains them. Each reads as a list of steps."""

import os

from tasks import lifetimes

lifetimes.quiet_prefect()  # telemetry off in every entry point, before any flow imports Prefect
lifetimes.exit_with_marked_parent()  # a flow run that deployments/serve.py started ends with it

# Without a server, Prefect starts an ephemeral API in the background; on a busy two-core machine
# that takes longer than its 20 s default allows, so give it room unless the user chose.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
