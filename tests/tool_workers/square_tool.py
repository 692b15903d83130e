"""The square tool of tests/test_tool_episodes.py as a worker process: `CALL k EOS` gets
`RESULT (k*k + seed) % 10`, `ANSWER v EOS` ends the episode, anything else ends it unanswered.
Every call it answers is appended to $AUDIT (when set) as `task sample step k`. With $MISBEHAVE
set, task 6's first step hangs, crashes, floods, answers what is not token ids or raises instead."""

import json
import os
import time

from dew_lib.tool_worker import serve

EOS, CALL, ANSWER, RESULT, QUERY = 1, 2, 3, 4, 15


class SquareTool:
    def reset(self, episode, task):
        self.episode = episode
        return [QUERY, 5 + int(task["id"])], "running", ""

    def step(self, request):
        if self.episode["task"] == "6" and request["step"] == 0:
            how = os.environ.get("MISBEHAVE", "")
            misbehave(how)
            if how == "flood":  # one reply line past the parent's size cap
                return [], "completed", "x" * (1 << 20)
            if how == "malformed":  # a context that is not token ids
                return ["seven"], "running", ""
        said = request["tokens"][:-1]
        if len(said) == 2 and said[0] == CALL and 5 <= said[1] < 15:
            k = said[1] - 5
            if os.environ.get("AUDIT"):
                with open(os.environ["AUDIT"], "a") as audit:
                    audit.write(f"{self.episode['task']} {self.episode['sample']} {request['step']} {k}\n")
            result = 5 + (k * k + self.episode["seed"]) % 10
            return [*request["context"], *request["tokens"], RESULT, result], "running", f"square({k})"
        if len(said) == 2 and said[0] == ANSWER:
            return [], "completed", f"answered {said[1] - 5}"
        return [], "completed", "no call and no answer"

    def get_state(self):
        return json.dumps(self.episode).encode()

    def set_state(self, state):
        self.episode = json.loads(state)


def misbehave(how):
    if how == "hang":
        time.sleep(600)
    elif how == "crash":
        os._exit(3)
    elif how == "raise":
        raise RuntimeError("the calculator is broken")


if __name__ == "__main__":
    serve(SquareTool())
