"""Recipe: SFT -> DPO -> GRPO on one decoder; each stage starts from the last and resumes."""

import json

import jax
import numpy as np
import optax
import pytest

from dew_lib import models
from dew_lib.data import ChatMessages, Loading, PreferencePairs, Prompts, UnpairedExamples
from dew_lib.data.byte_bpe import train_byte_bpe
from dew_lib.recipes import DPOOptions, GRPOOptions, SFTOptions
from dew_lib.recipes.chain import Recipe, Stage

LOADING = Loading(workers=0, threads=1, read_buffer=2)


def stages(tmp_path):
    tokenizer = train_byte_bpe(["What is 1 + 2? 3", "What is 2 + 2? 4"] * 20, vocab_size=300,
                               directory=str(tmp_path / "tokenizer"))
    chats = tmp_path / "chat.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {a} + 2?"},
        {"role": "assistant", "content": str(a + 2)}]}) for a in range(8)))
    prompt = tokenizer.encode("What is 1 + 2?")
    chosen, rejected = tokenizer.encode(" 3"), tokenizer.encode(" 5")
    pair = {"chosen": prompt + chosen, "rejected": prompt + rejected,
            "chosen_mask": [0] * len(prompt) + [1] * len(chosen),
            "rejected_mask": [0] * len(prompt) + [1] * len(rejected)}
    three = str(tokenizer.encode("3")[0])
    return [
        Stage(name="sft", data=ChatMessages(path=str(chats), tokenizer=str(tmp_path / "tokenizer"),
                                            seq_len=24, loading=LOADING),
              options=SFTOptions(steps=2, batch=4, log_every=1)),
        Stage(name="dpo", data=PreferencePairs(records=(json.dumps(pair),) * 4, seq_len=12,
                                               loading=LOADING),
              options=DPOOptions(steps=2, batch=4, beta=0.1, nll_weight=0.0, log_every=1)),
        Stage(name="grpo", data=Prompts(records=(json.dumps({"prompt": prompt}),) * 4,
                                        max_prompt_len=10, loading=LOADING),
              options=GRPOOptions(steps=2, batch=4, groups=2, max_new_tokens=3, beta=0.05, log_every=1),
              reward=lambda source, text, truth, extra: float(three in text.split())),
    ]


@pytest.mark.slow
def test_stages_chain_their_policies_freeze_references_and_resume(tmp_path):
    model = models.build("causal_transformer", vocab_size=300, emb_features=16, num_layers=1,
                         num_heads=2, mlp_features=32, max_seq_len=32)
    recipe = Recipe(model=model, optimizer=optax.adam(1e-3), key=jax.random.key(0),
                    directory=tmp_path / "run", stages=stages(tmp_path))
    sft, dpo, grpo = recipe.run(sinks_for=lambda stage: [])
    assert [int(s.updates) for s in (sft, dpo, grpo)] == [2, 2, 2]
    assert sft.ema is None
    # DPO's and GRPO's references are the policies the previous stages ended with.
    for reference, policy in ((dpo.ema, sft.params), (grpo.ema, dpo.params)):
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(policy), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    for stage in ("sft", "dpo", "grpo"):
        assert (tmp_path / "run" / stage / "2").is_dir()
    # A rerun restores every finished stage instead of training it again.
    again = recipe.run(sinks_for=lambda stage: [])
    for first, second in zip((sft, dpo, grpo), again, strict=True):
        assert int(second.step) == 2
        for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_kto_stage_trains_unpaired_examples_from_the_previous_stage_s_policy(tmp_path):
    model = models.build("causal_transformer", vocab_size=16, emb_features=16, num_layers=1,
                         num_heads=2, mlp_features=32, max_seq_len=16)
    chats = (json.dumps({"prompt": [1, 2], "completion": [3 + n % 4, 9], "label": n % 2 == 0}) for n in range(8))
    pairs = (json.dumps({"chosen": [1, 2, 3], "rejected": [1, 2, 4], "chosen_mask": [0, 0, 1],
                         "rejected_mask": [0, 0, 1]}),) * 4
    kto = DPOOptions(steps=2, batch=4, loss_type="kto", beta=0.1, nll_weight=0.0, log_every=1)
    recipe = Recipe(model=model, optimizer=optax.adam(1e-2), key=jax.random.key(0), directory=tmp_path / "run",
                    stages=[Stage(name="dpo", data=PreferencePairs(records=pairs, seq_len=6, loading=LOADING),
                                  options=DPOOptions(steps=2, batch=4, beta=0.1, nll_weight=0.0)),
                            Stage(name="kto", data=UnpairedExamples(records=tuple(chats), seq_len=6, loading=LOADING),
                                  options=kto)])
    dpo, trained = recipe.run(sinks_for=lambda stage: [])
    assert int(trained.updates) == 2
    for reference, policy in zip(jax.tree.leaves(trained.ema), jax.tree.leaves(dpo.params), strict=True):
        np.testing.assert_allclose(np.asarray(reference), np.asarray(policy), atol=1e-6)  # KTO's reference
    with pytest.raises(ValueError, match="only DPOOptions.loss_type='kto' reads; got loss_type='sigmoid'"):
        Stage(name="kto", data=UnpairedExamples(records=("{}",), seq_len=6), options=DPOOptions(nll_weight=0.0))


