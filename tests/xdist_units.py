"""How `pytest -n N` shares the tests out: the tests of a module that use one of its
module-scoped fixtures (often a whole pipeline run) go to one worker as one unit, so the fixture
is built once; every other test goes out on its own, as under xdist's default `load`.

Under `load`, two workers each draw some of a module's tests and each builds the module's
fixtures; the pipeline runs were built twice. xdist's own `loadgroup` would do this with marks,
but it renames the items' `_nodeid`, which pytest 9 no longer reads, so the groups are read here,
in the controller, from the test files' source.

Not here: which tests run (pytest's collection), the fixtures themselves.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path


def fixture_scope(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The scope of a `@pytest.fixture` function ("function" when not given); None for others."""
    for decorator in node.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        target = call.func if call is not None else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name != "fixture":
            continue
        for keyword in call.keywords if call is not None else ():
            if keyword.arg == "scope" and isinstance(keyword.value, ast.Constant):
                return str(keyword.value.value)
        return "function"
    return None


@functools.cache
def module_fixture_users(path: Path) -> frozenset[str]:
    """The tests (top-level or in a class) of the file at `path` that ask for one of its
    module-scoped fixtures, directly or through its other fixtures."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError):
        return frozenset()
    bodies = [tree.body, *(c.body for c in tree.body if isinstance(c, ast.ClassDef))]
    functions = {n.name: n for body in bodies for n in body
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    fixtures = {name: scope for name, node in functions.items() if (scope := fixture_scope(node))}
    shared = {name for name, scope in fixtures.items() if scope == "module"}

    def asks(name: str) -> set[str]:
        return {a.arg for a in functions[name].args.args} & shared

    grew = True
    while grew:  # a fixture that asks for a shared one is shared too
        more = {name for name in fixtures if name not in shared and asks(name)}
        shared |= more
        grew = bool(more)
    return frozenset(name for name in functions if name.startswith("test") and asks(name))


def unit(root: Path, nodeid: str) -> str:
    """The unit of work a test belongs to: its module's shared unit, or the test alone."""
    path, _, rest = nodeid.partition("::")
    name = rest.rsplit("::", 1)[-1].split("[", 1)[0]
    if path.endswith(".py") and name in module_fixture_users(root / path):
        return f"{path}::<module fixtures>"
    return nodeid


def make_scheduler(config, log):
    """A LoadScopeScheduling whose scopes are `unit`s (see the module docstring)."""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(config.rootpath, nodeid)

        def _reschedule(self, node) -> None:
            # A replacement worker still collecting has no collection to index yet: its own
            # collection-finished event schedules it.
            if node in self.registered_collections:
                super()._reschedule(node)

        def _assign_work_unit(self, node) -> None:
            # A worker can die between reporting its last test and being sent more: the send then
            # fails, the unit stays recorded as the dead worker's, and `remove_node` hands it back.
            try:
                super()._assign_work_unit(node)
            except OSError:
                self.log("worker", node.gateway.id, "is gone; its new unit waits for remove_node")

        def remove_node(self, node):
            """A worker that crashed (a segfault, an abort) hands its unfinished units back, less
            the test it crashed in: xdist reports that one failed, and LoadScopeScheduling would
            queue it again, which hung the session once a replacement worker came up."""
            workload = self.assigned_work.pop(node)
            unfinished = [(scope, test) for scope, tests in workload.items()
                          for test, done in tests.items() if not done]
            if not unfinished:
                return None
            scope, crashed = unfinished[0]
            workload[scope][crashed] = True
            self.workqueue.update((s, tests) for s, tests in workload.items() if not all(tests.values()))
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return SharedFixtureScheduling(config, log)
