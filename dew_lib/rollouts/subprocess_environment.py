"""SubprocessEnvironment: an environment factory whose episodes run in a tool worker process.

    factory = SubprocessEnvironment(("python3", "square_worker.py"), SandboxLimits(wall_seconds=60),
                                    files={"square_worker.py": source})
    with factory(task, identity) as env:      # starts the worker
        first = env.reset()
        next_observation = env.step(action)   # an Action: context, tokens, terminated, step, policy_step
    # the worker's process group is killed and its workspace removed here, whatever happened

Each environment starts the argv `command` when it is entered, through the sandbox launcher
(`dew_lib.sandbox.launcher`): a new session and process group, a minimal environment, a fresh
temporary directory as its working directory (holding `files`), RLIMIT_CPU and RLIMIT_AS from
`limits`, and SIGKILL when the thread that entered it dies. Parent and worker speak JSON lines
(the worker side is `dew_lib.tool_worker.serve`):

    {"op": "reset", "episode": {every EpisodeId field}, "task": {"id": str, "data": {...}}}
    {"op": "step", "context": [ids], "tokens": [ids], "terminated": bool, "step": int,
     "policy_step": int}
        -> {"context": [ids], "status": "running" | "completed" | ... | "error", "detail": str}
    {"op": "get_state"}                     -> {"state": "<base64>"}
    {"op": "set_state", "state": "<base64>"} -> {"restored": true}

`step` is the action's turn in the episode and `policy_step` the trainer updates committed when
it was sampled (`Action.policy_step`); the identity's own `step` is the step that attempted the
episode. Task data may hold numpy arrays and scalars; they travel as lists and numbers.

A worker that answers status "error" ends the episode with EpisodeStatus.ERROR. Everything else
that goes wrong raises `ToolFailure` (see `worker_channel.py`): the session's wall deadline,
an oversized, malformed or `{"error": ...}` reply, the worker's exit.

isolation="process" (the default) limits and cleans up but does not isolate: the worker runs
with your permissions, filesystem and network. isolation="namespace" runs it under bubblewrap as
`NamespaceRunner` does: no network, a read-only system, a private /tmp, the temporary directory
as the only writable place (at /work), and nothing outliving the worker. docs/sandbox.md has
the table.

Not here: the episode loop that calls reset and step (`EnvironmentSource`, `EpisodeRollout`),
the pipes and the deadline (`worker_channel.py`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.options import choice
from dew_lib.records.episodes import Action, EpisodeId, EpisodeStatus, Observation
from dew_lib.records.sessions import Task
from dew_lib.rollouts.worker_channel import ToolFailure, WorkerChannel
from dew_lib.sandbox import launcher
from dew_lib.sandbox.limits import SandboxLimits
from dew_lib.sandbox.namespace import WORKDIR, NamespaceRunner
from dew_lib.sandbox.program import Program, job_directory

ISOLATIONS = ("process", "namespace")
_STATUSES = tuple(status.value for status in EpisodeStatus)
_MAX_TOKEN = 2**31 - 1  # records keep token ids as int32


@dataclasses.dataclass(frozen=True, eq=False)
class SubprocessEnvironment:
    """An environment factory: `factory(task, identity)` returns a `WorkerEnvironment`.

    command: the worker's argv, run without a shell; `argv[0]` is looked up on
        /usr/local/bin:/usr/bin:/bin unless it is a path (`sys.executable` works for isolation
        "process"; inside a namespace only /usr and the `read_only` paths exist).
    limits: RLIMIT_CPU (`cpu_seconds`, adding up over the whole session) and RLIMIT_AS
        (`memory_bytes`) in the worker, RLIMIT_FSIZE, one wall deadline (`wall_seconds`) for the
        whole session from entering to leaving (model time between steps counts), and
        `max_output_bytes` per reply line.
    isolation: "process" or "namespace" (module docstring; docs/sandbox.md).
    env: extra environment variables; the worker otherwise sees only PATH, HOME (the
        workspace), LANG/LC_ALL and, for "process", TMPDIR (the workspace).
    files: relative path -> text or bytes, written into each fresh workspace before the start.
    read_only: host paths bound read-only at the same place ("namespace" only), e.g. a Python
        installation outside /usr; none may lie under /work, where the workspace is.
    root: where workspaces are made on the host (default: the system temporary directory).

    Enter each environment on a thread that outlives it: the worker's parent-death signal
    belongs to the thread that started it, so a worker entered on a short-lived thread is
    SIGKILLed when that thread ends. `EpisodeRollout` enters its environments on the caller's
    thread; `EnvironmentSource` on its pool's worker threads, which live as long as the source.
    Constructing the factory checks the helper binaries (and, for "namespace", runs `true`
    once under bubblewrap) and raises `SandboxUnavailable` when this machine cannot run them.
    """

    command: Sequence[str]
    limits: SandboxLimits = dataclasses.field(default_factory=SandboxLimits)
    _: dataclasses.KW_ONLY
    isolation: str = "process"
    env: Mapping[str, str] | None = None
    files: Mapping[str, str | bytes] | None = None
    read_only: Sequence[str] = ()
    root: str | None = None
    # Derived in __post_init__: the checked command and files, helper paths, the bwrap runner.
    program: Program = dataclasses.field(init=False, repr=False)
    setpriv: str = dataclasses.field(init=False, repr=False)
    prlimit: str = dataclasses.field(init=False, repr=False)
    runner: NamespaceRunner | None = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.limits, SandboxLimits):
            raise TypeError(f"SubprocessEnvironment.limits must be a SandboxLimits, got {type(self.limits).__name__}")
        choice("SubprocessEnvironment.isolation", self.isolation, ISOLATIONS)
        object.__setattr__(self, "env", _environment_variables(self.env))
        object.__setattr__(self, "program", _program(self.command, self.files))
        object.__setattr__(self, "command", self.program.argv)
        object.__setattr__(self, "files", dict(self.program.files))
        if isinstance(self.read_only, str):
            raise TypeError("SubprocessEnvironment.read_only must be a sequence of paths, not the "
                            f"string {self.read_only!r}; wrap it in a tuple")
        object.__setattr__(self, "read_only", tuple(self.read_only))
        if self.read_only and self.isolation != "namespace":
            raise ValueError("SubprocessEnvironment.read_only applies only to isolation='namespace' "
                             "(a 'process' worker already sees the whole filesystem); drop it or "
                             "set isolation='namespace'")
        object.__setattr__(self, "setpriv", launcher.tool("setpriv", "util-linux"))
        object.__setattr__(self, "prlimit", launcher.tool("prlimit", "util-linux"))
        runner = None
        if self.isolation == "namespace":
            runner = NamespaceRunner(read_only=self.read_only, root=self.root)
        object.__setattr__(self, "runner", runner)

    def __call__(self, task: Task, identity: EpisodeId) -> WorkerEnvironment:
        return WorkerEnvironment(self, task, identity)


class WorkerEnvironment:
    """One episode in one worker process; a context manager (see `SubprocessEnvironment`).

    pid: the worker's process id while entered (under "namespace", bubblewrap's).
    workspace: the host path of the temporary directory while entered.

    Use one environment from one thread at a time.
    """

    def __init__(self, options: SubprocessEnvironment, task: Task, identity: EpisodeId):
        self.options, self.task, self.identity = options, task, identity
        self.workspace: str | None = None
        self._channel: WorkerChannel | None = None
        self._stack: contextlib.ExitStack | None = None

    @property
    def pid(self) -> int | None:
        return None if self._channel is None else self._channel.process.pid

    def __enter__(self) -> WorkerEnvironment:
        if self._stack is not None:
            raise RuntimeError("this WorkerEnvironment is already entered; call the factory again "
                               "for another episode")
        stack = contextlib.ExitStack()
        try:
            self._start(stack)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        """Kill the worker's whole process group, reap it and remove the workspace, always."""
        stack, self._stack, self._channel, self.workspace = self._stack, None, None, None
        if stack is not None:
            stack.close()

    def reset(self) -> Observation:
        episode = _jsonable(dataclasses.asdict(self.identity), "the episode identity")
        task = {"id": str(self.task.id), "data": _jsonable(dict(self.task.data), f"task {self.task.id!r} data")}
        return self._observation({"op": "reset", "episode": episode, "task": task}, "reset")

    def step(self, action: Action) -> Observation:
        request = {"op": "step", "context": np.asarray(action.context).reshape(-1).tolist(),
                   "tokens": np.asarray(action.tokens).reshape(-1).tolist(),
                   "terminated": bool(action.terminated), "step": int(action.step),
                   "policy_step": int(action.policy_step)}
        return self._observation(request, f"step {int(action.step)}")

    def get_state(self) -> bytes:
        """The worker's snapshot (its `get_state()`), for the episode journal."""
        reply = self._request({"op": "get_state"}, "get_state")
        try:
            if not isinstance(reply.get("state"), str):
                raise TypeError
            return base64.b64decode(reply["state"], validate=True)
        except (TypeError, binascii.Error):
            self._entered("get_state").fail(f"the tool worker's reply to get_state is not {{\"state\": <base64>}}: "
                               f"{_preview(reply)}")

    def set_state(self, state: bytes) -> None:
        """Restore a snapshot taken by `get_state` (from this or another worker of the task)."""
        if not isinstance(state, (bytes, bytearray)):
            raise TypeError(f"set_state takes bytes, got {type(state).__name__}")
        reply = self._request({"op": "set_state", "state": base64.b64encode(bytes(state)).decode("ascii")},
                              "set_state")
        if reply != {"restored": True}:
            self._entered("set_state").fail(f"the tool worker's reply to set_state is not {{\"restored\": true}}: "
                               f"{_preview(reply)}")

    def _start(self, stack: contextlib.ExitStack) -> None:
        options = self.options
        runner = options.runner
        job = stack.enter_context(job_directory(options.program, root=options.root,
                                                owner=None if runner is None else runner.user))
        rlimits = launcher.rlimit_argv(options.limits, processes=runner is not None, prlimit=options.prlimit)
        if runner is None:
            argv, env, user = [*rlimits, *options.command], launcher.minimal_env(job, TMPDIR=job), None
        else:
            argv = [*runner.bwrap_argv(job), "--", *rlimits, *options.command]
            env, user = launcher.minimal_env(WORKDIR), runner.user
        env.update(options.env)
        started = time.monotonic()
        process = launcher.start(argv, cwd=job, env=env, user=user, setpriv=options.setpriv)
        try:
            channel = WorkerChannel(process, options.limits, started=started, wrapped=runner is not None)
        except BaseException:
            launcher.kill_group(process)
            process.wait()
            raise
        stack.callback(channel.close)  # runs before the workspace is removed
        self._channel, self.workspace = channel, job

    def _entered(self, what: str) -> WorkerChannel:
        """The worker's channel; refuses `what` outside the `with` block that starts the worker."""
        if self._channel is None:
            raise RuntimeError(f"{what} needs an entered environment: use `with factory(task, identity) as env:`")
        return self._channel

    def _request(self, message: dict, what: str) -> dict:
        return self._entered(what).request(message, what)

    def _observation(self, message: dict, what: str) -> Observation:
        reply = self._request(message, what)
        problem = _observation_problem(reply)
        if problem is None:
            try:
                return Observation(context=reply["context"], status=reply["status"], detail=reply["detail"])
            except (TypeError, ValueError) as error:
                problem = str(error)
        self._entered(what).fail(f"the tool worker's reply to {what} is not an observation ({problem}): "
                                 f"{_preview(reply)}")

    def __repr__(self):
        state = f"pid={self.pid}" if self._channel is not None else "not entered"
        return f"WorkerEnvironment(task={self.task.id!r}, {state})"


