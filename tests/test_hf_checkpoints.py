"""Hugging Face checkpoints in and out: parity with transformers, round trips, refusals.

The fixtures under tests/fixtures/hf were written by tools/parity_hf.py with torch and
transformers (versions in MANIFEST.json); this file never imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import run_on_host_devices
from hf_fixtures import DELETE, FIXTURES, copy_fixture, edit_config, flat
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from dew_lib import models
from dew_lib.models import rotary
from dew_lib.models.decoder import unstack_layers
from dew_lib.models.pretrained import (
    SUPPORTED,
    CheckpointError,
    Pretrained,
    UnsupportedCheckpoint,
    load_pretrained,
)
from dew_lib.models.pretrained import files as files_module
from dew_lib.models.pretrained.families import decoder_options

FAMILIES = ("qwen3", "qwen2", "llama")
TOLERANCE = 1e-4


def reference(name):
    return dict(np.load(FIXTURES / "references" / f"{name}.npz"))


def logits(model, variables, ref):
    """Dew's logits on the fixture's plain, padded and packed inputs."""
    plain = model.apply(variables, jnp.asarray(ref["plain_ids"]))
    padded = model.apply(variables, jnp.asarray(ref["padded_ids"]),
                         jnp.asarray(ref["padded_mask"]), jnp.asarray(ref["padded_positions"]))
    packed = model.apply(variables, jnp.asarray(ref["packed_ids"]),
                         jnp.asarray(ref["packed_segments"]), jnp.asarray(ref["packed_positions"]))
    return np.asarray(plain), np.asarray(padded), np.asarray(packed)




def rewrite_tensors(directory: Path, edit):
    """Apply `edit(dict)` to the single-file checkpoint in `directory`."""
    path = directory / "model.safetensors"
    tensors = dict(load_file(path))
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def loaded():
    return {name: load_pretrained(FIXTURES / name) for name in FAMILIES}


# -- parity with transformers -------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, loaded):
    pretrained, variables = loaded[name]
    ref = reference(name)
    plain, padded, packed = logits(pretrained.model, variables, ref)
    np.testing.assert_allclose(plain, ref["logits_plain"], rtol=0, atol=TOLERANCE)
    valid = ref["padded_mask"].astype(bool)  # padding positions are never read
    np.testing.assert_allclose(padded[valid], ref["logits_padded"][valid], rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(packed, ref["logits_packed"], rtol=0, atol=TOLERANCE)
    assert np.abs(ref["logits_plain"]).max() > 1.0  # the check is not vacuous


@pytest.mark.parametrize("name", FAMILIES)
def test_rotary_frequencies_match_transformers(name, loaded):
    model = loaded[name].model
    ours = rotary.inverse_frequencies(model.head_features, model.rope_theta,
                                      dict(model.rope_scaling or ()))
    np.testing.assert_array_max_ulp(ours, reference(name)["inv_freq"], maxulp=1)


def test_fixture_features(loaded):
    """Each fixture exercises what its family adds: tying, qk-norm, biases, GQA, llama3 rope."""
    qwen3, qwen2, llama = (loaded[n].model for n in FAMILIES)
    assert qwen3.tie_embeddings and qwen3.qk_norm and qwen3.head_features == 32
    assert qwen3.emb_features // qwen3.num_heads != qwen3.head_features
    assert qwen2.attention_bias and qwen2.kv_heads == 1 and not qwen2.tie_embeddings
    assert dict(llama.rope_scaling)["rope_type"] == "llama3"
    assert (FIXTURES / "qwen2" / files_module.INDEX).is_file()
    with safe_open(FIXTURES / "llama" / "model.safetensors", framework="numpy") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    manifest = json.loads((FIXTURES / "MANIFEST.json").read_text())
    assert manifest["versions"]["transformers"] and manifest["versions"]["torch"]


# -- loading options ----------------------------------------------------------------------------


def test_bf16_load_keeps_stored_values():
    pretrained, variables = load_pretrained(FIXTURES / "llama", dtype="bf16")
    assert pretrained.model.param_dtype == jnp.bfloat16 and pretrained.model.dtype == jnp.bfloat16
    stored = load_file(FIXTURES / "llama" / "model.safetensors")
    q = variables["params"]["layers"]["q_proj"]["kernel"][0]  # layer 0 of the stack
    assert q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(q), stored["model.layers.0.self_attn.q_proj.weight"].T)


def test_compute_dtype_is_separate_from_param_dtype():
    pretrained = Pretrained.from_directory(FIXTURES / "qwen2", dtype="float32",
                                           compute_dtype=jnp.bfloat16)
    assert pretrained.model.param_dtype == jnp.float32 and pretrained.model.dtype == jnp.bfloat16


def test_sharding_options_place_every_leaf():
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    single = jax.sharding.SingleDeviceSharding(device)
    seen = []

    def per_tensor(path, shape):
        seen.append((path, shape))
        return single

    for spec in (single, mesh, per_tensor):
        _, variables = load_pretrained(FIXTURES / "qwen2", sharding=spec, tokenizer=False)
        for leaf in jax.tree_util.tree_leaves(variables):
            assert leaf.sharding.device_set == {device}
    paths = dict(seen)  # layer leaves are placed whole, with their leading layer axis
    assert paths[("layers", "q_proj", "kernel")] == (2, 64, 64)
    assert paths[("layers", "k_proj", "kernel")] == (2, 64, 16)
    assert paths[("norm", "weight")] == (64,)


def test_tensor_parallel_placement_on_two_devices(tmp_path):
    """A per-tensor sharding splits kernels across devices and the logits still match."""
    script = f"""
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from dew_lib.models import load_pretrained
        mesh = Mesh(np.array(jax.devices()), ("model",))
        def layout(path, shape):
            if path[-1] == "kernel" and shape[-1] % 2 == 0:  # split the output features
                return NamedSharding(mesh, P(*[None] * (len(shape) - 1), "model"))
            return NamedSharding(mesh, P())
        pretrained, variables = load_pretrained({str(FIXTURES / "qwen3")!r}, sharding=layout,
                                                tokenizer=False)
        kernel = variables["params"]["layers"]["up_proj"]["kernel"]
        assert len(kernel.sharding.device_set) == 2, kernel.sharding
        assert kernel.addressable_shards[0].data.shape == (2, 64, 64)
        ref = np.load({str(FIXTURES / "references" / "qwen3.npz")!r})
        out = pretrained.model.apply(variables, ref["plain_ids"])
        print(float(np.abs(np.asarray(out) - ref["logits_plain"]).max()))
    """
    assert float(run_on_host_devices(script).strip().splitlines()[-1]) <= TOLERANCE


def test_tokenizer_travels_with_the_model(loaded, tmp_path):
    tokenizer = loaded["qwen3"].tokenizer
    assert tokenizer is not None and loaded["qwen2"].tokenizer is None
    ids = tokenizer.encode("the cat sat on the mat")
    assert len(ids) == 6 and max(ids) < loaded["qwen3"].model.vocab_size
    pretrained, variables = loaded["qwen3"]
    pretrained.save(variables, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    again = load_pretrained(tmp_path / "out")
    assert again.tokenizer.encode("the cat sat on the mat") == ids
    messages = [{"role": "user", "content": "two plus two"}]
    assert again.tokenizer.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert load_pretrained(FIXTURES / "qwen3", tokenizer=False).tokenizer is None


def test_the_same_tokenizer_files_give_one_tokenizer_per_process(loaded, tmp_path):
    """A pipeline's stages each load the policy the stage before saved: the same tokenizer files,
    beside Dew's own records, are built once; a changed tokenizer file is built afresh."""
    pretrained, variables = loaded["qwen3"]
    for name in ("a", "b"):
        pretrained.save(variables, tmp_path / name)
    (tmp_path / "b" / "dew_policy.json").write_text('{"fingerprint": "b"}')
    first = load_pretrained(tmp_path / "a").tokenizer
    assert load_pretrained(tmp_path / "b").tokenizer is first
    config_path = tmp_path / "b" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["model_max_length"] = 77
    config_path.write_text(json.dumps(config))
    changed = load_pretrained(tmp_path / "b").tokenizer
    assert changed is not first and changed.model_max_length == 77 and first.model_max_length != 77


