"""Flow parameters from a command line and a parameters file (JSON or YAML): what `python -m
flows` and the other flows' `main` read. tasks/params.py re-exports these.

Not here: the parameter models themselves (tasks/params.py).
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

P = TypeVar("P", bound=BaseModel)


def read_params_file(path: str) -> dict:
    """A parameters file: JSON or YAML (by its extension; YAML otherwise), the fields of the
    flow's parameters as the UI form shows them, or a deployment's `{"params": {...}}`."""
    import json

    import yaml

    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        value = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"{path} is not {'JSON' if path.endswith('.json') else 'YAML'}: {error}") from None
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}; a parameters file is a mapping of "
                         'fields, e.g. {"name": "gsm8k", "data": {"source": "files", ...}}')
    if set(value) == {"params"} and isinstance(value["params"], dict):
        value = value["params"]  # the deployment's shape: parameters={"params": {...}}
    return value


def _merged(base: dict, changes: dict) -> dict:
    """`base` with `changes` written over it, mappings merged field by field."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = (_merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict)
                    else value)
    return out


def command_line(argv: list[str], defaults: P, *, prog: str, description: str) -> P:
    """`defaults`, or the parameters file `--params FILE` (JSON or YAML), with `--name`, `--root`
    and `--seed` from the command line over either."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--params", metavar="FILE", help="a JSON or YAML file of parameters, the "
                        "fields the UI form shows (or a deployment's {\"params\": {...}}); fields it "
                        "leaves out keep their defaults")
    parser.add_argument("--name", help=f"run name (default: {defaults.name})")
    parser.add_argument("--root", help=f"project directory (default: {defaults.root})")
    parser.add_argument("--seed", type=int, help=f"seed (default: {defaults.seed})")
    args = parser.parse_args(argv)
    given = dict(defaults)
    if args.params is not None:
        try:
            # Only what `defaults` set explicitly: a field the file gives under an earlier name
            # (Options.RENAMED) must not meet the default of its name now.
            given = _merged(defaults.model_dump(exclude_unset=True), read_params_file(args.params))
        except (OSError, ValueError) as error:
            parser.error(str(error))
    given = {**given, **{field: getattr(args, field) for field in ("name", "root", "seed")
                         if getattr(args, field) is not None}}
    return type(defaults)(**given)
