"""A tool worker for tests/test_subprocess_environment.py that answers every request with the
raw text task.data["reply"] (repeated task.data["repeat"] times), bypassing `serve`; with
task.data["once"] it exits after the first reply.

With the argument "alloc" it first allocates 1 GiB at start, so it dies on RLIMIT_AS.
"""

import json
import sys

if sys.argv[1:2] == ["alloc"]:
    hoard = bytearray(1 << 30)

reply = None
for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "reset":
        reply = request["task"]["data"]["reply"] * request["task"]["data"].get("repeat", 1)
    sys.stdout.write(reply)
    sys.stdout.flush()
    if request["task"]["data"].get("once") if request["op"] == "reset" else False:
        break  # exit 0 after the first reply
