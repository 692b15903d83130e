"""Chat templates sent with a request: refused unless the server trusts them, then rendered in a sandbox.

A client can name its own Jinja template, top-level (`chat_template`) or inside
`chat_template_kwargs`, as vLLM's API allows. A template is code the server runs: Jinja's sandbox
keeps it from Python's internals, but not from looping for minutes or rendering gigabytes, and the
server's chat rendering shares one text thread with every response. So, as vLLM does, a request
template is refused (400, naming the parameter) unless the server was launched with
`--trust-request-chat-template`. A trusted one is rendered by `TemplateRenderer` in a fresh
process (`template_worker.py`: only jinja2, an ImmutableSandboxedEnvironment, its own rlimits on
memory, CPU and files), which is killed when it outlasts `template_timeout` seconds (or its client
leaves) and stops itself past `template_max_chars` characters. The event loop only awaits a thread
that talks to the process, and the text thread and the engine never see the template, so a runaway
template costs its own request and at most `parallel` cores, never the draws of others.

The checkpoint's own template is the operator's and is rendered in-process by the tokenizer.

Not here: tokenizing the rendered text (`app`, on the policy's text thread).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from dew_lib.serve.protocol import ChatCompletionRequest, ServeError

WORKER = Path(__file__).with_name("template_worker.py")
TRUST_FLAG = "--trust-request-chat-template"
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")  # variables the server sets
STARTUP = 30.0  # seconds a worker may take to start (the time limit counts from its first byte)
MEMORY = 512 * 2**20  # address space of a worker


def request_template(request: ChatCompletionRequest, trusted: bool) -> tuple[str, str] | None:
    """(the template the request sends, the parameter it came in), or None; refused (ServeError)
    when the server does not trust request templates or the request sends two differing ones."""
    kwargs = request.chat_template_kwargs or {}
    sent = {name: value for name, value in (("chat_template", request.chat_template),
                                             ("chat_template_kwargs.chat_template", kwargs.get("chat_template")))
            if value is not None}
    if not sent:
        return None
    param = next(iter(sent))
    if not trusted:
        raise ServeError(f"Chat template is passed with request, but {TRUST_FLAG} is not set: this server renders "
                         f"messages with its checkpoint's chat template only. Leave {param} out, or relaunch dew "
                         f"serve with {TRUST_FLAG} if every client may run its own template.", param=param)
    if len(set(map(str, sent.values()))) > 1:
        raise ServeError("chat_template and chat_template_kwargs.chat_template differ; send one of them",
                         param="chat_template_kwargs.chat_template")
    template = sent[param]
    if not isinstance(template, str):
        raise ServeError(f"{param} must be a string, got {type(template).__name__}", param=param)
    reserved = sorted(set(kwargs) & set(RESERVED))
    if reserved:
        raise ServeError(f"chat_template_kwargs.{reserved[0]} would replace what the request itself gives the "
                         "template; leave it out", param=f"chat_template_kwargs.{reserved[0]}")
    return template, param


class TemplateRenderer:
    """Renders request templates in worker processes, `parallel` at a time, each killed after
    `timeout` seconds of rendering and stopped past `max_chars` characters."""

    def __init__(self, *, timeout: float, max_chars: int, parallel: int = 2, memory: int = MEMORY):
        self.timeout, self.max_chars, self.memory = float(timeout), int(max_chars), int(memory)
        self._slots = asyncio.Semaphore(parallel)

    async def render(self, template: str, messages: list[dict[str, Any]], *, tools, add_generation_prompt: bool,
                     continue_final_message: bool, variables: dict[str, Any], param: str) -> str:
        """The rendered prompt text; a ServeError naming `param` when the template fails, is too
        large, outlasts the time limit or runs out of memory."""
        if len(template) > self.max_chars:
            raise ServeError(f"the chat template is {len(template)} characters, more than this server renders "
                             f"({self.max_chars})", param=param)
        request = {"template": template, "messages": [_plain(m) for m in messages], "tools": tools,
                   "documents": None, "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, "variables": variables,
                   "max_chars": self.max_chars}
        try:
            payload = json.dumps(request).encode()
        except (TypeError, ValueError) as error:
            raise ServeError(f"chat_template_kwargs cannot be given to a template: {error}", param=param) from None
        async with self._slots:
            answer = await self._run(payload, param)
        if "text" in answer:
            return answer["text"]
        kind = answer.get("kind")
        reasons = {"size": "is too large", "memory": "ran out of memory"}
        reason = reasons.get(kind, "failed") if isinstance(kind, str) else "failed"
        raise ServeError(f"the request's chat template {reason}: {answer.get('error')}", param=param)

    async def _run(self, payload: bytes, param: str) -> dict:
        cpu = math.ceil(self.timeout) + 1  # a backstop: the worker dies on its own if nobody kills it
        # posix_spawn (close_fds=False: Python's descriptors are close-on-exec anyway): no fork of this
        # multithreaded process, no Python run in a forked child
        worker = subprocess.Popen([sys.executable, "-I", str(WORKER), str(self.memory), str(cpu)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  env=_environment(), close_fds=False)
        try:  # the blocking exchange on a thread of its own; the event loop only awaits it
            out = await asyncio.to_thread(self._exchange, worker, payload)
        finally:  # a timeout, or a client that left (this await cancelled): the worker goes
            if worker.poll() is None:
                worker.kill()
            await asyncio.to_thread(worker.wait)
        if out is None:
            raise ServeError(f"the request's chat template did not finish rendering within {self.timeout:g} s; "
                             "send a template that renders faster (or none)", param=param)
        try:
            return json.loads(out)
        except ValueError:
            raise ServeError(f"the request's chat template stopped its renderer (exit status {worker.returncode})",
                             param=param) from None

    def _exchange(self, worker: subprocess.Popen[bytes], payload: bytes) -> bytes | None:
        """The worker's answer, or None when it outlasted the time limit (counted from its start)."""
        stdout = worker.stdout
        if stdout is None:  # _run starts it with stdout piped
            raise ServeError("the chat template renderer has no stdout pipe", status=500, kind="InternalServerError")
        ready, _, _ = select.select([stdout], [], [], STARTUP)
        if not ready or stdout.read(1) != b"\n":
            raise ServeError("the chat template renderer failed to start", status=500, kind="InternalServerError")
        try:
            out, _ = worker.communicate(payload, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            return None
        return out


def _environment() -> dict[str, str]:
    """The worker's environment: what the interpreter may need to start, no secrets of the server's."""
    return {name: os.environ[name] for name in ("LD_LIBRARY_PATH",) if name in os.environ}


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template: keys whose value is null left out."""
    return {key: value for key, value in message.items() if value is not None}


__all__ = ["TRUST_FLAG", "TemplateRenderer", "request_template"]