def _observation_problem(reply: dict) -> str | None:
    """What is wrong with a reset or step reply, or None when it has the three fields right."""
    missing = [key for key in ("context", "status", "detail") if key not in reply]
    if missing:
        return f"missing {', '.join(missing)}"
    context = reply["context"]
    if not isinstance(context, list) or not all(type(t) is int and 0 <= t <= _MAX_TOKEN for t in context):
        return "context must be a list of token ids, integers from 0 to 2**31 - 1"
    if reply["status"] not in _STATUSES:
        return f"status must be one of {_STATUSES}"
    if not isinstance(reply["detail"], str):
        return "detail must be a string"
    return None


def _jsonable(value: Any, where: str) -> Any:
    """`value` with numpy arrays and scalars as lists and Python numbers, so JSON can carry it."""
    if isinstance(value, Mapping):
        if not all(isinstance(key, (str, int)) for key in value):
            raise TypeError(f"{where} has a key that is not a string or an integer: {list(value)!r}")
        return {str(key): _jsonable(item, where) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item, where) for item in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist(), where)
    if isinstance(value, np.generic):
        return _jsonable(value.item(), where)
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, float) and not np.isfinite(value):
            raise ValueError(f"{where} holds {value}, which JSON cannot carry; replace it with null or a string")
        return value
    raise TypeError(f"{where} holds a {type(value).__name__}, which JSON cannot carry; convert it to "
                    "lists, numbers or strings (bytes: base64 text)")


def _environment_variables(env: Mapping[str, str] | None) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        raise ValueError("SubprocessEnvironment.env must map variable names (no '=' or NUL) to "
                         f"strings, got {env!r}")
    return dict(env)


def _program(command: Sequence[str], files: Mapping[str, str | bytes] | None) -> Program:
    """The command and files, checked by `Program` and refused in this class's own words."""
    try:
        return Program(files={} if files is None else files, argv=command)
    except ValueError as error:
        message = str(error).replace("Program.argv", "SubprocessEnvironment.command")
        message = message.replace("Program.files", "SubprocessEnvironment.files")
        raise ValueError(f"{message} (e.g. command=('python3', 'worker.py'))") from None


def _preview(reply: Any) -> str:
    text = repr(reply)
    return text if len(text) <= 200 else text[:200] + "..."


__all__ = ["ISOLATIONS", "SubprocessEnvironment", "ToolFailure", "WorkerEnvironment"]
