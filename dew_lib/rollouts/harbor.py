"""Harbor trials as sessions: each sample runs one trial whose harness calls the policy through a
recording gateway, and the session is the gateway's record of those calls plus Harbor's verdict.

`HarborSource(gateway, harbor=Harbor(...), model=..., trials=...)` implements `SessionSource`.
For every sample it

1. opens a session on the rllm-model-gateway (`Gateway.open_session`), named after the task, group,
   sample and attempt;
2. runs `harbor trials start` in a child process on the task's directory, with the harness's
   OpenAI base URL set to that session (`Gateway.session_url`: through `sandbox_url` when there is
   one), writing the trial under `trials/<session>/`;
3. reads the trial's `result.json` and the session's traces, and closes the session.

How a session ends:

    the verifier scored the trial, no exception             COMPLETED, with its reward
    scored, the harness hit its time or length limit        TRUNCATED, with its reward
      (AgentTimeoutError, ContextLengthExceededError,
      OutputLengthExceededError)
    scored, the harness raised anything else                AGENT_ERROR, with its reward
    no score (no result.json, no verifier result,           INFRA_ERROR, with Harbor's exception
      several rewards without one named "reward"), a          or the end of its output
      trace without token ids or log-probabilities, the
      gateway failing, or no call reached the session
    cancelled                                               CANCELLED: the trial's process group
                                                              gets SIGTERM, then SIGKILL

Each trace becomes one `Call`: the engine's prompt ids, completion ids and behavior
log-probabilities, and the weight version the gateway stamped when the call arrived. A gateway
that stamps no version (rllm-model-gateway before f83139a1) cannot say which policy a call came
from; the source then raises instead of guessing, and the scheduler stops the batch.

Harbor itself needs Python 3.12 and a container runtime; Dew runs its command line and reads what
it writes, so it does not import Harbor. The command line and result layout follow Harbor's
`trials start` (`-p`, `-a`, `-m`, `--trials-dir`, `--trial-name`, `--agent-env`, `--agent-kwarg`,
`-e`) and its TrialResult JSON (`verifier_result.rewards`, `exception_info.exception_type`).

Not here: the gateway's HTTP calls (inference/gateway.py), scheduling and retries (scheduler).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from dew_lib.children import die_with_parent
from dew_lib.inference.endpoints import EndpointFailed
from dew_lib.inference.gateway import Gateway
from dew_lib.options import integer
from dew_lib.records.sessions import Call, Session, Status, Task

# Harbor exceptions after which the verifier still scores what the harness left: limits, not faults.
LIMITS = ("AgentTimeoutError", "ContextLengthExceededError", "OutputLengthExceededError")
# The base-URL variables Harbor's installed harnesses read (mini-swe-agent, codex, openhands, ...).
BASE_URL_VARIABLES = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "LLM_BASE_URL", "HOSTED_VLLM_API_BASE")
SETPRIV = shutil.which("setpriv")
_SHOWN = 2000  # characters of a trial's output kept in a session's detail
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class Harbor:
    """How to run one Harbor trial.

    tasks: Harbor task directories; a task whose data has an integer `task_id` runs
    `tasks[task_id]`, one with a `path` runs that directory. agent: a Harbor agent name
    ("terminus-2", "mini-swe-agent", ...). command: the Harbor command line (e.g. `("uvx",
    "harbor")` or a venv's `harbor`). environment: Harbor's environment type ("docker", "daytona",
    ...; None keeps the task's). agent_kwargs and agent_env: passed as `--agent-kwarg k=v` and
    `--agent-env K=V` (the base-URL variables are set by the source). arguments: more flags, as
    given (e.g. `("--allow-agent-host", "10.0.0.2")`). stop_grace: seconds a cancelled trial gets
    between SIGTERM and SIGKILL, to remove its container.
    """

    tasks: Sequence[str] = ()
    agent: str = "terminus-2"
    command: Sequence[str] = ("harbor",)
    environment: str | None = None
    agent_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    agent_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    arguments: Sequence[str] = ()
    stop_grace: float = 30.0

    def __post_init__(self):
        for field in ("tasks", "command", "arguments"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(item, (str, os.PathLike)) for item in value):
                raise ValueError(f"Harbor.{field} must be a list of strings, got {value!r}")
            object.__setattr__(self, field, tuple(str(item) for item in value))
        if not self.command:
            raise ValueError("Harbor.command is empty; give the Harbor command line, e.g. ('harbor',)")
        if not isinstance(self.agent, str) or not self.agent:
            raise ValueError(f"Harbor.agent must name a Harbor agent such as 'terminus-2', got {self.agent!r}")
        clash = sorted(set(self.agent_env) & set(BASE_URL_VARIABLES))
        if clash:
            raise ValueError(f"Harbor.agent_env sets {clash}; HarborSource points those at each trial's "
                             "gateway session, so leave them out")
        if not (isinstance(self.stop_grace, (int, float)) and self.stop_grace >= 0):
            raise ValueError(f"Harbor.stop_grace must be nonnegative seconds, got {self.stop_grace!r}")

    def task_directory(self, task: Task) -> Path:
        """The Harbor task directory `task` names (its `path`, or `tasks[task_id]`)."""
        if "path" in task.data:
            return Path(str(task.data["path"]))
        if "task_id" in task.data:
            index = task.data["task_id"]
            if not isinstance(index, int) or not 0 <= index < len(self.tasks):
                raise KeyError(f"task {task.id!r} has task_id {index!r}, and Harbor.tasks lists "
                               f"{len(self.tasks)} directories")
            return Path(self.tasks[index])
        raise KeyError(f"HarborSource reads task.data['path'] or an integer task.data['task_id'] "
                       f"indexing Harbor.tasks; task {task.id!r} has {sorted(task.data)}")

    def argv(self, directory: Path, *, model: str, trials: Path, name: str, base_url: str) -> list[str]:
        """The `harbor trials start` command line of one trial."""
        argv = [*self.command, "trials", "start", "-p", str(directory), "-a", self.agent, "-m", model,
                "--trials-dir", str(trials), "--trial-name", name]
        if self.environment is not None:
            argv += ["-e", self.environment]
        for key, value in self.agent_kwargs.items():
            argv += ["--agent-kwarg", f"{key}={value}"]
        for key, value in {**{variable: base_url for variable in BASE_URL_VARIABLES}, **self.agent_env}.items():
            argv += ["--agent-env", f"{key}={value}"]
        return argv + list(self.arguments)


class _Trial:
    """One sample in progress: the process running it, and whether it was cancelled."""

    __slots__ = ("cancelled", "lock", "process")

    def __init__(self):
        self.cancelled = False
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()


class HarborSource:
    """Runs each sample as one Harbor trial behind `gateway` and returns its recorded session.

    gateway: the rllm-model-gateway the engines sit behind (`Gateway(url, sandbox_url=...)`);
    its `ready` is checked before the first trial. harbor: how to run a trial (`Harbor`). model:
    the model name the harness asks the gateway for (e.g. "hosted_vllm/Qwen/Qwen3-0.6B" for a
    LiteLLM-based harness). trials: the directory trials are written under. workers: trials run at
    once. keep_traces: leave each session on the gateway after reading it (default: delete it).
    """

    def __init__(self, gateway: Gateway, *, harbor: Harbor, model: str, trials: str | os.PathLike,
                 workers: int = 8, keep_traces: bool = False):
        if not isinstance(gateway, Gateway):
            raise TypeError(f"HarborSource.gateway must be a Gateway, got {type(gateway).__name__}")
        if not isinstance(harbor, Harbor):
            raise TypeError(f"HarborSource.harbor must be a Harbor, got {type(harbor).__name__}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"HarborSource.model must name the model the harness calls, got {model!r}")
        workers = integer("HarborSource.workers", workers)
        self.gateway, self.harbor, self.model = gateway, harbor, model
        self.trials = Path(trials)
        self.keep_traces = bool(keep_traces)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="HarborSource")
        self._live: dict[Future, _Trial] = {}
        self._lock = threading.Lock()
        self._ready = False
        self._closed = False

    def submit(self, task: Task, *, group: int, sample: int, attempt: int, seed: int) -> Future[Session]:
        if self._closed:
            raise RuntimeError("HarborSource is closed")
        directory = self.harbor.task_directory(task)
        self._check_ready()
        future: Future[Session] = Future()
        trial = _Trial()
        with self._lock:
            self._live[future] = trial
        labels = dict(task=task.id, group=group, sample=sample, attempt=attempt)
        self._pool.submit(self._run, future, trial, directory, labels)
        return future

    def cancel(self, future: Future) -> None:
        """Stop the trial behind `future`: SIGTERM to its process group, SIGKILL after stop_grace."""
        with self._lock:
            trial = self._live.get(future)
        if trial is None:
            return
        with trial.lock:
            trial.cancelled = True
            process = trial.process
        if process is not None:
            _stop(process, self.harbor.stop_grace)

    def close(self) -> None:
        """Cancel every trial in progress and wait for the workers."""
        self._closed = True
        with self._lock:
            futures = list(self._live)
        for future in futures:
            self.cancel(future)
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_ready(self) -> None:
        with self._lock:
            if self._ready:
                return
            self.gateway.ready()
            self._ready = True

    def _run(self, future: Future, trial: _Trial, directory: Path, labels: dict) -> None:
        try:
            session = self._session(trial, directory, labels)
        except BaseException as error:  # noqa: BLE001 - a bug or a gateway that cannot say versions
            with self._lock:
                self._live.pop(future, None)
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
            return
        with self._lock:
            self._live.pop(future, None)
        if future.set_running_or_notify_cancel():
            future.set_result(session)

    def _session(self, trial: _Trial, directory: Path, labels: dict) -> Session:
        name = session_name(**labels)
        try:
            self.gateway.open_session(name, metadata=dict(labels, task_directory=str(directory)))
        except EndpointFailed as error:
            return Session(**labels, status=Status.INFRA_ERROR, detail=f"gateway: {error}"[:_SHOWN])
        try:
            output = self._trial(trial, directory, name)
            if output is None:
                return Session(**labels, status=Status.CANCELLED, detail="cancelled during the trial")
            status, reward, components, detail = trial_outcome(self.trials / name, output)
            try:
                traces = self.gateway.traces(name)
            except EndpointFailed as error:
                return Session(**labels, status=Status.INFRA_ERROR, reward=None,
                               detail=f"reading the session's traces: {error}"[:_SHOWN])
            calls, problem = trace_calls(traces, name)
            if problem is not None:
                return Session(**labels, calls=calls, status=Status.INFRA_ERROR, detail=problem)
            if trial.cancelled:
                return Session(**labels, calls=calls, status=Status.CANCELLED, detail="cancelled during the trial")
            if status is Status.INFRA_ERROR:
                reward, components = None, {}
            return Session(**labels, calls=calls, status=status, reward=reward, components=components,
                           detail=detail)
        finally:
            if not self.keep_traces:
                try:
                    self.gateway.close_session(name)
                except EndpointFailed:
                    pass  # the session's traces stay on the gateway; nothing here depends on them

    def _trial(self, trial: _Trial, directory: Path, name: str) -> str | None:
        """Run the trial to its end, its output in `trials/<name>.log`; a summary of how it ended,
        or None when it was cancelled."""
        self.trials.mkdir(parents=True, exist_ok=True)
        argv = self.harbor.argv(directory, model=self.model, trials=self.trials, name=name,
                                base_url=self.gateway.session_url(name))
        log = self.trials / f"{name}.log"
        with open(log, "w") as sink, trial.lock:
            if trial.cancelled:
                return None
            # setpriv arms the parent-death signal without a preexec function, so the trainer
            # (JAX's threads running) never forks; where it is missing a preexec function does.
            trial.process = subprocess.Popen(
                [SETPRIV, "--pdeathsig", "TERM", "--", *argv] if SETPRIV else argv,
                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=None if SETPRIV else die_with_parent())
        code = trial.process.wait()
        if trial.cancelled:
            return None
        tail = log.read_text(errors="replace")[-_SHOWN:]
        return f"exit status {code}; {log} ends: {tail}"


def session_name(*, task: str, group: int, sample: int, attempt: int) -> str:
    """A gateway session and trial name unique to this attempt, safe in a URL and a file name."""
    stem = _UNSAFE.sub("-", str(task)).strip("-")[:80] or "task"
    return f"{stem}.g{group}.s{sample}.a{attempt}.{uuid.uuid4().hex[:8]}"


def trial_outcome(directory: Path, output: str) -> tuple[Status, float | None, dict, str]:
    """Status, reward, reward components and detail from a trial's `result.json`."""
    path = directory / "result.json"
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        return Status.INFRA_ERROR, None, {}, f"Harbor wrote no {path} ({output})"[:_SHOWN]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        return Status.INFRA_ERROR, None, {}, f"cannot read {path}: {error}"[:_SHOWN]
    if not isinstance(result, dict):
        return Status.INFRA_ERROR, None, {}, f"{path} holds {type(result).__name__}, not a TrialResult"
    exception = result.get("exception_info") or {}
    kind = str(exception.get("exception_type") or "") if isinstance(exception, dict) else ""
    raised = f"{kind}: {exception.get('exception_message', '')}" if kind else ""
    rewards = (result.get("verifier_result") or {}).get("rewards") if isinstance(
        result.get("verifier_result"), dict) else None
    reward, problem = _reward(rewards)
    if reward is None:
        return Status.INFRA_ERROR, None, {}, "; ".join(filter(None, [problem, raised]))[:_SHOWN]
    components = {str(k): float(v) for k, v in rewards.items() if _finite(v)}
    if not kind:
        return Status.COMPLETED, reward, components, ""
    status = Status.TRUNCATED if kind in LIMITS else Status.AGENT_ERROR
    return status, reward, components, raised[:_SHOWN]


def _reward(rewards: Any) -> tuple[float | None, str]:
    if not isinstance(rewards, dict) or not rewards:
        return None, "the verifier gave no rewards"
    if "reward" in rewards:
        value = rewards["reward"]
    elif len(rewards) == 1:
        value = next(iter(rewards.values()))
    else:
        return None, f"the verifier gave rewards {sorted(rewards)} and none is named 'reward'"
    if not _finite(value):
        return None, f"the verifier's reward is {value!r}; rewards must be finite numbers"
    return float(value), ""


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def trace_calls(traces: Sequence[dict], session: str) -> tuple[tuple[Call, ...], str | None]:
    """The session's calls, and what is wrong when a trace cannot train (None when nothing is).

    Raises `ValueError` for a trace without a weight version: no call of such a gateway can be
    placed against a policy version.
    """
    calls: list[Call] = []
    for index, trace in enumerate(traces):
        version = trace.get("weight_version")
        if version is None or isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(
                f"gateway session {session!r}: trace {index} has weight_version {version!r}; the gateway "
                "must stamp each call with the policy version (rllm-model-gateway at f83139a1 or later, "
                "stamped by Publication(..., stamp=gateway.stamp))")
        prompt, sampled = trace.get("prompt_token_ids"), trace.get("completion_token_ids")
        log_probs = trace.get("logprobs")
        if not prompt or sampled is None:
            return tuple(calls), (f"trace {index} of session {session!r} has no prompt or completion token "
                                  "ids; the engine must return them (vLLM and dew serve: return_token_ids, "
                                  "which the gateway adds unless add_return_token_ids is off)")
        if log_probs is None or len(log_probs) != len(sampled):
            count = 0 if log_probs is None else len(log_probs)
            return tuple(calls), (f"trace {index} of session {session!r} has {count} "
                                  f"log-probabilities for {len(sampled)} ids; the gateway asks the engine "
                                  "for them unless add_logprobs is off")
        finish = trace.get("finish_reason")
        finish = "length" if finish == "length" else "abort" if finish in ("abort", None) else "stop"
        calls.append(Call(prompt_ids=prompt, sampled_ids=sampled, behavior_log_probs=log_probs,
                          finish_reason=finish, version=version))
    if not calls:
        return (), (f"no call reached gateway session {session!r}; check that the harness reads its base "
                    f"URL from {', '.join(BASE_URL_VARIABLES)} and can reach the gateway (or sandbox_url)")
    return tuple(calls), None


def _stop(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the trial's process group, SIGKILL if it is still there after `grace` seconds."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return

    def kill_later():
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    threading.Thread(target=kill_later, daemon=True, name="HarborSource-stop").start()


__all__ = ["BASE_URL_VARIABLES", "LIMITS", "Harbor", "HarborSource", "session_name", "trace_calls",
           "trial_outcome"]
