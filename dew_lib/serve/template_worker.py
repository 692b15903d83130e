"""Render one chat template sent with a request, in a process of its own: `dew_lib.serve.template` runs it.

Run by path (`python -I template_worker.py MEMORY_BYTES CPU_SECONDS`), so it imports nothing of Dew
(nor JAX): only the standard library and jinja2. It lowers its own limits (address space, CPU
seconds, no file writes, few file descriptors), writes one newline once it is ready, reads one JSON
request from stdin and writes one JSON answer to stdout: `{"text": ...}` or `{"error": ...,
"kind": ...}`. The parent kills it when it outlasts the time limit.

The template is rendered the way transformers' `apply_chat_template` renders one, so a template
written for it renders the same here: an ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks and loop controls; `tojson` without ASCII escapes; `raise_exception`,
`strftime_now`, a `namespace` that refuses underscore-prefixed names; `{% generation %}` blocks
rendered as their content; the variables `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's special tokens, then the request's own; and
continue_final_message cut after the final message's content. The rendered text is counted as it
is generated and stopped past `max_chars`.

Not here: deciding whether a request's template is served (`template`), tokenizing the text.
"""

import datetime
import json
import resource
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of the continued message


class TooLong(Exception):
    """The rendering passed the character limit."""


class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask blocks) renders its content."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class Namespace(jinja2.utils.Namespace):
    """A namespace that cannot store underscore-prefixed names (transformers' hardening)."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's own signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            Namespace.check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        Namespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore-prefixed name {name!r}")


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(form):
    return datetime.datetime.now().strftime(form)


def environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace)
    return env


def render(request: dict) -> str:
    template = environment().from_string(request["template"])
    messages, final = request["messages"], None
    if request["continue_final_message"]:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message whose content is text")
        final = messages[-1]["content"]
        messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
    variables = {**request["variables"], "messages": messages, "tools": request["tools"],
                 "documents": request["documents"], "add_generation_prompt": request["add_generation_prompt"]}
    pieces, size, most = [], 0, request["max_chars"]
    for piece in template.generate(**variables):
        size += len(piece)
        if size > most:
            raise TooLong(f"the rendered prompt passed {most} characters")
        pieces.append(piece)
    text = "".join(pieces)
    if final is not None:  # cut after the final message's content, as apply_chat_template does
        tag = text.rfind(CONTINUE_TAG.strip())
        if tag < 0 or final.strip() not in text:
            raise ValueError("continue_final_message is set but the template dropped the final message's content")
        text = text[:tag] if text[tag:tag + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:tag].rstrip()
    return text


def main() -> None:
    memory, seconds = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (8, 8))
    sys.stdout.write("\n")
    sys.stdout.flush()
    request = json.loads(sys.stdin.read())
    try:
        answer = {"text": render(request)}
    except TooLong as error:
        answer = {"error": str(error), "kind": "size"}
    except MemoryError:
        answer = {"error": f"the rendering ran out of memory ({memory // 2**20} MiB)", "kind": "memory"}
    except RecursionError:
        answer = {"error": "the rendering recursed too deeply", "kind": "error"}
    except Exception as error:  # noqa: BLE001 - the template's own error goes back to its client
        answer = {"error": f"{type(error).__name__}: {error}", "kind": "error"}
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
