"""Small file helpers tasks share: atomic JSON writes, JSON-lines files, and the stage
directories keyed by their inputs (`stage_directory`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dew_lib.store import parts


def write_json(path: str, value: Any) -> None:
    """Write JSON so a reader sees the old file or the whole new one, never a part (indented,
    keys sorted, other values as str); `dew_lib.store.parts.write_json` does the durable write."""
    parts.write_json(path, value, indent=2, sort_keys=True, default=str)


def read_json(path: str) -> Any:
    """The JSON in `path`, or None when there is no such file."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None


def write_lines(path: str, records: Iterable[dict]) -> None:
    """One JSON object per line, written to a temporary file and renamed into place."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    os.replace(temporary, path)


# ----- stage directories keyed by their inputs ------------------------------------------------
#
# A training stage's work (checkpoints, metrics.jsonl, curves.png, result.json, its policy or
# model) lives in `<root>/<key[:12]>/`, where root is `runs/<name>/<stage>` and key the stage's
# fingerprint, so a checkpoint is only ever resumed by a run with the same inputs. `<root>/latest`
# points at the inputs this stage last started with; `<root>/policy`, `<root>/curves.png` and the
# other names in `links` point through it, so the documented paths keep working.

LATEST = "latest"
KEEP_VARIABLE = "DEW_KEEP_INPUTS"
KEEP_DEFAULT = 3
_KEYED = re.compile(r"^[0-9a-f]{12}$")
_MIGRATED = ("checkpoints", "policy", "model", "previews", "metrics.jsonl", "curves.png", "result.json")


def keep_inputs() -> int:
    """How many input sets' directories a stage keeps: $DEW_KEEP_INPUTS, else 3; 0 keeps all."""
    value = os.environ.get(KEEP_VARIABLE, "").strip()
    if not value:
        return KEEP_DEFAULT
    if not value.isdigit():
        raise ValueError(f"{KEEP_VARIABLE}={value!r}: give a whole number (0 keeps every input set)")
    return int(value)


@dataclass(frozen=True)
class StageDirectory:
    """Where a stage with these inputs works, and what the stage last started with before."""

    root: str  # runs/<name>/<stage>
    directory: str  # root/<key[:12]>
    first: bool  # no input set of this stage under root before this one
    switched: bool  # the stage last started with other inputs (or with ones not recorded)
    previous: dict | None  # the inputs it last started with, when switched and recorded
    pruned: tuple[str, ...] = ()  # directories of older input sets removed to keep `keep_inputs()`

    def fresh_reason(self, inputs: dict, labels: dict[str, str]) -> str:
        """Why a stage with no checkpoint of its own inputs trains from step 0, for the log."""
        if self.first:
            return f"first run of this stage under {self.root}"
        if not self.switched:
            return "same inputs as its last start, which left no checkpoint"
        named = changes(self.previous, inputs, labels) if self.previous else []
        return "inputs changed: " + ("; ".join(named) if named else "the earlier ones were not recorded")


def stage_directory(root: str, key: str, inputs: dict, links: tuple[str, ...]) -> StageDirectory:
    """Make `root/<key[:12]>` the directory of these inputs and point `root/latest` at it.

    inputs: what the key was computed from, as JSON, saved as inputs.json so a later start with
    other inputs can name what changed. links: the entries of the keyed directory also reachable
    as `root/<name>` (through `latest`). A stage directory of the layout before this rule (its
    files directly under root) is moved into the keyed directory its result.json names, or into
    `root/legacy` when it never finished (its checkpoints' inputs are unknown, so never resumed).
    Older input sets beyond `keep_inputs()` are removed, least recently started first.
    """
    os.makedirs(root, exist_ok=True)
    _migrate(root)
    name = key[:12]
    directory = os.path.join(root, name)
    latest = os.path.join(root, LATEST)
    pointed = os.readlink(latest) if os.path.islink(latest) else None
    earlier = [e for e in os.listdir(root) if _KEYED.match(e) or e.startswith("legacy")]
    previous = None
    if pointed is not None and pointed != name:
        previous = (read_json(os.path.join(root, pointed, "inputs.json")) or {}).get("inputs")
    os.makedirs(directory, exist_ok=True)
    write_json(os.path.join(directory, "inputs.json"), {"key": key, "inputs": inputs})  # mtime: last start
    if pointed != name:
        temporary = f"{latest}.{uuid.uuid4().hex}.tmp"
        os.symlink(name, temporary)
        os.replace(temporary, latest)
    for link in links:
        try:
            os.symlink(os.path.join(LATEST, link), os.path.join(root, link))
        except FileExistsError:
            pass
    return StageDirectory(root=root, directory=directory, first=not earlier,
                          switched=pointed != name and any(e != name for e in earlier), previous=previous,
                          pruned=_prune(root, name))


def enter_stage(root: str, key: str, inputs: dict, links: tuple[str, ...], stage: str,
                logger) -> tuple[StageDirectory, dict | None]:
    """The directory of these inputs (`stage_directory`; each older input set it prunes is
    logged) and, when its result.json says it finished with exactly these inputs, that result
    rebased to where it lies now; None when the stage has to train."""
    place = stage_directory(root, key, inputs, links)
    for gone in place.pruned:
        logger.info("%s: removed %s, an older input set (%s keeps %d)", stage, gone, KEEP_VARIABLE,
                    keep_inputs())
    done = read_json(os.path.join(place.directory, "result.json"))
    if done is None or done.get("fingerprint") != key:
        return place, None
    return place, rebased(done["result"], place.directory)