def test_stage_and_recipe_refuse_bad_settings(tmp_path):
    spec = Prompts(records=(json.dumps({"prompt": [1, 2]}),), max_prompt_len=4, loading=LOADING)
    grpo = GRPOOptions(steps=1, batch=1)
    with pytest.raises(ValueError, match="needs a reward"):
        Stage(name="grpo", data=spec, options=grpo)
    with pytest.raises(TypeError, match="must be ChatMessages"):
        Stage(name="x", data={"records": []}, options=grpo)
    with pytest.raises(ValueError, match="plain directory name"):
        Stage(name="a/b", data=spec, options=grpo, reward=lambda *a: 0.0)
    with pytest.raises(TypeError, match="trains GRPO on Prompts, so its options are GRPOOptions, got DPOOptions"):
        Stage(name="g", data=spec, options=DPOOptions(steps=1), reward=lambda *a: 0.0)
    stage = Stage(name="g", data=spec, options=grpo, reward=lambda *a: 0.0)
    with pytest.raises(ValueError, match="must be distinct"):
        Recipe(model=None, optimizer=optax.sgd(0.1), key=jax.random.key(0), directory=tmp_path,
               stages=[stage, stage])


@pytest.mark.slow
def test_stages_with_lora_train_adapters_on_their_start_and_hand_on_the_folded_policy(tmp_path):
    """SFT trains every weight; DPO and GRPO train rank-2 adapters: DPO's reference is its start
    with the adapters off (no copy), and GRPO starts from DPO's policy with its adapters folded in."""
    from dew_lib.models import lora
    from dew_lib.recipes import LoRAOptions

    model = models.build("causal_transformer", vocab_size=300, emb_features=16, num_layers=1,
                         num_heads=2, mlp_features=32, max_seq_len=32)
    adapters = LoRAOptions(rank=2, alpha=4, targets="all-linear")
    sft_stage, dpo_stage, grpo_stage = stages(tmp_path)
    chained = [sft_stage, dpo_stage.__class__(name="dpo", data=dpo_stage.data,
                                              options=dpo_stage.options.model_copy(update={"lora": adapters})),
               grpo_stage.__class__(name="grpo", data=grpo_stage.data, reward=grpo_stage.reward,
                                    options=grpo_stage.options.model_copy(update={"lora": adapters}))]
    recipe = Recipe(model=model, key=jax.random.key(0), directory=tmp_path / "run", stages=chained)
    sft, dpo, grpo = recipe.run(sinks_for=lambda stage: [])
    assert dpo.ema is None and grpo.ema is None  # the references are the bases, adapters off
    moved, dpo_base = lora.split(dpo.params)
    assert jax.tree.leaves(moved) and jax.tree.leaves(lora.split(grpo.params)[0])
    for a, b in zip(jax.tree.leaves(dpo_base), jax.tree.leaves(sft.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # frozen: bit for bit the SFT policy
    folded = lora.merged(model.clone(lora=adapters.config()), dpo.params)[1]
    for a, b in zip(jax.tree.leaves(lora.split(grpo.params)[1]), jax.tree.leaves(folded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # GRPO starts from DPO, folded
    dpo_q = dpo.params["params"]["layers"]["q_proj"]
    assert not np.allclose(folded["params"]["layers"]["q_proj"]["kernel"], dpo_q["kernel"])  # B moved


def test_lora_options_are_off_by_default_name_their_field_and_need_a_start():
    from dew_lib.recipes import LoRAOptions

    assert SFTOptions().lora == LoRAOptions() and LoRAOptions().config() is None
    model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1,
                         num_heads=2, mlp_features=32, max_seq_len=16)
    assert LoRAOptions().attach(model, None, jax.random.key(0)) == (model, None)  # rank 0: as given
    with pytest.raises(ValueError, match="lora: LoRA.targets must name projections among"):
        DPOOptions(lora=dict(rank=4, targets=("lm_head",)))
    with pytest.raises(ValueError, match="lora.rank is set but the stage has no starting weights"):
        LoRAOptions(rank=4).attach(model, None, jax.random.key(0))
