"""`make ui`: a local Prefect server on 127.0.0.1 and the deployments served beside it.

The server keeps its database under runs/prefect (PREFECT_HOME), so runs started from the UI
stay listed across restarts. Ctrl-C or SIGTERM stops both; when either of them ends, this stops
the other and exits. Both run in process groups of their own with the parent-death signal
(tasks/lifetimes.py), so they also end when this process is killed with SIGKILL.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tasks.lifetimes import (  # noqa: E402
    bound_child,
    children_exit_with_me,
    quiet_prefect,
    stop,
    terminate_raises,
    wait_until_healthy,
)


def deployment_names() -> list[str]:
    """The deployments serve.py serves, as deployments/prefect.yaml declares them (the same set:
    tests/test_deployments.py), read without importing the flows into this process."""
    import yaml

    with open(os.path.join(ROOT, "deployments", "prefect.yaml"), encoding="utf-8") as handle:
        return [deployment["name"] for deployment in yaml.safe_load(handle)["deployments"]]


def banner(url: str) -> str:
    """The line that says where the UI is and which deployments it serves."""
    return f"Prefect UI: {url}  (deployments: {', '.join(deployment_names())}; Ctrl-C stops)"


def main() -> int:
    port = int(os.environ.get("DEW_UI_PORT", "4200"))
    url = f"http://127.0.0.1:{port}"
    home = os.environ.get("PREFECT_HOME", os.path.join(ROOT, "runs", "prefect"))
    env = quiet_prefect({**os.environ, "PREFECT_API_URL": f"{url}/api", "PREFECT_HOME": home})
    children_exit_with_me(env)  # serve.py: a hard stop 15 s after this process is gone
    terminate_raises()
    bin_dir = os.path.dirname(sys.executable)
    server = served = None
    try:
        server = bound_child([os.path.join(bin_dir, "prefect"), "server", "start", "--host", "127.0.0.1",
                              "--port", str(port)], env=env, cwd=ROOT)
        wait_until_healthy(f"{url}/api", server, 120)
        served = bound_child([sys.executable, os.path.join(ROOT, "deployments", "serve.py")], env=env,
                             cwd=ROOT)
        print(banner(url), flush=True)
        while True:
            if served.poll() is not None:
                return served.returncode
            if server.poll() is not None:
                print(f"the Prefect server exited with status {server.returncode}; stopping the deployments",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        stop(served, grace=20)
        stop(server, grace=20)


if __name__ == "__main__":
    sys.exit(main())
