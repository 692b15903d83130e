"""The pipeline's `distill` stage: a student checkpoint distilled through the Prefect flow from a
teacher checkpoint, and from the same teacher served by `dew serve` on 127.0.0.1, and with lmbda=0.5
on the SFT conversations' answers, its sessions and metrics checked through the run store; and its
options' refusals and keys, which need no flow."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from dew_lib import models
from dew_lib.models import Pretrained, load_pretrained
from dew_lib.recipes import DistillOptions, build_distill
from dew_lib.recipes.build import load_teacher

pytest.importorskip("prefect")

from conftest import run_log  # noqa: E402
from test_pipeline import TINY, query, tiny  # noqa: E402

from tasks.params import DistillParams, PipelineParams  # noqa: E402

SMALL = dict(num_heads=2, mlp_features=32, max_seq_len=64)


def save_decoder(directory, vocab_size: int, emb_features: int, num_layers: int, tokenizer=None, seed: int = 0) -> str:
    """A fresh embedded decoder saved as a Hugging Face checkpoint; its directory."""
    model = models.build("causal_transformer", vocab_size=vocab_size, emb_features=emb_features,
                         num_layers=num_layers, **SMALL)
    variables = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
    Pretrained.from_model(model, tokenizer=tokenizer).save(variables, str(directory), dtype=None)
    return str(directory)


# ----- the options' refusals (fast) --------------------------------------------------------------

def test_the_distill_stage_needs_a_teacher_and_names_the_field(tmp_path):
    with pytest.raises(ValidationError, match="both distill.teacher and distill.teacher_url are empty"):
        PipelineParams(root=str(tmp_path), stages=["distill"])
    with pytest.raises(ValidationError, match="distill.teacher=.*not a Hugging Face checkpoint"):
        DistillParams(teacher=str(tmp_path))
    PipelineParams(root=str(tmp_path), stages=["sft", "grpo"])  # no distill stage, no teacher needed


URL = "http://127.0.0.1:8000/v1"


def test_a_teacher_is_a_checkpoint_or_an_engine_never_both(tmp_path):
    teacher = save_decoder(tmp_path / "teacher", vocab_size=40, emb_features=16, num_layers=1)
    served = dict(teacher_url=URL, teacher_model="teacher", loss="reverse_kl")
    with pytest.raises(ValidationError, match=r"teacher=.* and teacher_url=.* are both set.*clear one of teacher "
                                              "and teacher_url"):
        DistillParams(teacher=teacher, **served)
    with pytest.raises(ValidationError, match="teacher_url is set and teacher_model is empty"):
        DistillOptions(teacher_url=URL, loss="reverse_kl")
    with pytest.raises(ValidationError, match="teacher_model is set and teacher_url is empty"):
        DistillOptions(teacher_model="teacher")
    with pytest.raises(ValidationError, match="teacher_url='127.0.0.1:8000' is not an http"):
        DistillOptions(teacher_url="127.0.0.1:8000", teacher_model="teacher", loss="reverse_kl")
    # The engine reports the log-prob of each sampled id only: the JSD, and a loss temperature, are refused.
    with pytest.raises(ValidationError, match="teacher_url serves the teacher.*loss='jsd'.*set loss='reverse_kl'"):
        DistillParams(teacher_url=URL, teacher_model="teacher")
    with pytest.raises(ValidationError, match="teacher_url serves .* temperature=0.5 .* set temperature=1.0"):
        DistillParams(temperature=0.5, **served)
    options = DistillParams(teacher_url=URL + "/", teacher_model="teacher", loss="reverse_kl", sampling_temperature=0.7)
    assert options.remote and options.teacher_url == URL and not DistillOptions(teacher=teacher).remote
    PipelineParams(root=str(tmp_path), stages=["distill"], distill=served)  # a served teacher is a teacher
    # The library's builder asks for a served teacher by name; load_teacher has no checkpoint to load.
    with pytest.raises(ValueError, match=f"teacher_url='{URL}' is served: build it with remote_teacher"):
        load_teacher(DistillOptions(**served), None)


def test_reverse_kl_trains_on_the_student_s_own_samples_only(tmp_path):
    with pytest.raises(ValidationError, match="loss='reverse_kl' is a policy gradient"):
        DistillOptions(loss="reverse_kl", lmbda=0.5)
    with pytest.raises(ValidationError, match="loss='reverse_kl' is a policy gradient"):
        DistillParams(loss="reverse_kl", lmbda=0.5)
    assert DistillParams(lmbda=0.5).lmbda == 0.5  # the pipeline takes the mix: its completions are SFT's answers
    with pytest.raises(ValidationError, match="beta"):
        DistillOptions(beta=1.5)
    # The library's builder refuses the mix on prompts without a completion column.
    with pytest.raises(ValueError, match=r"lmbda=0.5.*Prompts.completion is empty"):
        build_distill(None, None, None, DistillOptions(lmbda=0.5))
    assert DistillOptions(loss="reverse_kl").lmbda == 1.0


def test_a_teacher_of_another_vocabulary_is_refused_with_both_sizes(tmp_path):
    teacher = save_decoder(tmp_path / "teacher", vocab_size=40, emb_features=16, num_layers=1)
    student = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1, **SMALL)
    with pytest.raises(ValueError, match=r"DistillOptions.teacher=.* has vocab_size 40 and the student 32"):
        load_teacher(DistillOptions(teacher=teacher), student)
    with pytest.raises(ValueError, match="DistillOptions.teacher is empty"):
        load_teacher(DistillOptions(), student)
    same = models.build("causal_transformer", vocab_size=40, emb_features=8, num_layers=1, **SMALL)
    model, variables = load_teacher(DistillOptions(teacher=teacher), same)
    assert model.vocab_size == 40 and model.emb_features == 16 and "params" in variables
    # Of one size, but other ids: the tokenizers both sides read are compared too.
    from dew_lib.data.byte_bpe import train_byte_bpe

    ours = train_byte_bpe(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=266)
    theirs = train_byte_bpe(["pack my box with five dozen liquor jugs"] * 20, vocab_size=266)
    assert len(ours) == len(theirs)
    taught = save_decoder(tmp_path / "taught", vocab_size=len(theirs), emb_features=16, num_layers=1, tokenizer=theirs)
    student = models.build("causal_transformer", vocab_size=len(ours), emb_features=8, num_layers=1, **SMALL)
    with pytest.raises(ValueError, match="ships a tokenizer whose token ids differ from the student's"):
        load_teacher(DistillOptions(teacher=taught), student, tokenizer=ours)
    load_teacher(DistillOptions(teacher=taught), student, tokenizer=theirs)


def test_the_stage_s_key_reads_the_teacher_checkpoint(tmp_path):
    from tasks.manifests import DataManifest, PolicyRef
    from tasks.stage_run import stage_inputs

    teacher = save_decoder(tmp_path / "teacher", vocab_size=40, emb_features=16, num_layers=1)
    data = DataManifest(directory=str(tmp_path), tokenizer=None, chat_path=None, chat_val_path=None,
                        pairs_path=None, prompts_path=None, eval_path=str(tmp_path), fingerprint="data")
    start = PolicyRef(path=teacher, fingerprint="start")
    params = DistillParams(teacher=teacher)
    key, inputs = stage_inputs("distill", params, data, start, 0)
    assert set(inputs) == {"params", "data", "start", "seed", "teacher"}
    # The served teacher's fields, and where the student draws while it draws in process, are not
    # in a checkpoint teacher's key (earlier keys hold).
    assert not {"teacher_url", "teacher_model", "rollout"} & set(inputs["params"])
    os.utime(os.path.join(teacher, "model.safetensors"), (1, 1))  # the teacher rewritten in place
    assert stage_inputs("distill", params, data, start, 0)[0] != key
    # A served teacher is keyed by where it is served and under which name.
    served = DistillParams(teacher_url=URL, teacher_model="teacher", loss="reverse_kl")
    key, inputs = stage_inputs("distill", served, data, start, 0)
    assert inputs["teacher"] == {"url": URL, "model": "teacher"}
    other_model = served.model_copy(update={"teacher_model": "bigger"})
    other_url = served.model_copy(update={"teacher_url": "http://127.0.0.1:8001/v1"})
    keys = {key, stage_inputs("distill", other_model, data, start, 0)[0],
            stage_inputs("distill", other_url, data, start, 0)[0]}
    assert len(keys) == 3


def test_the_stage_s_key_reads_lmbda_and_the_mix_refuses_data_without_conversations(tmp_path):
    from tasks.manifests import DataManifest, PolicyRef
    from tasks.refusals import RunRefused
    from tasks.stage_run import _build_distill, stage_inputs

    teacher = save_decoder(tmp_path / "teacher", vocab_size=40, emb_features=16, num_layers=1)
    data = DataManifest(directory=str(tmp_path), tokenizer=None, chat_path=None, chat_val_path=None,
                        pairs_path=None, prompts_path=str(tmp_path), eval_path=str(tmp_path), fingerprint="data")
    start = PolicyRef(path=teacher, fingerprint="start")
    keys = {lmbda: stage_inputs("distill", DistillParams(teacher=teacher, lmbda=lmbda), data, start, 0)
            for lmbda in (1.0, 0.5, 0.25)}
    assert len({key for key, _ in keys.values()}) == 3 and keys[0.5][1]["params"]["lmbda"] == 0.5
    # The mix reads the SFT conversations (chat_path), part of the data's fingerprint.
    other = data.model_copy(update={"fingerprint": "other conversations"})
    assert stage_inputs("distill", DistillParams(teacher=teacher, lmbda=0.5), other, start, 0)[0] != keys[0.5][0]
    with pytest.raises(RunRefused, match=r"the distill stage needs conversations \(chat_path\) for lmbda < 1"):
        _build_distill(DistillParams(teacher=teacher, lmbda=0.5), load_pretrained(teacher), None, data, teacher, 0,
                       None)


# ----- the stage in the pipeline (slow) ----------------------------------------------------------

@pytest.fixture(scope="module")
def harness(prefect_harness):
    yield


@pytest.fixture(scope="module")
def taught(harness, tmp_path_factory):
    """The teacher: the pipeline's SFT stage on a decoder twice the student's width and depth."""
    from flows.pipeline import pipeline

    bigger = dict(TINY["model"], emb_features=64, num_layers=2, mlp_features=128)
    return pipeline(tiny(tmp_path_factory.mktemp("teacher"), name="teacher", model=bigger, stages=["sft"],
                         sft=dict(TINY["sft"], steps=12, batch=8, learning_rate=1e-2, log_every=4,
                                  checkpoint_every=12),
                         evaluation=dict(TINY["evaluation"], samples=0)))["policy"]


def check_sessions(root, run: str, steps: int, batch: int) -> dict[int, float]:
    """Every sampled session landed, with reward = its negative mean per-token KL: weighted by
    length, each update's rewards give back the step's logged kl. Returns the kl by step."""
    sessions = query(root, f"SELECT s.update, s.reward, len(c.sampled_ids) FROM sessions s JOIN calls c "
                           f"ON c.run = s.run AND c.session_uid = s.session_uid "
                           f"WHERE s.run = '{run}' AND s.stage = 'distill'")
    assert len(sessions) == steps * batch and all(n > 0 for _, _, n in sessions)
    kl = dict(query(root, f"SELECT step, value FROM metrics WHERE run = '{run}' AND stage = 'distill' "
                          "AND name = 'kl' ORDER BY step"))
    assert sorted(kl) == list(range(1, steps + 1))
    for update in range(steps):
        rows = [(reward, n) for u, reward, n in sessions if u == update]
        weighted = -sum(reward * n for reward, n in rows) / sum(n for _, n in rows)
        assert weighted == pytest.approx(kl[update + 1], rel=1e-3, abs=1e-4)
    return kl


@pytest.mark.slow
def test_the_pipeline_distils_a_teacher_into_a_student_and_records_it(taught, tmp_path):
    from flows.pipeline import pipeline

    teacher = taught
    # The student: a fresh tiny decoder with the teacher's tokenizer, saved as a checkpoint.
    tokenizer = load_pretrained(teacher).tokenizer
    student = save_decoder(tmp_path / "student", vocab_size=len(tokenizer), emb_features=32, num_layers=1,
                           tokenizer=tokenizer, seed=1)
    steps, batch, budget = 8, 4, 8
    params = tiny(tmp_path, name="distil", model=dict(pretrained=student), stages=["distill"],
                  distill=dict(teacher=teacher, steps=steps, batch=batch, max_new_tokens=budget, learning_rate=1e-2,
                               log_every=1, checkpoint_every=4, device_memory="h200"),  # planned for an H200 first
                  evaluation=dict(TINY["evaluation"], samples=0))
    with run_log() as lines:
        outcome = pipeline(params)
    run = outcome["run"]
    assert list(outcome["accuracy"]) == ["start", "distill"]
    stages = dict(query(tmp_path, f"SELECT stage, kind || ':' || status FROM stages WHERE run = '{run}'"))
    assert stages["distill"] == "distill:completed" and stages["eval-distill"].endswith(":completed")
    kl = check_sessions(tmp_path, run, steps, batch)
    # The student moved towards the teacher: its KL on its own samples fell.
    values = [kl[step] for step in sorted(kl)]
    assert np.mean(values[-3:]) < 0.7 * np.mean(values[:2]), values
    names = {name for (name,) in query(tmp_path, f"SELECT DISTINCT name FROM metrics WHERE run = '{run}' "
                                                 "AND stage = 'distill'")}
    assert {"loss", "kl", "entropy", "on_policy"} <= names
    assert load_pretrained(outcome["policy"]).model.emb_features == 32  # the student, trained
    # The update was planned before it trained: the prompts and the budget, a row per prompt.
    plan = next(line for line in lines if line.startswith("distill fits: "))
    assert f"distill: {batch} rows of {24 + budget} ids a step" in plan
    # A rerun with the same inputs (the teacher's files included) reuses the finished stage.
    again = pipeline(params)
    assert again["run"] == run and again["reused"]["distill"]
    assert again["accuracy"] == outcome["accuracy"]


@pytest.mark.slow
def test_the_pipeline_distils_a_teacher_served_by_dew_serve(taught, tmp_path):
    from dew_lib.serve import ServedPolicy, create_app, running
    from flows.pipeline import pipeline

    tokenizer = load_pretrained(taught).tokenizer
    student = save_decoder(tmp_path / "student", vocab_size=len(tokenizer), emb_features=32, num_layers=1,
                           tokenizer=tokenizer, seed=1)
    steps, batch, budget = 4, 4, 8
    # What `dew serve <teacher> --capacity 64 --served-model-name teacher` serves, in a thread.
    policy = ServedPolicy.load(taught, slots=4, capacity=64, steps=4, served_model_name="teacher")
    try:
        with running(create_app(policy)) as url:
            served = dict(teacher_url=f"{url}/v1", teacher_model="teacher", loss="reverse_kl")
            params = tiny(tmp_path, name="served", model=dict(pretrained=student), stages=["distill"],
                          distill=dict(served, steps=steps, batch=batch, max_new_tokens=budget, learning_rate=1e-2,
                                       log_every=1, checkpoint_every=steps, device_memory="h200"),
                          evaluation=dict(TINY["evaluation"], samples=0))
            with run_log() as lines:
                outcome = pipeline(params)
    finally:
        policy.close()
    run = outcome["run"]
    stages = dict(query(tmp_path, f"SELECT stage, kind || ':' || status FROM stages WHERE run = '{run}'"))
    assert stages["distill"] == "distill:completed" and stages["eval-distill"].endswith(":completed")
    kl = check_sessions(tmp_path, run, steps, batch)
    assert all(np.isfinite(value) for value in kl.values())
    names = {name for (name,) in query(tmp_path, f"SELECT DISTINCT name FROM metrics WHERE run = '{run}' "
                                                 "AND stage = 'distill'")}
    assert {"loss", "kl", "on_policy"} <= names and "entropy" not in names  # reverse_kl reports no entropy
    # Which teacher: the stage's inputs (its key) and its row in the store name the engine and the model.
    inputs = json.loads(open(os.path.join(os.path.dirname(outcome["policy"]), "inputs.json")).read())["inputs"]
    assert inputs["teacher"] == {"url": f"{url}/v1", "model": "teacher"}
    assert inputs["params"]["teacher_url"] == f"{url}/v1" and inputs["params"]["teacher"] is None
    (recorded,) = query(tmp_path, f"SELECT params FROM stages WHERE run = '{run}' AND stage = 'distill'")[0]
    recorded = json.loads(recorded)
    assert (recorded["teacher_url"], recorded["teacher_model"], recorded["teacher"]) == (f"{url}/v1", "teacher", None)
    assert load_pretrained(outcome["policy"]).model.emb_features == 32  # the student, trained
    # Planned before it trained, with the engine's log-probs in the batch and no teacher held in process.
    plan = next(line for line in lines if line.startswith("distill fits: "))
    assert f"distill: {batch} rows of {24 + budget} ids a step" in plan and re.search(r"reference +0.00 GB", plan)


@pytest.mark.slow
def test_the_student_draws_on_dew_serve_pushed_its_weights_every_step(taught, tmp_path):
    """`distill.rollout.server` set to a `dew serve` URL launched on the student's checkpoint: the
    stage pushes the student's weights before each step's draws and records what the engine drew,
    each call with the update it was pushed."""
    import shutil

    from dew_lib.serve import ServedPolicy, create_app, running
    from flows.pipeline import pipeline

    tokenizer = load_pretrained(taught).tokenizer
    student = save_decoder(tmp_path / "student", vocab_size=len(tokenizer), emb_features=32, num_layers=1,
                           tokenizer=tokenizer, seed=1)
    launch = tmp_path / "engine"
    shutil.copytree(student, launch)
    steps, batch, budget = 3, 4, 8
    policy = ServedPolicy.load(launch, slots=4, capacity=64, steps=4)
    try:
        with running(create_app(policy, dev_endpoints=True)) as url:
            params = tiny(tmp_path, name="drawn", model=dict(pretrained=student), stages=["distill"],
                          distill=dict(teacher=taught, rollout={"server": url, "directory": str(launch)},
                                       steps=steps, batch=batch, max_new_tokens=budget, learning_rate=1e-2,
                                       log_every=1, checkpoint_every=steps),
                          evaluation=dict(TINY["evaluation"], samples=0))
            outcome = pipeline(params)
            assert policy.weight_version == str(steps - 1)  # pushed before each step's draws
    finally:
        policy.close()
    run = outcome["run"]
    check_sessions(tmp_path, run, steps, batch)
    versions = query(tmp_path, f"SELECT s.update, list(DISTINCT c.version) FROM sessions s JOIN calls c "
                               f"ON c.run = s.run AND c.session_uid = s.session_uid WHERE s.run = '{run}' "
                               "GROUP BY s.update ORDER BY s.update")
    assert versions == [(update, [update]) for update in range(steps)]
    # Where the engine runs is not part of the stage's inputs; that it draws remotely is.
    inputs = json.loads(open(os.path.join(os.path.dirname(outcome["policy"]), "inputs.json")).read())["inputs"]
    assert inputs["params"]["rollout"]["server"] == "remote" and inputs["params"]["rollout"]["directory"] is None


@pytest.mark.slow
def test_the_pipeline_mixes_the_sft_answers_in_below_lmbda_one(taught, tmp_path):
    """lmbda=0.5: the stage reads the SFT conversations, trains some steps on the student's samples
    (recorded as sessions) and the others on the conversations' last answers (not recorded)."""
    from flows.pipeline import pipeline

    tokenizer = load_pretrained(taught).tokenizer
    student = save_decoder(tmp_path / "student", vocab_size=len(tokenizer), emb_features=32, num_layers=1,
                           tokenizer=tokenizer, seed=1)
    steps, batch = 6, 4
    params = tiny(tmp_path, name="mixed", model=dict(pretrained=student), stages=["distill"],
                  distill=dict(teacher=taught, lmbda=0.5, steps=steps, batch=batch, max_new_tokens=16,
                               learning_rate=1e-2, log_every=1, checkpoint_every=steps),
                  evaluation=dict(TINY["evaluation"], samples=0))
    outcome = pipeline(params)
    run = outcome["run"]
    stages = dict(query(tmp_path, f"SELECT stage, kind || ':' || status FROM stages WHERE run = '{run}'"))
    assert stages["distill"] == "distill:completed" and stages["eval-distill"].endswith(":completed")
    on_policy = dict(query(tmp_path, f"SELECT step, value FROM metrics WHERE run = '{run}' AND stage = 'distill' "
                                     "AND name = 'on_policy' ORDER BY step"))
    assert sorted(on_policy) == list(range(1, steps + 1)) and set(on_policy.values()) == {0.0, 1.0}, on_policy
    # Only the steps the student sampled hold sessions, one per prompt.
    updates = query(tmp_path, f"SELECT update, count(*) FROM sessions WHERE run = '{run}' AND stage = 'distill' "
                              "GROUP BY update ORDER BY update")
    assert updates == [(step - 1, batch) for step, value in sorted(on_policy.items()) if value == 1.0]
    losses = query(tmp_path, f"SELECT value FROM metrics WHERE run = '{run}' AND stage = 'distill' AND name = 'loss'")
    assert len(losses) == steps and all(np.isfinite(value) for (value,) in losses)
    inputs = json.loads(open(os.path.join(os.path.dirname(outcome["policy"]), "inputs.json")).read())["inputs"]
    assert inputs["params"]["lmbda"] == 0.5
