"""Rebuild the PEFT adapter fixtures (tests/fixtures/peft) with the real PEFT library.

Run from the repository root:

    python3 tools/parity_peft.py

The script builds its own venv at tools/.venv-peft (CPU torch 2.13.0, transformers and PEFT at the
versions pinned below; the PEFT wheel is installed from the file, so the manifest quotes its
sha256) and re-runs itself there. For tiny random Qwen3 (tied embeddings), Qwen2 (q/k/v biases)
and Llama models (float32) it saves the base with transformers, puts a PEFT LoRA on it with random
non-zero A and B (all seven projections; q_proj and v_proj under rsLoRA; a regex selecting four
projections, with dropout), saves the adapter with PEFT's `save_pretrained` and records PEFT's
logits of fixed ids with the adapter loaded back from the files. Then the project's venv (JAX, no
torch) loads each adapter with Dew's `load_adapter`, changes it deterministically (lora_b x 1.5,
lora_a + 0.01) and writes it with `save_adapter`; PEFT loads that Dew-written adapter with
`PeftModel.from_pretrained` and its logits are recorded too. Exit status 1 if Dew and PEFT differ
by more than the tolerance anywhere.

Fixture layout, per family (qwen3, qwen2, llama): `<family>/base/` (config.json,
generation_config.json, model.safetensors: the base, as transformers saved it), `<family>/peft/`
(adapter_config.json, adapter_model.safetensors: as PEFT saved them; PEFT's README.md model card is
dropped), `<family>/dew/` (the same two files as Dew saved the changed adapter). `references.npz`:
`ids` int64 [2, 8]; per family, transformers' and PEFT's float32 logits [2, 8, vocab] of the base
alone (`<family>_base`), with the PEFT adapter (`<family>_peft`) and with the Dew-written adapter
(`<family>_dew`). MANIFEST.json: generator,
seed, tolerance, the reference versions (PEFT's wheel sha256), each family's LoRA options and the
differences measured (`peft_adapter_vs_base` and `dew_change_effect` show that the adapter and the
change move the logits far beyond the tolerance).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parity_io as io  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "peft"
VENV = ROOT / "tools" / ".venv-peft"
PEFT = "0.21.2"
TRANSFORMERS = "5.25.0"  # the project venv's version
SEED = 20260601
TOLERANCE = 1e-5  # absolute, float32 logits
FAMILIES = ("qwen3", "qwen2", "llama")
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _specs():
    """Each family's tiny base (transformers config class and options) and its LoRA."""
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    return {
        "qwen3": dict(cls="Qwen3ForCausalLM", config="Qwen3Config",
                      options=dict(common, head_dim=8, tie_word_embeddings=True),
                      lora=dict(r=4, lora_alpha=8, target_modules=SEVEN)),
        "qwen2": dict(cls="Qwen2ForCausalLM", config="Qwen2Config",
                      options=dict(common, tie_word_embeddings=False),
                      lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True)),
        "llama": dict(cls="LlamaForCausalLM", config="LlamaConfig",
                      options=dict(common, tie_word_embeddings=False),
                      lora=dict(r=2, lora_alpha=6, lora_dropout=0.05,
                                target_modules=r".*\.(k_proj|o_proj|gate_proj|down_proj)")),
    }


def _ids():
    import numpy as np

    return np.random.default_rng(SEED).integers(3, 64, size=(2, 8))


# -- the PEFT side (tools/.venv-peft) --------------------------------------------------------------


