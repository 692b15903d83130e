"""Rebuild the Hugging Face parity fixtures; check Dew's checkpoint round trip against transformers.

Run from the repository root with the project's venv:

    .venv/bin/python tools/parity_hf.py            # rebuild tests/fixtures/hf, then check
    .venv/bin/python tools/parity_hf.py --check    # keep the fixtures, only check
    .venv/bin/python tools/parity_hf.py --only qwen3_moe,mixtral   # rebuild these, check all

The script makes its own venv at tools/.venv-hf with the CPU build of torch and the same
transformers version as the project's venv, and re-runs itself there. That side builds tiny random
Qwen3 (tied, tokenizer, single file), Qwen2 (q/k/v biases, sharded, legacy top-level rope_theta),
Llama (llama3 rope scaling, bfloat16 weights), Qwen3-MoE (qk-norm, top-2 of 8 renormalized),
Qwen2-MoE (biases, gated shared expert, top-2 of 8 not renormalized, sharded; as qwen2_moe_mixed
also with dense layers among sparse ones) and Mixtral (its own names; also in transformers 5's fused
layout as mixtral_fused) models, saves them with transformers, and records its float32 logits on a
plain batch, a padded batch (attention_mask, left and right padding) and packed rows (position_ids
restarting per document; transformers 5 turns restarts into a block-diagonal mask, checked against
running each document alone). For MoE models also its `aux_loss` (`output_router_logits=True`,
masked on the padded batch), each layer's experts, and the smallest gap between the k-th and
(k+1)-th router logit on the inputs (routers are scaled up so both sides pick the same experts). The
Dew side (project venv, no torch) loads each fixture, compares logits (and aux loss), and saves
float32 and bfloat16 copies, which transformers loads back and must match. Exit status 1 past a
tolerance (dense 1e-4, MoE 1e-5). `--only` rebuilds some fixtures and keeps the others and their
manifest entries as they are.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
VENV = ROOT / "tools" / ".venv-hf"
TORCH = "torch==2.13.0+cpu"  # the CPU wheel; a plain "torch==2.13.0" could resolve to a CUDA build
TOLERANCE = 1e-4  # absolute, float32 logits of the dense fixtures
MOE_TOLERANCE = 1e-5  # the MoE fixtures' logits and aux losses (issue 44)
SEED = 20260517
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen2_moe_mixed")
FAMILIES = ("qwen3", "qwen2", "llama", *MOE)
ROUTER_SCALE = 4.0  # router weights this much larger than other linear weights: no near-ties
MIN_MARGIN = 1e-3  # smallest accepted gap between the k-th and (k+1)-th router logit


# -- bootstrapping: which interpreter runs what ------------------------------------------------


def _dew_python() -> str:
    return os.environ.get("DEW_PYTHON") or str(ROOT / ".venv" / "bin" / "python")


def _ensure_venv() -> Path:
    """Create tools/.venv-hf with torch (CPU) and the project's transformers version."""
    python = VENV / "bin" / "python"
    wanted = subprocess.run(
        [_dew_python(), "-c", "import importlib.metadata as m; print(m.version('transformers'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    if not python.exists():
        subprocess.run([sys._base_executable, "-m", "venv", str(VENV)], check=True)
    probe = subprocess.run(
        [str(python), "-c", "import torch, transformers; print(torch.__version__, "
         "torch.version.cuda, transformers.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.split() != ["2.13.0+cpu", "None", wanted]:
        wheels = glob.glob("/opt/wheels/torch-2.13.0+cpu-*.whl")
        torch = wheels[0] if wheels else TORCH
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", torch, f"transformers=={wanted}",
             "safetensors", "numpy"],
            check=True,
        )
    return python


# -- the transformers side (tools/.venv-hf) ----------------------------------------------------


def _specs():
    """The tiny models: config options, how they are saved, and their quirks."""
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  rms_norm_eps=1e-6, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    specs = {
        "qwen3": dict(
            cls="Qwen3ForCausalLM", config="Qwen3Config",
            options=dict(common, intermediate_size=128, num_key_value_heads=2, head_dim=32,
                         tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
            shard=None, dtype="float32", tokenizer=True, legacy_rope=False,
        ),
        "qwen2": dict(
            cls="Qwen2ForCausalLM", config="Qwen2Config",
            options=dict(common, intermediate_size=96, num_key_value_heads=1,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
            shard="100KB", dtype="float32", tokenizer=False, legacy_rope=True,
        ),
        "llama": dict(
            cls="LlamaForCausalLM", config="LlamaConfig",
            options=dict(common, intermediate_size=128, num_key_value_heads=2,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0,
                                          "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 16}),
            shard=None, dtype="bfloat16", tokenizer=False, legacy_rope=False,
        ),
        "qwen3_moe": dict(
            cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig",
            options=dict(common, intermediate_size=96, num_key_value_heads=2, head_dim=32,
                         moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
            shard=None, dtype="float32", tokenizer=False, legacy_rope=False,
        ),
        "qwen2_moe": dict(
            cls="Qwen2MoeForCausalLM", config="Qwen2MoeConfig",
            options=dict(common, intermediate_size=96, num_key_value_heads=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                         router_aux_loss_coef=0.01, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
            shard="200KB", dtype="float32", tokenizer=False, legacy_rope=False,
        ),
        "mixtral": dict(
            cls="MixtralForCausalLM", config="MixtralConfig",
            options=dict(common, intermediate_size=32, num_key_value_heads=2, rms_norm_eps=1e-5,
                         num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
            shard=None, dtype="float32", tokenizer=False, legacy_rope=False, fused_copy=True,
        ),
    }
    mixed = dict(num_hidden_layers=6, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3])  # sparse: 1, 5
    specs["qwen2_moe_mixed"] = dict(specs["qwen2_moe"], shard=None, options={**specs["qwen2_moe"]["options"], **mixed})
    return specs


def _inputs():
    """Token ids, masks and positions shared by every family (numpy, int64)."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    plain = rng.integers(3, 128, size=(2, 12))
    padded = rng.integers(3, 128, size=(3, 12))
    mask = np.ones((3, 12), np.int64)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    padded = np.where(mask == 1, padded, 0)
    padded_positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    packed = rng.integers(3, 128, size=(2, 12))
    documents = [[5, 4, 3], [7, 5]]
    segments = np.zeros((2, 12), np.int64)
    positions = np.zeros((2, 12), np.int64)
    for row, lengths in enumerate(documents):
        start = 0
        for doc, length in enumerate(lengths):
            segments[row, start:start + length] = doc + 1
            positions[row, start:start + length] = np.arange(length)
            start += length
    return dict(plain_ids=plain, padded_ids=padded, padded_mask=mask,
                padded_positions=padded_positions, packed_ids=packed,
                packed_segments=segments, packed_positions=positions)


def _randomize(model, torch):
    """Replace the default init (std 0.02, unit norms, zero biases) with weights that matter.

    Logits of order one and norms and biases away from their neutral values make a wrong
    transpose, a missing bias or a skipped norm show up far above the tolerance. An MoE router
    (`mlp.gate.weight`, also Mixtral's in memory) gets ROUTER_SCALE times more, so its top-k
    choices are not near-tied.
    """
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith(".bias"):
                value = 0.2 * noise
            else:  # linear weights [(experts,) out, in], and the embedding (tied output projection)
                value = noise / param.shape[-1] ** 0.5
                if name.endswith(".mlp.gate.weight"):
                    value = value * ROUTER_SCALE
            param.copy_(value.to(param.dtype))


def _tokenizer(directory: Path):
    """A small word-level tokenizer with a chat template, saved in the transformers layout."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    words = ("the a cat dog sat on mat ran to and is red blue big small what plus minus equals "
             "zero one two three four five six seven eight nine ten user assistant system "
             "answer question yes no . , ? !").split()
    vocab = {token: i for i, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>",
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    tokenizer.save_pretrained(str(directory))


def _hf_logits(model, inputs, torch):
    """transformers' float32 logits on the plain, padded and packed inputs."""
    import numpy as np

    def run(**kwargs):
        with torch.no_grad():
            tensors = {k: torch.as_tensor(v) for k, v in kwargs.items()}
            return model(**tensors, use_cache=False).logits.float().numpy()

    out = {"plain": run(input_ids=inputs["plain_ids"])}
    out["padded"] = run(input_ids=inputs["padded_ids"], attention_mask=inputs["padded_mask"],
                        position_ids=inputs["padded_positions"])
    out["packed"] = run(input_ids=inputs["packed_ids"], position_ids=inputs["packed_positions"])
    # transformers 5 detects packing from restarting position_ids (with no attention_mask);
    # make sure it really kept documents apart by running each one alone.
    alone = np.zeros_like(out["packed"])
    for row in range(inputs["packed_ids"].shape[0]):
        for segment in np.unique(inputs["packed_segments"][row]):
            where = inputs["packed_segments"][row] == segment
            alone[row, where] = run(input_ids=inputs["packed_ids"][row, where][None])[0]
    gap = float(np.abs(alone - out["packed"]).max())
    if gap > TOLERANCE / 2:
        raise SystemExit(f"transformers' packed logits differ from per-document ones by {gap}")
    return out, gap


def _hf_routing(model, inputs, torch):
    """transformers' `aux_loss` (unscaled; over the tokens attention_mask keeps), each layer's
    experts `[layers, B, S, k]` and the smallest top-k router-logit margin over every position
    (padding too: both sides route every position)."""
    import numpy as np

    k = model.config.num_experts_per_tok
    out, margins = {}, []
    for case, kwargs in (
        ("plain", dict(input_ids=inputs["plain_ids"])),
        ("padded", dict(input_ids=inputs["padded_ids"], attention_mask=inputs["padded_mask"],
                        position_ids=inputs["padded_positions"])),
        ("packed", dict(input_ids=inputs["packed_ids"], position_ids=inputs["packed_positions"])),
    ):
        with torch.no_grad():
            result = model(**{key: torch.as_tensor(v) for key, v in kwargs.items()},
                           use_cache=False, output_router_logits=True)
        logits = np.stack([r.float().numpy() for r in result.router_logits])  # [L, B*S, E]
        ranked = -np.sort(-logits, axis=-1)
        margins.append(float((ranked[..., k - 1] - ranked[..., k]).min()))
        chosen = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
        out[f"experts_{case}"] = chosen.reshape(len(logits), *kwargs["input_ids"].shape, k).astype(np.int32)
        out[f"aux_loss_{case}"] = np.float32(result.aux_loss.item())
    margin = min(margins)
    if margin <= MIN_MARGIN:
        raise SystemExit(f"router top-k margin {margin} is near a tie; change ROUTER_SCALE or SEED")
    return out, margin


def _load_hf(directory: Path, torch):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()


def build_fixtures(only: tuple[str, ...] = FAMILIES) -> dict:
    """Write tests/fixtures/hf/<family>/ and references/<family>.npz for the families in `only`;
    return the manifest, whose entries for the other families are kept as they were."""
    import numpy as np
    import safetensors
    import torch
    import transformers

    torch.manual_seed(SEED)
    inputs = _inputs()
    (FIXTURES / "references").mkdir(parents=True, exist_ok=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "safetensors": safetensors.__version__, "numpy": np.__version__,
                "python": platform.python_version()}
    path = FIXTURES / "MANIFEST.json"
    manifest = json.loads(path.read_text()) if path.exists() and only != FAMILIES else {
        "generated_by": "tools/parity_hf.py", "versions": versions, "seed": SEED,
        "tolerance": TOLERANCE, "families": {}}
    for name, spec in ((n, spec) for n, spec in _specs().items() if n in only):
        directory = FIXTURES / name
        for old in directory.glob("*"):
            old.unlink()
        config = getattr(transformers, spec["config"])(**spec["options"])
        model = getattr(transformers, spec["cls"])(config).eval()
        _randomize(model, torch)
        save_dtype = getattr(torch, spec["dtype"])
        kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
        model.to(save_dtype).save_pretrained(str(directory), **kwargs)
        if spec.get("fused_copy"):  # transformers 5's in-memory layout, which Dew reads too
            shutil.rmtree(fused := FIXTURES / f"{name}_fused", ignore_errors=True)
            model.save_pretrained(str(fused), save_original_format=False)
        if spec["legacy_rope"]:  # the pre-transformers-5 layout: rope_theta at the top level
            config_path = directory / "config.json"
            legacy = json.loads(config_path.read_text())
            rope = legacy.pop("rope_parameters")
            legacy["rope_theta"] = rope["rope_theta"]
            legacy["rope_scaling"] = None
            config_path.write_text(json.dumps(legacy, indent=2) + "\n")
        if spec["tokenizer"]:
            _tokenizer(directory)
        # The reference is what transformers computes from the files on disk, in float32.
        reference = _load_hf(directory, torch)
        logits, packed_gap = _hf_logits(reference, inputs, torch)
        inv_freq = reference.model.rotary_emb.inv_freq.numpy()
        entry = {
            "architecture": spec["cls"], "stored_dtype": spec["dtype"],
            "files": sorted(p.name for p in directory.iterdir()),
            "packed_vs_per_document_max_abs": packed_gap,
        }
        routing = {}
        if name in MOE:
            routing, margin = _hf_routing(reference, inputs, torch)
            entry.update(versions=versions, tolerance=MOE_TOLERANCE, router_scale=ROUTER_SCALE,
                         min_topk_router_logit_margin=margin,
                         router_aux_loss_coef=reference.config.router_aux_loss_coef,
                         aux_loss={c: float(routing[f"aux_loss_{c}"]) for c in ("plain", "padded", "packed")})
            if spec.get("fused_copy"):
                again, _ = _hf_logits(_load_hf(FIXTURES / f"{name}_fused", torch), inputs, torch)
                gap = max(float(np.abs(again[k] - logits[k]).max()) for k in logits)
                if gap:
                    raise SystemExit(f"transformers reads {name}_fused differently: {gap}")
                entry["fused_copy"] = {"directory": f"{name}_fused",
                                       "files": sorted(p.name for p in fused.iterdir())}
        np.savez(FIXTURES / "references" / f"{name}.npz", inv_freq=inv_freq,
                 **{f"logits_{k}": v for k, v in logits.items()}, **routing, **inputs)
        manifest["families"][name] = entry
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _max_diff(a, b, mask=None):
    import numpy as np

    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    if mask is not None:
        diff = diff[mask.astype(bool)]
    return float(diff.max())


def check_round_trip(work: Path) -> dict:
    """transformers reloads what Dew saved (float32 and bfloat16) and must match."""
    import numpy as np
    import torch

    inputs = _inputs()
    results = {}
    for name in FAMILIES:
        reference = np.load(FIXTURES / "references" / f"{name}.npz")
        row = {}
        for variant, expected in (
            ("f32", reference),  # Dew's float32 save must reproduce the original logits
            ("bf16", np.load(work / f"{name}-bf16-dew.npz")),  # Dew's own logits, bf16 weights
        ):
            model = _load_hf(work / f"{name}-{variant}", torch)
            logits, _ = _hf_logits(model, inputs, torch)
            row[f"hf_reload_{variant}"] = max(
                _max_diff(logits["plain"], expected["logits_plain"]),
                _max_diff(logits["padded"], expected["logits_padded"], inputs["padded_mask"]),
                _max_diff(logits["packed"], expected["logits_packed"]),
            )
        results[name] = row
    return results


# -- the Dew side (the project's venv; no torch) -------------------------------------------------


def dew_side(work: Path) -> dict:
    """Load each fixture with Dew, compare logits, and save f32 and bf16 copies into `work`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dew_lib.models import load_pretrained

    def logits(model, variables, ref):
        plain = model.apply(variables, jnp.asarray(ref["plain_ids"]))
        padded = model.apply(variables, jnp.asarray(ref["padded_ids"]),
                             jnp.asarray(ref["padded_mask"]), jnp.asarray(ref["padded_positions"]))
        packed = model.apply(variables, jnp.asarray(ref["packed_ids"]),
                             jnp.asarray(ref["packed_segments"]),
                             jnp.asarray(ref["packed_positions"]))
        return {"logits_plain": np.asarray(plain), "logits_padded": np.asarray(padded),
                "logits_packed": np.asarray(packed)}

    def aux_losses(model, variables, ref):  # the MoE block's load-balancing loss, unscaled
        cases = {"plain": (), "padded": (ref["padded_mask"], ref["padded_positions"]),
                 "packed": (ref["packed_segments"], ref["packed_positions"])}
        return {case: float(model.apply(variables, jnp.asarray(ref[f"{case}_ids"]),
                                        *map(jnp.asarray, args), method=model.hidden,
                                        return_routing=True)[1].aux_loss)
                for case, args in cases.items()}

    results = {}
    for name in FAMILIES:
        ref = dict(np.load(FIXTURES / "references" / f"{name}.npz"))
        pretrained, variables = load_pretrained(FIXTURES / name)
        ours = logits(pretrained.model, variables, ref)
        results[name] = {
            "plain": _max_diff(ours["logits_plain"], ref["logits_plain"]),
            "padded": _max_diff(ours["logits_padded"], ref["logits_padded"], ref["padded_mask"]),
            "packed": _max_diff(ours["logits_packed"], ref["logits_packed"]),
        }
        if name in MOE:
            aux = aux_losses(pretrained.model, variables, ref)
            results[name].update({f"aux_{case}": abs(value - float(ref[f"aux_loss_{case}"]))
                                  for case, value in aux.items()})
            fused = FIXTURES / f"{name}_fused"
            if fused.is_dir():  # transformers 5's fused layout loads to the very same variables
                mine, theirs = variables, load_pretrained(fused)[1]
                assert jax.tree.structure(mine) == jax.tree.structure(theirs)
                results[name]["fused_load"] = max(float(np.abs(a - b).max()) for a, b in zip(
                    jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True))
        pretrained.save(variables, work / f"{name}-f32", dtype=jnp.float32, max_shard_size="64KB")
        pretrained.save(variables, work / f"{name}-bf16")
        again, bf16_variables = load_pretrained(work / f"{name}-bf16")
        np.savez(work / f"{name}-bf16-dew.npz", **logits(again.model, bf16_variables, ref))
    return results


# -- driver ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="keep the fixtures; only check")
    parser.add_argument("--side", choices=["driver", "hf", "dew"], default="driver",
                        help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--only", default=",".join(FAMILIES),
                        help="comma-separated fixtures to rebuild (default: all); all are checked")
    args = parser.parse_args()
    only = tuple(args.only.split(","))
    if set(only) - set(FAMILIES):
        parser.error(f"--only takes some of {FAMILIES}")

    if args.side == "dew":
        print(json.dumps(dew_side(args.work)))
        return 0
    if args.side == "driver":
        python = _ensure_venv()
        env = dict(os.environ, DEW_PYTHON=_dew_python())
        argv = [str(python), __file__, "--side", "hf", "--only", args.only]
        return subprocess.run(argv + (["--check"] if args.check else []), env=env).returncode

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not args.check:
        build_fixtures(only)
        print("fixtures written:", ", ".join(only))
    with tempfile.TemporaryDirectory(prefix="dew-parity-") as tmp:
        work = Path(tmp)
        dew = subprocess.run(
            [_dew_python(), __file__, "--side", "dew", "--work", str(work)],
            check=True, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        loaded = json.loads(dew.stdout.strip().splitlines()[-1])
        reloaded = check_round_trip(work)
    failed = False
    print(f"{'family':16} {'dew vs hf: plain':>17} {'padded':>10} {'packed':>10} "
          f"{'hf reload f32':>14} {'hf reload bf16':>15}   aux loss |dew - hf| plain/padded/packed")
    for name in FAMILIES:
        row = {**loaded[name], **reloaded[name]}
        failed |= any(value > (MOE_TOLERANCE if name in MOE else TOLERANCE) for value in row.values())
        aux = "/".join(f"{row[f'aux_{c}']:.1e}" for c in ("plain", "padded", "packed")
                       if f"aux_{c}" in row)
        fused = f"   fused layout: {row['fused_load']:.1e}" if "fused_load" in row else ""
        print(f"{name:16} {row['plain']:17.2e} {row['padded']:10.2e} {row['packed']:10.2e} "
              f"{row['hf_reload_f32']:14.2e} {row['hf_reload_bf16']:15.2e}   {aux}{fused}")
    print("FAILED" if failed else
          f"all within tolerance (dense {TOLERANCE}, MoE {MOE_TOLERANCE} absolute)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
