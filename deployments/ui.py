"""`make ui`: a local Prefect server on 127.0.0.1 and the deployments served beside it.

The server keeps its database under runs/prefect (PREFECT_HOME), so runs started from the UI
stay listed across restarts. Ctrl-C stops both.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until_healthy(url: str, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the Prefect server did not answer at {url} within {seconds:.0f} s")


def main() -> int:
    port = int(os.environ.get("DEW_UI_PORT", "4200"))
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": os.environ.get("PREFECT_HOME", os.path.join(ROOT, "runs", "prefect")),
           "PREFECT_API_URL": f"{url}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    bin_dir = os.path.dirname(sys.executable)
    server = subprocess.Popen([os.path.join(bin_dir, "prefect"), "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, cwd=ROOT)
    served = None
    try:
        wait_until_healthy(url, server)
        print(f"Prefect UI: {url}  (deployments: pipeline, flow-grpo, retrain-nightly; Ctrl-C stops)", flush=True)
        served = subprocess.Popen([sys.executable, os.path.join(ROOT, "deployments", "serve.py")],
                                  env=env, cwd=ROOT)
        served.wait()
        return served.returncode
    except KeyboardInterrupt:
        return 0
    finally:
        for process in (served, server):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()


if __name__ == "__main__":
    sys.exit(main())
