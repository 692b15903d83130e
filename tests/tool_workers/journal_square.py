"""The square tool of tests/test_tool_episodes.py with state worth a journal snapshot, for
tests/test_episode_journal.py and tests/test_episode_recovery.py.

`CALL k EOS` gets `RESULT (k*k + seed) % 10`, `ANSWER v EOS` ends the episode, anything else ends
it unanswered; each answer's detail counts the calls the episode made so far ("call #n"), a count
that lives in the worker and survives a restart only through get_state/set_state.

$AUDIT (when set): every answered step appends `step task sample attempt_step turn tokens`, written
after the answer is computed (and after any sleep), so a call killed while pending leaves no
line; every set_state appends `restore task sample calls`.
$SLEEP (when set): a path; while a file is there holding `step turn sample`, the first step
request of that attempted step and turn from a sample >= the given one takes the file (renames
it to `<path>.taken`), writes its pid to `<path>.sleeping` and sleeps ten minutes before
answering: the call a test kills its process during.
"""

import json
import os
import time

from dew_lib.tool_worker import serve

EOS, CALL, ANSWER, RESULT, QUERY = 1, 2, 3, 4, 15


class JournalSquare:
    def reset(self, episode, task):
        self.episode, self.calls = episode, 0
        return [QUERY, 5 + int(task["id"])], "running", ""

    def step(self, request):
        self.calls += 1
        self.maybe_sleep(request)
        said = request["tokens"][:-1]
        if len(said) == 2 and said[0] == CALL and 5 <= said[1] < 15:
            k = said[1] - 5
            result = 5 + (k * k + self.episode["seed"]) % 10
            ids = [*request["context"], *request["tokens"], RESULT, result]
            answer = ids, "running", f"square({k}) call #{self.calls}"
        elif len(said) == 2 and said[0] == ANSWER:
            answer = [], "completed", f"answered {said[1] - 5} call #{self.calls}"
        else:
            answer = [], "completed", f"no call and no answer call #{self.calls}"
        audit("step", self.episode["task"], self.episode["sample"], self.episode["step"], request["step"],
              ",".join(map(str, request["tokens"])))
        return answer

    def maybe_sleep(self, request):
        marker = os.environ.get("SLEEP")
        if not marker or not os.path.exists(marker):
            return
        with open(marker) as f:
            step, turn, sample = map(int, f.read().split())
        if (self.episode["step"], request["step"]) != (step, turn) or self.episode["sample"] < sample:
            return
        try:
            os.rename(marker, marker + ".taken")  # one worker wins
        except FileNotFoundError:
            return
        with open(marker + ".sleeping", "w") as f:
            f.write(f"{os.getpid()} {self.episode['task']} {self.episode['sample']}\n")
        time.sleep(600)

    def get_state(self):
        return json.dumps({"episode": self.episode, "calls": self.calls}).encode()

    def set_state(self, state):
        saved = json.loads(state)
        self.episode, self.calls = saved["episode"], saved["calls"]
        audit("restore", self.episode["task"], self.episode["sample"], self.calls)


def audit(*fields):
    if os.environ.get("AUDIT"):
        with open(os.environ["AUDIT"], "a") as f:
            f.write(" ".join(map(str, fields)) + "\n")


if __name__ == "__main__":
    serve(JournalSquare())
