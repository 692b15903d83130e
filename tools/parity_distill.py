"""Write the distillation parity fixture from TRL 1.12's own `GKDTrainer.generalized_jsd_loss`.

Run from the repository root with any Python 3.11:

    python3 tools/parity_distill.py        # tests/fixtures/parity/distill_trl.json

It makes (or reuses) tools/.venv-trl-1.12 with the CPU build of torch and TRL 1.12.0 (the venv
`tools/parity_dpo.py --family` uses), re-runs itself there and writes the fixture. Tests never
import torch or TRL.

How TRL is called. `GKDTrainer.generalized_jsd_loss` (trl/experimental/gkd/gkd_trainer.py) is a
static method of plain tensors: it is called as it is, on fixed random float64 logits, with
reduction 'batchmean' (what `compute_loss` uses). Gradients are torch autograd through it, with
respect to the student's logits (the teacher's get none in GKD: it runs under no_grad).

Fixture layout (arrays are {"dtype", "shape", "data"}; see tools/_parity_io.py `load_array`):

    reference: package, version, wheel_sha256, source_sha256 of gkd_trainer.py (the revision of
               the code called), torch version, the method called
    inputs:    student_logits, teacher_logits   float64 [B, T, V]
               labels                           int64   [B, T]  token ids, -100 where masked (one
                                                                row is masked whole, as a fully
                                                                truncated completion is)
    cases[]:   name, options {beta, temperature, labels: bool}, outputs {loss float64 [],
               grad_student_logits float64 [B, T, V]}

Cases: beta in {0, 0.5, 1} x temperature in {1, 2} x with and without labels (without them TRL's
'batchmean' divides the sum over every position by the batch size).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parity_io as io  # noqa: E402

TRL_VERSION = "1.12.0"
VENV = io.ROOT / "tools" / ".venv-trl-1.12"
SEED = 20261207
BATCH, LENGTH, VOCAB = 3, 5, 11


def _inputs(torch):
    generator = torch.Generator().manual_seed(SEED)
    student = torch.randn(BATCH, LENGTH, VOCAB, generator=generator, dtype=torch.float64) * 2.0
    teacher = torch.randn(BATCH, LENGTH, VOCAB, generator=generator, dtype=torch.float64) * 3.0
    labels = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    labels[0, :2] = -100  # a prompt
    labels[1, 4:] = -100  # padding after EOS
    labels[2, :] = -100   # a row with nothing counted
    return student, teacher, labels


def _case(torch, trainer, student, teacher, labels, beta: float, temperature: float, masked: bool) -> dict:
    leaf = student.clone().requires_grad_(True)
    loss = trainer.generalized_jsd_loss(leaf, teacher, labels=labels if masked else None, beta=beta,
                                        temperature=temperature, reduction="batchmean")
    loss.backward()
    name = f"beta_{beta}_t{temperature:g}_{'labels' if masked else 'nolabels'}"
    return {"name": name, "options": {"beta": beta, "temperature": temperature, "labels": masked},
            "outputs": {"loss": io.encode(loss.detach()), "grad_student_logits": io.encode(leaf.grad)}}


def main() -> None:
    io.run_in_venv(__file__, VENV, "trl", TRL_VERSION, no_deps=False, extras=[])
    import torch
    import trl.experimental.gkd.gkd_trainer as gkd

    student, teacher, labels = _inputs(torch)
    cases = [_case(torch, gkd.GKDTrainer, student, teacher, labels, beta, temperature, masked)
             for beta in (0.0, 0.5, 1.0) for temperature in (1.0, 2.0) for masked in (True, False)]
    document = {
        "generator": "tools/parity_distill.py",
        "seed": SEED,
        "reference": {**io.installed("trl"), "source_sha256": io.source_sha256(gkd),
                      "versions": io.versions("torch"),
                      "called": "trl.experimental.gkd.GKDTrainer.generalized_jsd_loss(student_logits, "
                                "teacher_logits, labels, beta, temperature, reduction='batchmean')"},
        "inputs": {"student_logits": io.encode(student), "teacher_logits": io.encode(teacher),
                   "labels": io.encode(labels)},
        "cases": cases,
    }
    path = io.write("distill_trl.json", document)
    print(f"wrote {path.relative_to(io.ROOT)}: {len(cases)} cases, trl {document['reference']['version']}")


if __name__ == "__main__":
    main()