def start_point(place: StageDirectory, inputs: dict, steps: int, *, stage: str, labels: dict[str, str],
                logger, shorter: bool = True) -> tuple[int | None, str]:
    """Where a stage's training starts, logged: (the checkpoint step it continues from, None for
    step 0; the checkpoints directory that step was first written in). A retry continues its own
    last checkpoint; with `shorter`, a run whose inputs differ from another set's only in steps
    continues that set's checkpoint (`continue_shorter`; not for a schedule that spans the steps)."""
    from dew_lib.train.checkpoint import Checkpoints

    checkpoints = os.path.join(place.directory, "checkpoints")
    resumed, written = None, os.path.abspath(checkpoints)
    if os.path.isdir(checkpoints):
        existing = Checkpoints(checkpoints)
        try:
            resumed = existing.latest()
        finally:
            existing.close()
    if resumed is not None:
        logger.info("%s resumes from its checkpoint at step %d (same inputs)", stage, resumed)
    elif shorter and (found := continue_shorter(place, inputs, steps, checkpoints)):
        written, resumed, before = found
        logger.info("%s resumes from the checkpoint at step %d of the same inputs with steps=%d "
                    "(only steps changed: %d -> %d, so it trains on from there)", stage, resumed,
                    before, before, steps)
    else:
        logger.info("%s trains from scratch (%s)", stage, place.fresh_reason(inputs, labels))
    return resumed, written


def continue_shorter(place: StageDirectory, inputs: dict, steps: int,
                     checkpoints: str) -> tuple[str, int, int] | None:
    """Copy in the newest checkpoint of the same training stopped earlier, when there is one.

    That is another input set of this stage that differs from `inputs` only in
    `params.steps`, with a checkpoint at or below `steps`: a run with more steps continues it as
    a retry would (only for stages whose optimizer and data do not depend on their steps, which
    the caller decides). Its step directory is hard-linked (or copied) into `checkpoints`, so
    the shorter run's directory stays as it was. Returns (the checkpoints directory it came
    from, its step, the shorter run's steps), or None.
    """
    found = []
    for entry in os.listdir(place.root):
        other = os.path.join(place.root, entry)
        recorded = (read_json(os.path.join(other, "inputs.json")) or {}).get("inputs") \
            if _KEYED.match(entry) and other != place.directory else None
        source = os.path.join(other, "checkpoints")
        if not recorded or _but_steps(recorded) != _but_steps(inputs) or not os.path.isdir(source):
            continue
        kept = [int(e) for e in os.listdir(source) if e.isdigit() and int(e) <= steps]
        if kept:
            found.append((max(kept), source, recorded["params"]["steps"]))
    if not found:
        return None
    step, source, before = max(found)
    os.makedirs(checkpoints, exist_ok=True)
    target = os.path.join(checkpoints, str(step))
    staging = f"{target}.{uuid.uuid4().hex}.tmp"  # not a step directory until complete
    shutil.copytree(os.path.join(source, str(step)), staging, copy_function=_link_or_copy)
    os.replace(staging, target)
    return os.path.abspath(source), step, before


def _but_steps(inputs: dict) -> dict:
    params = inputs.get("params")
    if not isinstance(params, dict):
        return inputs
    return {**inputs, "params": {k: v for k, v in params.items() if k != "steps"}}


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def rebased(recorded: dict, directory: str) -> dict:
    """A result.json's result with its paths moved from where it was written to `directory`
    (the run tree may have moved since, or the result came from the layout before keying)."""
    old = recorded.get("directory")

    def move(value):
        if isinstance(value, str) and old and (value == old or value.startswith(old + os.sep)):
            return directory + value[len(old):]
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        if isinstance(value, list):
            return [move(v) for v in value]
        return value

    return move(recorded)


def changes(previous: dict, current: dict, labels: dict[str, str]) -> list[str]:
    """What differs between two recorded inputs, named by `labels` (a group's changed fields
    are listed with their old and new values; fingerprints are named only)."""
    named, order = [], [*labels, *sorted((set(previous) | set(current)) - set(labels))]
    for group in order:
        old, new = previous.get(group), current.get(group)
        if old == new:
            continue
        label = labels.get(group, group)
        if isinstance(old, dict) and isinstance(new, dict):
            fields = [f"{f} {old.get(f)!r} -> {new.get(f)!r}" for f in sorted(set(old) | set(new))
                      if old.get(f) != new.get(f)]
            named.append(f"{label} ({', '.join(fields)})")
        elif isinstance(old, (int, float)) and isinstance(new, (int, float)):
            named.append(f"{label} {old!r} -> {new!r}")
        else:
            named.append(label)
    return named


def _migrate(root: str) -> None:
    """Move a stage directory of the unkeyed layout into a keyed (or `legacy`) directory."""
    found = [e for e in _MIGRATED if os.path.lexists(os.path.join(root, e))
             and not os.path.islink(os.path.join(root, e))]
    if not found:
        return
    done = read_json(os.path.join(root, "result.json")) if "result.json" in found else None
    key = done.get("fingerprint") if isinstance(done, dict) else None
    target = os.path.join(root, key[:12] if key else "legacy")
    if os.path.exists(target):
        target = os.path.join(root, f"legacy-{uuid.uuid4().hex[:8]}")
    os.makedirs(target)
    for entry in found:
        os.replace(os.path.join(root, entry), os.path.join(target, entry))


def _prune(root: str, keep_name: str) -> tuple[str, ...]:
    keep = keep_inputs()
    if keep <= 0:
        return ()
    keyed = [e for e in os.listdir(root) if _KEYED.match(e) and e != keep_name
             and os.path.isdir(os.path.join(root, e))]

    def started(entry: str) -> float:
        marker = os.path.join(root, entry, "inputs.json")
        return os.path.getmtime(marker if os.path.exists(marker) else os.path.join(root, entry))

    removed = sorted(keyed, key=started, reverse=True)[keep - 1:]
    for entry in removed:
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    return tuple(os.path.join(root, e) for e in removed)
