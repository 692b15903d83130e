"""Whether a text stage's update fits its devices, checked before the stage allocates its state.

The stage's own Trainer (its objective, optimizer, accumulation and mesh) compiles its update
ahead of time on abstract shapes (`dew_lib.train.plan.measure`), so the plan counts exactly the
state the stage would hold and XLA's temporary peak for the devices it runs on. A stage that does
not fit is refused with the plan and what to change, before its optimizer state and reference
exist; one that fits logs its plan. The limit is `device_memory` when given, else what the devices
report (GPUs and TPUs do; CPUs report none, and such a stage is not planned).
"""

from __future__ import annotations

from dew_lib.plan_tables import DEVICE_BYTES
from dew_lib.train.plan import device_limit, measure
from tasks.refusals import RunRefused


def planned_bytes(device_memory: str) -> int | None:
    """`device_memory` as bytes: a known device's memory (`h200`) or a whole number of bytes;
    None when empty."""
    text = device_memory.strip().lower()
    if not text:
        return None
    if text in DEVICE_BYTES:
        return DEVICE_BYTES[text]
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"device_memory={device_memory!r} is neither a known device ({', '.join(DEVICE_BYTES)}) "
                     "nor a whole number of bytes")


def check_memory(stage: str, kind: str, trainer, rows: int, width: int, device_memory: str, dtype: str,
                 logger) -> None:
    """Refuse `stage` if one step of `trainer` on `rows` rows of `width` ids outgrows a device."""
    limit = planned_bytes(device_memory) or device_limit()
    if limit is None:
        logger.info("%s: the devices report no memory limit, so the stage is not planned; set "
                    "device_memory (e.g. 'h200') to check it against a device", stage)
        return
    plan = measure(trainer, kind, rows=rows, width=width, device=limit, dtype=dtype)
    if not plan.fits:
        given = f"device_memory={device_memory!r}" if device_memory else "as the devices report it"
        raise RunRefused(f"{stage} does not fit a device's {limit:,} bytes ({given}), so it was not "
                         f"started:\n{plan.report()}")
    logger.info("%s fits: %s", stage, plan.report())


__all__ = ["check_memory", "planned_bytes"]
