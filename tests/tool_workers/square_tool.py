"""The square tool of tests/test_tool_episodes.py as a worker process: `CALL k EOS` gets
`RESULT (k*k + seed) % 10`, `ANSWER v EOS` ends the episode, anything else ends it unanswered.
Every call it answers is appended to $AUDIT (when set) as `task sample step k`."""

import json
import os

from dew_lib.tool_worker import serve

EOS, CALL, ANSWER, RESULT, QUERY = 1, 2, 3, 4, 15


class SquareTool:
    def reset(self, episode, task):
        self.episode = episode
        return [QUERY, 5 + int(task["id"])], "running", ""

    def step(self, request):
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


if __name__ == "__main__":
    serve(SquareTool())