def _randomize(model, torch, generator, adapters: bool):
    """Weights that matter: base linears ~ N(0, 1/in), norms near 1, biases off zero; with
    `adapters`, the LoRA factors (else B would be zero and the adapter prove nothing)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("lora_" in name) != adapters:
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith(".bias"):
                value = 0.2 * noise
            else:
                value = noise / param.shape[1] ** 0.5
            param.copy_(value.to(param.dtype))


def _logits(model, torch, ids):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids), use_cache=False).logits.float().numpy()


def _with_adapter(family: str, adapter: Path, torch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(FIXTURES / family / "base"), dtype=torch.float32,
                                                attn_implementation="eager", local_files_only=True)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def peft_side() -> dict:
    """Write the bases and PEFT's adapters, have Dew write its own, record PEFT's logits of both."""
    import numpy as np
    import peft
    import safetensors
    import torch
    import transformers

    generator = torch.Generator().manual_seed(SEED)
    ids = _ids()
    references = {"ids": ids}
    if FIXTURES.exists():
        shutil.rmtree(FIXTURES)
    for family, spec in _specs().items():
        config = getattr(transformers, spec["config"])(**spec["options"])
        model = getattr(transformers, spec["cls"])(config).eval()
        _randomize(model, torch, generator, adapters=False)
        model.save_pretrained(str(FIXTURES / family / "base"))
        references[f"{family}_base"] = _logits(model, torch, ids)
        lora = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **spec["lora"]))
        _randomize(lora, torch, generator, adapters=True)
        lora.save_pretrained(str(FIXTURES / family / "peft"))
        (FIXTURES / family / "peft" / "README.md").unlink()
        references[f"{family}_peft"] = _logits(_with_adapter(family, FIXTURES / family / "peft", torch),
                                               torch, ids)
    np.savez(FIXTURES / "references.npz", **references)
    with tempfile.TemporaryDirectory(prefix="dew-peft-") as work:
        dew = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "python"), __file__, "--side", "dew", "--work", work],
            check=True, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        measured = json.loads(dew.stdout.strip().splitlines()[-1])
        dew_logits = dict(np.load(Path(work) / "dew_logits.npz"))
    for family in FAMILIES:
        model = _with_adapter(family, FIXTURES / family / "dew", torch)
        references[f"{family}_dew"] = _logits(model, torch, ids)
        measured[family]["peft_vs_dew_on_dew_adapter"] = float(
            np.abs(references[f"{family}_dew"] - dew_logits[family]).max())
        for name, ours in (("peft_adapter_vs_base", "peft"), ("dew_change_effect", "dew")):
            before = references[f"{family}_base" if ours == "peft" else f"{family}_peft"]
            measured[family][name] = float(np.abs(references[f"{family}_{ours}"] - before).max())
    np.savez(FIXTURES / "references.npz", **references)
    manifest = {
        "generator": "tools/parity_peft.py", "seed": SEED, "tolerance": TOLERANCE,
        "reference": {**io.installed("peft"),
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                   "safetensors": safetensors.__version__, "numpy": np.__version__,
                                   "python": platform.python_version()},
                      "called": "peft.get_peft_model, PeftModel.save_pretrained, PeftModel.from_pretrained"},
        "dew_change": "lora_b * 1.5, lora_a + 0.01, then save_adapter",
        "families": {family: {"architecture": spec["cls"], "lora": spec["lora"], "measured": measured[family]}
                     for family, spec in _specs().items()},
    }
    (FIXTURES / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- the Dew side (the project's venv; no torch) ---------------------------------------------------


def dew_side(work: Path) -> dict:
    """Load each PEFT adapter with Dew, compare logits, write the changed adapter with Dew."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dew_lib.models import load_adapter, load_pretrained, lora, save_adapter

    references = np.load(FIXTURES / "references.npz")
    ids = jnp.asarray(references["ids"])
    measured, logits = {}, {}
    for family in FAMILIES:
        base = load_pretrained(FIXTURES / family / "base", tokenizer=False)
        model, variables = load_adapter(FIXTURES / family / "peft", base.model, base.variables)
        ours = np.asarray(model.apply(variables, ids))
        measured[family] = {"dew_vs_peft_on_peft_adapter": float(np.abs(ours - references[f"{family}_peft"]).max())}

        def change(path, leaf):
            if not lora.is_adapter(path):
                return leaf
            return leaf * 1.5 if path[-1].key == "lora_b" else leaf + 0.01

        changed = jax.tree_util.tree_map_with_path(change, variables)
        save_adapter(FIXTURES / family / "dew", model, changed)
        logits[family] = np.asarray(model.apply(changed, ids))
    np.savez(work / "dew_logits.npz", **logits)
    return measured


# -- driver ----------------------------------------------------------------------------------------


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["peft", "dew"], default="peft", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "dew":
        print(json.dumps(dew_side(args.work)))
        return 0
    io.run_in_venv(__file__, VENV, "peft", PEFT, no_deps=False,
                   extras=[f"transformers=={TRANSFORMERS}", "safetensors"])
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    manifest = peft_side()
    print("references:", json.dumps(manifest["reference"]))
    failed = False
    for family, row in manifest["families"].items():
        values = row["measured"]
        failed |= any(value > TOLERANCE for key, value in values.items() if key.startswith(("dew_vs", "peft_vs")))
        print(f"{family:6} " + "  ".join(f"{key} {value:.2e}" for key, value in values.items()))
    print("FAILED" if failed else f"Dew and PEFT agree within {TOLERANCE} absolute")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
