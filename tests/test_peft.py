"""PEFT's LoRA adapter files in and out: parity with PEFT both ways, exact files, merged export,
and refusals of what Dew's LoRA does not reproduce.

The fixtures under tests/fixtures/peft were written by tools/parity_peft.py with torch,
transformers and PEFT (versions in MANIFEST.json): per family a tiny base, an adapter PEFT saved
(`peft/`) and one Dew saved after changing it (`dew/`), and PEFT's logits of both in
references.npz. This file never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on_host_devices
from safetensors import safe_open

from dew_lib.models import load_adapter, load_pretrained, lora, save_adapter
from dew_lib.models.pretrained import CheckpointError, UnsupportedCheckpoint

FIXTURES = Path(__file__).parent / "fixtures" / "peft"
FAMILIES = ("qwen3", "qwen2", "llama")
TOLERANCE = 1e-5  # absolute, float32 logits
# Logits against fixtures recorded from fully optimized programs, to 1e-5 of logits near 1.5: XLA's
# plainer code for tests (conftest) rounds differently by about that much, so this module keeps it.
pytestmark = pytest.mark.optimized
REFERENCES = dict(np.load(FIXTURES / "references.npz"))
IDS = jnp.asarray(REFERENCES["ids"])


def base(family, **options):
    return load_pretrained(FIXTURES / family / "base", tokenizer=False, **options)


def changed(variables):
    """What the generator did to the PEFT adapter before Dew saved it."""
    def change(path, leaf):
        if not lora.is_adapter(path):
            return leaf
        return leaf * 1.5 if path[-1].key == "lora_b" else leaf + 0.01

    return jax.tree_util.tree_map_with_path(change, variables)


def headers(path):
    with safe_open(path, framework="numpy") as f:
        return {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}


def adapters_of(variables):
    return lora.split(variables["params"])[0]


def max_diff(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# -- parity with PEFT ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_peft_adapter_gives_pefts_logits(family):
    pretrained, variables = base(family)
    model, adapted = load_adapter(FIXTURES / family / "peft", pretrained.model, variables)
    logits = model.apply(adapted, IDS)
    assert max_diff(logits, REFERENCES[f"{family}_peft"]) <= TOLERANCE
    assert max_diff(logits, REFERENCES[f"{family}_base"]) > 1.0  # the adapter matters


def test_the_config_becomes_dews_lora():
    assert base_lora("qwen3") == lora.LoRA(rank=4, alpha=8, targets="all-linear")
    assert base_lora("qwen2") == lora.LoRA(rank=4, alpha=8, targets=("q_proj", "v_proj"), rslora=True)
    # PEFT's regex over module names, `.*\.(k_proj|o_proj|gate_proj|down_proj)`, and lora_dropout
    assert base_lora("llama") == lora.LoRA(rank=2, alpha=6, targets=("k_proj", "o_proj", "gate_proj",
                                                                       "down_proj"), dropout=0.05)


def base_lora(family):
    pretrained, variables = base(family)
    return load_adapter(FIXTURES / family / "peft", pretrained.model, variables)[0].lora


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dew_adapter_gives_the_logits_peft_computes_from_it(family):
    pretrained, variables = base(family)
    model, adapted = load_adapter(FIXTURES / family / "dew", pretrained.model, variables)
    assert max_diff(model.apply(adapted, IDS), REFERENCES[f"{family}_dew"]) <= TOLERANCE
    assert max_diff(REFERENCES[f"{family}_dew"], REFERENCES[f"{family}_peft"]) > 1.0  # the change shows


# -- the files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fresh_save_writes_the_committed_files_and_reads_back_bit_for_bit(family, tmp_path):
    pretrained, variables = base(family)
    model, adapted = load_adapter(FIXTURES / family / "peft", pretrained.model, variables)
    adapted = changed(adapted)
    out = save_adapter(tmp_path / "adapter", model, adapted)
    committed = FIXTURES / family / "dew"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert headers(out / "adapter_model.safetensors") == headers(committed / "adapter_model.safetensors")
    assert (out / "adapter_model.safetensors").read_bytes() == (committed / "adapter_model.safetensors").read_bytes()
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (committed / "adapter_config.json").read_text())
    again_model, again = load_adapter(out, pretrained.model, variables)
    assert again_model.lora == model.lora
    jax.tree.map(np.testing.assert_array_equal, adapters_of(again), adapters_of(adapted))


@pytest.mark.parametrize("family", FAMILIES)
def test_dew_writes_pefts_tensor_names_and_config(family):
    peft, dew = FIXTURES / family / "peft", FIXTURES / family / "dew"
    # the safetensors headers (names, dtypes, shapes, order, metadata) are byte for byte PEFT's
    size = int.from_bytes((peft / "adapter_model.safetensors").read_bytes()[:8], "little")
    assert (dew / "adapter_model.safetensors").read_bytes()[:8 + size] == \
        (peft / "adapter_model.safetensors").read_bytes()[:8 + size]
    for name, (dtype, shape) in headers(dew / "adapter_model.safetensors").items():
        assert re.fullmatch(r"base_model\.model\.model\.layers\.[01]\.(self_attn|mlp)\.[a-z]+_proj\.lora_[AB]\.weight",
                            name) and dtype == "F32" and len(shape) == 2
    theirs, ours = (json.loads((d / "adapter_config.json").read_text()) for d in (peft, dew))
    assert sorted(ours) == sorted(theirs)
    # PEFT writes its target set in hash order, or the regex it was given; Dew a sorted list
    differing = {key for key in theirs if ours[key] != theirs[key]}
    assert differing <= {"target_modules"}
    assert ours["target_modules"] == sorted(ours["target_modules"])
    if isinstance(theirs["target_modules"], list):
        assert ours["target_modules"] == sorted(theirs["target_modules"])


def test_save_keeps_the_adapters_dtype_other_files_and_the_base_name(tmp_path):
    pretrained, variables = base("qwen2", dtype=jnp.bfloat16)
    model, adapted = load_adapter(FIXTURES / "qwen2" / "peft", pretrained.model, variables)
    leaves = jax.tree.leaves(adapters_of(adapted))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}  # the base's dtype
    (tmp_path / "README.md").write_text("kept")
    save_adapter(tmp_path, model, adapted["params"], base_model_name_or_path="Qwen/Qwen2.5-0.5B")
    assert (tmp_path / "README.md").read_text() == "kept"
    assert {dtype for dtype, _ in headers(tmp_path / "adapter_model.safetensors").values()} == {"BF16"}
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "Qwen/Qwen2.5-0.5B" and config["use_rslora"] is True
    again = adapters_of(load_adapter(tmp_path, pretrained.model, variables)[1])
    jax.tree.map(np.testing.assert_array_equal, again, adapters_of(adapted))


def test_a_fresh_adapter_saves_too(tmp_path):
    pretrained, variables = base("llama")
    model, adapted = lora.attach(pretrained.model, variables, lora.LoRA(rank=3, alpha=5.5), jax.random.key(0))
    save_adapter(tmp_path, model, adapted)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (3, 5.5, ["q_proj", "v_proj"])
    assert headers(tmp_path / "adapter_model.safetensors")[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == ("F32", [3, 32])


# -- merged export -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_merged_export_equals_the_adapter_applied(family, tmp_path):
    pretrained, variables = base(family)
    model, adapted = load_adapter(FIXTURES / family / "dew", pretrained.model, variables)
    dataclasses.replace(pretrained, model=model).save(adapted, tmp_path / "merged", dtype=None)
    merged = load_pretrained(tmp_path / "merged", tokenizer=False)
    assert merged.model.lora is None
    assert max_diff(merged.model.apply(merged.variables, IDS), model.apply(adapted, IDS)) <= TOLERANCE
    assert max_diff(merged.model.apply(merged.variables, IDS), REFERENCES[f"{family}_dew"]) <= TOLERANCE


# -- refusals ------------------------------------------------------------------------------------


def edited(tmp_path, family="qwen2", **fields):
    """A copy of the family's PEFT adapter with config fields replaced."""
    out = tmp_path / "adapter"
    shutil.copytree(FIXTURES / family / "peft", out)
    path = out / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return out


