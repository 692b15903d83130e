"""A tool worker for tests/test_subprocess_environment.py, built on `serve`.

reset answers task.data["prompt"] + [sample]; each step appends the action's tokens and the
square of their sum, and the episode completes after task.data["turns"] steps. task.data["mode"]
picks a misbehaviour on step 1 (the second step): "hang", "crash", "alloc", "spin", "refuse",
"connect" (to 127.0.0.1:task.data["port"]) or "write" (to each of task.data["paths"]).
"""

import json
import os
import socket
import subprocess
import sys
import time

try:
    from dew_lib.tool_worker import serve
except ImportError:  # inside the namespace sandbox the helper is copied next to this script
    from tool_worker import serve


class Square:
    def reset(self, episode, task):
        self.data, self.total = task["data"], 0
        print("stdout is stderr while serving", flush=True)  # must not reach the reply stream
        detail = json.dumps({"episode": episode, "task": task}, sort_keys=True)
        return [*self.data["prompt"], episode["sample"]], "running", detail

    def step(self, request):
        if request["step"] == 1:
            self.misbehave(self.data.get("mode", ""))
        self.total += sum(request["tokens"])
        context = [*request["context"], *request["tokens"], sum(request["tokens"]) ** 2]
        done = request["step"] + 1 >= self.data["turns"]
        detail = f"total {self.total} policy {request['policy_step']} terminated {request['terminated']}"
        return context, "completed" if done else "running", detail + self.probe()

    def misbehave(self, mode):
        if mode == "hang":
            child = subprocess.Popen(["sleep", "600"])
            print(f"child {child.pid}", file=sys.stderr, flush=True)
            time.sleep(600)
        elif mode == "crash":
            print("crashing on purpose", file=sys.stderr, flush=True)
            os._exit(3)
        elif mode == "alloc":
            bytearray(1 << 30)
        elif mode == "spin":
            while True:
                pass
        elif mode == "refuse" and not getattr(self, "refused", False):
            self.refused = True
            raise ValueError("no tool named 'rm'")

    def probe(self):
        """For modes connect and write: what happened, as ' | outcome ...'."""
        outcomes = []
        if self.data.get("mode") == "connect":
            outcomes.append(attempt(connect, self.data["port"]))
        if self.data.get("mode") == "write":
            outcomes += [attempt(write, path) for path in self.data["paths"]]
        return "".join(f" | {outcome}" for outcome in outcomes)

    def get_state(self):
        return json.dumps({"data": self.data, "total": self.total}).encode()

    def set_state(self, state):
        saved = json.loads(state)
        self.data, self.total = saved["data"], saved["total"]


def connect(port):
    socket.create_connection(("127.0.0.1", port), timeout=5).close()


def write(path):
    with open(path, "w") as f:
        f.write("x")


def attempt(action, argument):
    try:
        action(argument)
        return "ok"
    except OSError as error:
        return f"{type(error).__name__} errno {error.errno}"


if __name__ == "__main__":
    serve(Square())