# -- saving -------------------------------------------------------------------------------------


def test_float32_round_trip_is_exact(loaded, tmp_path):
    pretrained, variables = loaded["qwen2"]
    out = pretrained.save(variables, tmp_path / "f32", dtype=jnp.float32)
    again, reread = load_pretrained(out)
    assert flat(reread).keys() == flat(variables).keys()
    for key, value in flat(variables).items():
        np.testing.assert_array_equal(flat(reread)[key], value)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "float32"
    assert (out / "generation_config.json").is_file()
    assert again.model == pretrained.model


def test_default_save_is_bfloat16(loaded, tmp_path):
    pretrained, variables = loaded["qwen3"]
    out = pretrained.save(variables, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    stored = load_file(out / "model.safetensors")
    assert {a.dtype for a in stored.values()} == {np.dtype(ml_dtypes.bfloat16)}
    kernel = np.asarray(variables["params"]["layers"]["down_proj"]["kernel"][1])
    np.testing.assert_array_equal(stored["model.layers.1.mlp.down_proj.weight"],
                                  kernel.T.astype(ml_dtypes.bfloat16))
    assert "lm_head.weight" not in stored  # tied: the embedding is the output projection
    _, reread = load_pretrained(out)
    ref = reference("qwen3")
    # bf16 weights move the logits a little, not a lot.
    diff = np.abs(logits(pretrained.model, reread, ref)[0] - ref["logits_plain"]).max()
    assert 0 < diff < 0.5


def test_sharded_save_writes_an_index(loaded, tmp_path):
    pretrained, variables = loaded["llama"]
    out = pretrained.save(variables, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((out / files_module.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == {t.name for t in pretrained.tensors}
    sizes = [os.path.getsize(out / s) for s in shards]
    assert max(sizes) < 40_000 + 4_096  # the limit plus a safetensors header
    assert index["metadata"]["total_size"] == sum(
        a.nbytes for _, a in pretrained.export(variables))
    for shard in shards:
        with safe_open(out / shard, framework="numpy") as f:
            assert {n for n, s in index["weight_map"].items() if s == shard} == set(f.keys())
    _, reread = load_pretrained(out)
    for key, value in flat(reread).items():
        np.testing.assert_array_equal(value, flat(variables)[key])  # stored bf16 -> bf16 -> f32
    single = pretrained.save(variables, tmp_path / "single", max_shard_size="1GB")
    assert sorted(p.name for p in single.iterdir() if "safetensors" in p.name) == [
        "model.safetensors"]


def test_save_is_atomic(loaded, tmp_path, monkeypatch):
    pretrained, variables = loaded["llama"]
    target = pretrained.save(variables, tmp_path / "ckpt", max_shard_size="40KB")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    doubled = jax.tree_util.tree_map(lambda x: x * 2, variables)
    real_save_file = files_module.save_file
    calls = []

    def failing_save_file(tensors, path, metadata=None):
        calls.append(path)
        # A reader during the write still finds the complete old checkpoint.
        _, during = load_pretrained(target, tokenizer=False)
        np.testing.assert_array_equal(flat(during)["['params']['norm']['weight']"],
                                      flat(variables)["['params']['norm']['weight']"])
        if len(calls) == 2:
            raise OSError("disk full")
        real_save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(files_module, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        pretrained.save(doubled, target, max_shard_size="40KB")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no stage left behind
    monkeypatch.setattr(files_module, "save_file", real_save_file)

    pretrained.save(doubled, target)  # one file now: the old shards and index must be gone
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _, reread = load_pretrained(target)
    np.testing.assert_array_equal(flat(reread)["['params']['norm']['weight']"],
                                  2 * flat(variables)["['params']['norm']['weight']"])
    with pytest.raises(FileExistsError):
        pretrained.save(variables, target, overwrite=False)


def test_export_yields_checkpoint_names_and_layouts(loaded):
    pretrained, variables = loaded["qwen2"]
    exported = list(pretrained.export(variables, dtype=jnp.float32))
    located = files_module.locate(FIXTURES / "qwen2")
    assert [name for name, _ in exported] == [t.name for t in pretrained.tensors]
    assert {name for name, _ in exported} == set(located)
    assert exported[0][0] == "model.embed_tokens.weight" and exported[-1][0] == "lm_head.weight"
    for name, array in exported:
        assert isinstance(array, jax.Array)
        with safe_open(located[name], framework="numpy") as f:
            np.testing.assert_array_equal(np.asarray(array), f.get_tensor(name))
    host = jax.device_get(variables)
    name, array = next(iter(pretrained.export(host)))
    assert isinstance(array, np.ndarray) and array.dtype == ml_dtypes.bfloat16


def test_from_model_writes_a_loadable_checkpoint(tmp_path):
    cases = {
        "Qwen3ForCausalLM": dict(qk_norm=True, tie_embeddings=True, head_dim=8),
        "Qwen2ForCausalLM": dict(attention_bias=True, num_kv_heads=2),
        "LlamaForCausalLM": dict(rope_theta=500_000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    }
    tokens = jnp.arange(10)[None] % 32
    for architecture, extra in cases.items():
        model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1,
                             num_heads=4, mlp_features=24, max_seq_len=32, **extra)
        variables = jax.jit(model.init)(jax.random.key(0), tokens)
        pretrained = Pretrained.from_model(model, config={"eos_token_id": 3})
        assert pretrained.family.architecture == architecture
        out = pretrained.save(variables, tmp_path / architecture, dtype=None)
        config = json.loads((out / "config.json").read_text())
        assert config["eos_token_id"] == 3 and config["dtype"] == "float32"
        again, reread = load_pretrained(out)
        np.testing.assert_array_equal(again.model.apply(reread, tokens),
                                      model.apply(variables, tokens))


def test_legacy_and_current_rope_layouts_agree():
    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    legacy = dict(config, rope_theta=rope.pop("rope_theta"),
                  rope_scaling={"type": rope.pop("rope_type"), **rope})
    assert decoder_options(legacy) == decoder_options(
        json.loads((FIXTURES / "llama" / "config.json").read_text()))
    qwen2 = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
    assert "rope_parameters" not in qwen2 and qwen2["rope_theta"] == 10_000.0  # legacy fixture
    current = {k: v for k, v in qwen2.items() if k not in ("rope_theta", "rope_scaling")}
    current["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000.0}
    assert decoder_options(current) == decoder_options(qwen2)


def test_skippable_tensors_are_skipped(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)

    def add(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)

    rewrite_tensors(directory, add)
    _, variables = load_pretrained(directory, tokenizer=False)
    assert "lm_head" not in variables["params"]


def test_tied_checkpoint_with_a_different_head_is_refused(tmp_path):
    """transformers unties a stored lm_head.weight that differs from the embedding."""
    directory = copy_fixture("qwen3", tmp_path)

    def add(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * 2

    rewrite_tensors(directory, add)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_pretrained(directory, tokenizer=False)


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["MistralForCausalLM"]), "MistralForCausalLM"),
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1, layer_types=DELETE),
     "sliding-window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "yarn"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(num_experts=8), "num_experts"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "o_proj"),
    (dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
    (dict(model_type="llama"), "model_type"),
    (dict(hidden_size=DELETE), "hidden_size"),
])
def test_unsupported_configs_are_refused(tmp_path, changes, message):
    directory = copy_fixture("qwen3", tmp_path)
    edit_config(directory, **changes)
    with pytest.raises(UnsupportedCheckpoint, match=message) as error:
        load_pretrained(directory)
    if "architectures" in changes:
        assert all(name in str(error.value) for name in SUPPORTED)


def test_sliding_window_that_covers_no_layer_is_accepted(loaded, tmp_path):
    """Windows start at layer 2 of 2, so every layer attends fully: the checkpoint loads as the
    plain qwen2 fixture, with the same logits to the bit and transformers' within tolerance."""
    directory = copy_fixture("qwen2", tmp_path)
    edit_config(directory, use_sliding_window=True, sliding_window=4, max_window_layers=2,
                layer_types=DELETE)
    pretrained, variables = load_pretrained(directory)
    plain, plain_variables = loaded["qwen2"]
    assert pretrained.model == plain.model
    ref = reference("qwen2")
    got, want = logits(pretrained.model, variables, ref), logits(plain.model, plain_variables, ref)
    for ours, full_attention in zip(got, want, strict=True):
        np.testing.assert_array_equal(ours, full_attention)
    np.testing.assert_allclose(got[0], ref["logits_plain"], rtol=0, atol=TOLERANCE)


def test_missing_tensor_is_named(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)
    rewrite_tensors(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(directory)


def test_unexpected_tensor_is_named(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)

    def add(tensors):
        tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)

    rewrite_tensors(directory, add)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_pretrained(directory)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)
    edit_config(directory, intermediate_size=96)
    with pytest.raises(CheckpointError) as error:
        load_pretrained(directory)
    text = str(error.value)
    assert "model.layers.0.mlp.gate_proj.weight" in text
    assert "(128, 64)" in text and "(96, 64)" in text


def test_non_float_tensor_is_refused(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)

    def quantize(tensors):
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = tensors[name].astype(np.int8)

    rewrite_tensors(directory, quantize)
    with pytest.raises(CheckpointError, match="down_proj.weight is stored as I8"):
        load_pretrained(directory)


def test_broken_shard_sets_are_refused(tmp_path):
    directory = copy_fixture("qwen2", tmp_path)
    index = json.loads((directory / files_module.INDEX).read_text())
    victim = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00004.safetensors"
    if victim == "model-00001-of-00004.safetensors":
        pytest.fail("fixture layout changed: model.norm.weight sits in the first shard")
    (directory / files_module.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.norm.weight is listed"):
        load_pretrained(directory)
    (directory / victim).unlink()
    with pytest.raises(CheckpointError, match=f"shard {victim}, which is missing"):
        load_pretrained(directory)


def test_directory_without_safetensors_is_refused(tmp_path):
    directory = tmp_path / "bin"
    directory.mkdir()
    shutil.copy(FIXTURES / "qwen3" / "config.json", directory)
    (directory / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="safetensors checkpoints only"):
        load_pretrained(directory)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)


def test_variables_that_do_not_fit_are_refused(loaded, tmp_path):
    pretrained, variables = loaded["qwen2"]
    params = dict(variables["params"])
    params.pop("lm_head")
    with pytest.raises(ValueError, match=r"missing params \['lm_head.kernel'\]"):
        list(pretrained.export({"params": params}))
    wrong = jax.tree_util.tree_map(lambda x: x, variables)
    wrong["params"]["norm"]["weight"] = jnp.ones(3)
    with pytest.raises(ValueError, match=r"norm.weight has shape \(3,\).*\(64,\)"):
        pretrained.save(wrong, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    one_layer = jax.tree_util.tree_map(lambda x: x, variables)
    one_layer["params"]["layers"] = jax.tree_util.tree_map(lambda x: x[:1], params["layers"])
    with pytest.raises(ValueError, match=r"layers.q_proj.kernel has shape \(1, 64, 64\).*\(2, 64, 64\)"):
        list(pretrained.export(one_layer))
    with pytest.raises(ValueError, match="layers_0.*stack_layers"):  # the layout before stacking
        list(pretrained.export(unstack_layers(variables)))
    other = models.build("causal_transformer", vocab_size=128, emb_features=64, num_layers=2,
                         num_heads=4, mlp_features=32, max_seq_len=64, num_kv_heads=1,
                         attention_bias=True)
    with pytest.raises(ValueError, match="mlp_features"):
        Pretrained(other, pretrained.config)
    with pytest.raises(UnsupportedCheckpoint, match="GPT2LMHeadModel"):
        Pretrained.from_model(other, architecture="GPT2LMHeadModel")