@pytest.mark.parametrize("fields, message", [
    ({"peft_type": "IA3"}, "peft_type 'IA3'; load_adapter reads LoRA adapters"),
    ({"task_type": "SEQ_CLS"}, "task_type 'SEQ_CLS'; Dew's decoder is a causal LM"),
    ({"target_modules": ["q_proj", "v_proj", "lm_head"]}, r"adapts \['lm_head'\]; Dew adapts the decoder's "
                                                          "projections .* only .never the embedding"),
    ({"target_modules": ["embed_tokens"]}, r"adapts \['model.embed_tokens'\]"),
    ({"target_modules": r"model\.layers\.0\..*(q|v)_proj"}, "adapts different projections in different layers"),
    ({"target_modules": ["c_attn"]}, "selects none of the projections"),
    ({"modules_to_save": ["lm_head"]}, r"sets modules_to_save=\['lm_head'\] \(fully trained copies"),
    ({"bias": "lora_only"}, "sets bias='lora_only' .trained biases"),
    ({"use_dora": True}, r"sets use_dora=True \(DoRA"),
    ({"rank_pattern": {"q_proj": 8}}, "sets rank_pattern=.* .a rank per module"),
    ({"alpha_pattern": {"v_proj": 32}}, "sets alpha_pattern=.* .an alpha per module"),
    ({"layers_to_transform": [0]}, r"sets layers_to_transform=\[0\] \(adapters on some layers only"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4', which also changed the base"),
    ({"r": 0}, "r=0, lora_alpha=8 do not make a LoRA"),
])
def test_refuses_what_dews_lora_does_not_reproduce(tmp_path, fields, message):
    pretrained, variables = base("qwen2")
    with pytest.raises(UnsupportedCheckpoint, match=message) as refused:
        load_adapter(edited(tmp_path, **fields), pretrained.model, variables)
    if "merge" in str(refused.value):
        assert "merge_and_unload" in str(refused.value)  # the way out


def test_refuses_tensors_that_do_not_fit(tmp_path):
    pretrained, variables = base("qwen2")
    with pytest.raises(CheckpointError, match=r"tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight "
                                              r"has shape \[4, 32\] in adapter_model.safetensors, but r=2 on this "
                                              r"base model needs \[2, 32\]"):
        load_adapter(edited(tmp_path, r=2), pretrained.model, variables)
    shutil.rmtree(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match=r"lacks 4 tensor\(s\) that r=4 on q_proj, k_proj, v_proj needs: "
                                              r"\['base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight'"):
        load_adapter(edited(tmp_path, target_modules=["q_proj", "k_proj", "v_proj"]), pretrained.model, variables)
    shutil.rmtree(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match=r"holds 4 tensor\(s\) that adapter_config.json does not account for: "
                                              r"\['base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight'"):
        load_adapter(edited(tmp_path, target_modules=["q_proj"]), pretrained.model, variables)


def test_refuses_an_adapted_model_and_a_missing_directory(tmp_path):
    pretrained, variables = base("qwen2")
    model, adapted = load_adapter(FIXTURES / "qwen2" / "peft", pretrained.model, variables)
    with pytest.raises(ValueError, match="already has adapters; load the PEFT adapter onto the base model"):
        load_adapter(FIXTURES / "qwen2" / "peft", model, adapted)
    with pytest.raises(FileNotFoundError, match="adapter_config.json not found; a PEFT adapter directory holds"):
        load_adapter(tmp_path, pretrained.model, variables)
    with pytest.raises(ValueError, match="save_adapter needs the adapted model"):
        save_adapter(tmp_path, pretrained.model, variables)


def test_adapters_on_a_sharded_base_lie_where_the_trainer_keeps_them():
    script = f"""
        import jax, numpy as np
        from jax.sharding import Mesh
        from dew_lib.models import load_adapter, load_pretrained, partitioning
        mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "fsdp"))
        pretrained, variables = load_pretrained({str(FIXTURES / "qwen3" / "base")!r}, sharding=mesh,
                                                tokenizer=False)
        model, adapted = load_adapter({str(FIXTURES / "qwen3" / "peft")!r}, pretrained.model, variables)
        wanted = partitioning.tree_shardings(adapted, mesh)["params"]["layers"]["down_proj"]
        for name in ("lora_a", "lora_b"):
            leaf = adapted["params"]["layers"]["down_proj"][name]
            assert leaf.sharding == wanted[name] and len(leaf.sharding.device_set) == 2, leaf.sharding
        references = np.load({str(FIXTURES / "references.npz")!r})
        print(float(np.abs(np.asarray(model.apply(adapted, references["ids"])) - references["qwen3_peft"]).max()))
    """
    assert float(run_on_host_devices(script).strip().splitlines()[-1]) <= TOLERANCE
