"""The image flows: flow-matching pre-training then Flow-GRPO, under Prefect's test harness.

One tiny pipeline run (a 1-layer width-8 DiT, a few steps per stage) is shared by the slow
tests; its Flow-GRPO task fails once after its step-1 checkpoint, so the same run also shows a
retry that resumes. Everything is checked as a user would see it: the run store, the files in
the stage directories and the Prefect artifacts.
"""

import base64
import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("prefect")

from pydantic import ValidationError  # noqa: E402

from dew_lib.store import Store  # noqa: E402
from tasks.params import FlowGRPOParams, FlowPipelineParams, ImageDataParams  # noqa: E402

TINY = dict(
    data=dict(count=64),
    model=dict(emb_features=8, num_layers=1, num_heads=2),
    pretrain=dict(steps=4, batch=16, log_every=2, checkpoint_every=2, preview_rows=4, preview_steps=3),
    grpo=dict(steps=3, batch=2, groups=2, log_every=1, checkpoint_every=1, rollout_steps=3,
              preview_rows=4, preview_steps=3),
)
PNG = b"\x89PNG\r\n\x1a\n"


def tiny(root, **changes) -> FlowPipelineParams:
    return FlowPipelineParams(root=str(root), **{**TINY, **changes})


def query(root, sql):
    return Store(str(root)).rows(sql)[1]


@pytest.fixture(scope="module")
def finished(prefect_harness, tmp_path_factory):
    """The pipeline, with flow_grpo's first attempt failing after its step-1 checkpoint."""
    from dew_lib.train import trainer
    from flows.flow_grpo import flow_grpo_pipeline
    from tasks import ui

    starts, failed = [], []
    original_start, original_write = trainer._Run._start_state, ui.Deadline.write

    def recording_start(self, state):
        started = original_start(self, state)  # (state, position, ...)
        starts.append((self.trainer.objective.__class__.__name__, started[1]))
        return started

    def failing_write(self, step, metrics):
        original_write(self, step, metrics)
        if self.stage == "flow_grpo" and step == 2 and not failed:
            failed.append(step)
            raise RuntimeError("injected failure before the step-2 checkpoint")

    root = tmp_path_factory.mktemp("runs")
    params = tiny(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer._Run, "_start_state", recording_start)
        patch.setattr(ui.Deadline, "write", failing_write)
        outcome = flow_grpo_pipeline(params)
    return root, params, outcome, starts, failed


@pytest.mark.slow
def test_both_stages_train_and_record_every_sample_with_its_group_statistics(finished):
    root, params, outcome, _, _ = finished
    run = outcome["run"]
    stages = dict(query(root, f"SELECT stage, status FROM stages WHERE run = '{run}'"))
    assert stages == {"flow_pretrain": "completed", "flow_grpo": "completed"}
    steps = dict(query(root, f"SELECT stage, max(step) FROM metrics WHERE run = '{run}' GROUP BY stage"))
    assert steps == {"flow_pretrain": 4, "flow_grpo": 3}
    # One row per sample: 3 updates x 2 groups x 2 samples, each update recorded once.
    rows = query(root, f"SELECT update, count(*), count(DISTINCT row) FROM samples WHERE run = '{run}' "
                       "GROUP BY update ORDER BY update")
    assert rows == [(0, 4, 4), (1, 4, 4), (2, 4, 4)]
    # Group statistics are those of the stored float64 rewards (population std, epsilon 1e-4).
    stats = query(root, f"SELECT update, group_id, avg(reward), stddev_pop(reward), any_value(group_mean), "
                        f"any_value(group_std) FROM samples WHERE run = '{run}' GROUP BY update, group_id")
    assert len(stats) == 6
    for _, _, mean, std, stored_mean, stored_std in stats:
        assert stored_mean == pytest.approx(mean, abs=1e-12) and stored_std == pytest.approx(std, abs=1e-12)
    samples = query(root, f"SELECT reward, group_mean, group_std, advantage, kept, image FROM samples "
                          f"WHERE run = '{run}'")
    for reward, mean, std, advantage, kept, image in samples:
        assert advantage == pytest.approx((reward - mean) / (std + 1e-4), rel=1e-5, abs=1e-6)
        assert kept == (advantage != 0) and image.startswith(PNG)
    # The rollout reward is the mean of the stored rewards of its update.
    logged = dict(query(root, f"SELECT step, value FROM metrics WHERE run = '{run}' AND stage = 'flow_grpo' "
                              "AND name = 'reward'"))
    by_update = dict(query(root, f"SELECT update + 1, avg(reward) FROM samples WHERE run = '{run}' GROUP BY update"))
    assert logged.keys() == by_update.keys() == {1, 2, 3}
    for step in logged:
        assert logged[step] == pytest.approx(by_update[step], abs=1e-6)


@pytest.mark.slow
def test_the_saved_models_load_back_and_sample(finished):
    from dew_lib.diffusion import DiffusionObjective, Field, InputSpec
    from tasks.images import load_dit

    root, _, outcome, _, _ = finished
    model, variables, shape, process = load_dit(outcome["model"])
    assert shape == (8, 8, 3) and model.num_layers == 1 and process.prediction == "velocity"
    config = json.load(open(os.path.join(outcome["model"], "config.json")))
    assert config["emb_features"] == 8 and config["image_shape"] == [8, 8, 3]
    objective = DiffusionObjective(model, process, InputSpec(Field("image", shape)), steps=3)
    preview = objective.preview(variables, {"image": np.zeros((2, *shape), np.uint8)})
    assert preview.images.shape == (2, 8, 8, 3) and np.all(np.isfinite(preview.images))
    (path, kind), = query(root, f"SELECT path, kind FROM checkpoints WHERE run = '{outcome['run']}' "
                                "AND stage = 'flow_grpo' AND kind = 'policy'")
    assert path == outcome["model"]


@pytest.mark.slow
def test_previews_are_written_at_every_logged_step_and_published_as_artifacts(finished):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    root, _, outcome, _, _ = finished

    def names(stage):
        return sorted(os.listdir(os.path.join(root, "flow", stage, "previews")))

    assert names("flow_pretrain") == ["step-000000.png", "step-000002.png", "step-000004.png"]
    assert names("flow_grpo") == ["rollout-000000.png", "rollout-000001.png", "rollout-000002.png",
                                  "step-000000.png", "step-000001.png", "step-000002.png",
                                  "step-000003.png"]
    assert sorted(map(os.path.basename, outcome["previews"]["flow_grpo"])) == names("flow_grpo")
    for path in outcome["previews"]["flow_grpo"]:
        with open(path, "rb") as handle:
            assert handle.read(8) == PNG
    from tasks.ui import artifact_key

    pretrain_key, grpo_key = (artifact_key(outcome["run"], stage, "preview")
                              for stage in ("flow_pretrain", "flow_grpo"))
    with get_client(sync_client=True) as client:  # each run has its own preview keys
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[grpo_key, pretrain_key])))
    steps = {key: sorted(int(re.search(r"at step (\d+)", a.data)[1]) for a in artifacts if a.key == key)
             for key in (pretrain_key, grpo_key)}
    assert steps[pretrain_key] == [0, 2, 4]
    # Steps 0 and 1 are published twice: by the failed attempt and by the retry.
    assert sorted(set(steps[grpo_key])) == [0, 1, 2, 3]
    last = max((a for a in artifacts if a.key == grpo_key), key=lambda a: a.created)
    embedded = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", last.data)
    assert embedded and all(base64.b64decode(e).startswith(PNG) for e in embedded)
    assert "Mean reward of these samples" in last.data


@pytest.mark.slow
def test_a_failed_flow_grpo_task_is_retried_from_its_checkpoint_without_duplicate_samples(finished):
    root, _, outcome, starts, failed = finished
    assert failed == [2]
    assert starts == [("DiffusionObjective", 0), ("FlowGRPOObjective", 0), ("FlowGRPOObjective", 1)]
    attempts = dict(query(root, f"SELECT stage, attempt FROM stages WHERE run = '{outcome['run']}'"))
    assert attempts == {"flow_pretrain": 1, "flow_grpo": 2}
    losses = query(root, f"SELECT step, count(*) FROM metrics WHERE run = '{outcome['run']}' AND "
                         "stage = 'flow_grpo' AND name = 'loss' GROUP BY step ORDER BY step")
    assert losses == [(1, 1), (2, 1), (3, 1)]


@pytest.mark.slow
def test_a_rerun_with_the_same_inputs_reuses_both_stages(finished):
    from flows.flow_grpo import flow_grpo_pipeline

    root, params, first, _, _ = finished
    recorded = {table: query(root, f"SELECT count(*) FROM {table} WHERE run = '{first['run']}'")
                for table in ("metrics", "samples")}
    again = flow_grpo_pipeline(params)
    # The same run's next attempt: each stage keeps the record of the attempt that trained it.
    assert again["run"] == first["run"] and again["model"] == first["model"]
    assert again["metrics"] == first["metrics"]
    stages = query(root, f"SELECT stage, status, attempt FROM stages WHERE run = '{again['run']}'")
    assert sorted(stages) == [("flow_grpo", "completed", 2), ("flow_pretrain", "completed", 1)]
    assert query(root, f"SELECT attempts FROM runs WHERE run = '{again['run']}'") == [(2,)]
    for table in ("metrics", "samples"):
        assert query(root, f"SELECT count(*) FROM {table} WHERE run = '{again['run']}'") == recorded[table]


@pytest.mark.slow
def test_flow_grpo_with_lora_trains_adapters_on_the_pretrained_dit_and_saves_them_folded_in(finished):
    """The finished run again with rank-2 adapters on Flow-GRPO: pre-training is reused, the
    stage trains adapters alone (the store keeps its lora group) and saves a plain SimpleDiT."""
    from dew_lib.recipes.options import DiTLoRAOptions
    from flows.flow_grpo import flow_grpo_pipeline
    from tasks.images import load_dit

    root, params, first, _, _ = finished
    adapters = DiTLoRAOptions(rank=2, alpha=4, targets="all-linear")
    outcome = flow_grpo_pipeline(params.model_copy(update={"grpo": params.grpo.model_copy(update={"lora": adapters})}))
    assert outcome["model"] != first["model"]  # a new run of other inputs, pre-training reused
    recorded = json.loads(query(root, f"SELECT params FROM stages WHERE run = '{outcome['run']}' "
                                      "AND stage = 'flow_grpo'")[0][0])
    assert recorded["lora"] == {"rank": 2, "alpha": 4.0, "targets": "all-linear", "rslora": False, "dropout": 0.0}
    model, variables, _, _ = load_dit(outcome["model"])
    before, _, _, _ = load_dit(first["model"])
    assert model.lora is None and model == before  # the adapters folded into a plain DiT's kernels
    with pytest.raises(ValidationError, match="DiTLoRA.targets must name projections among qkv"):
        DiTLoRAOptions(rank=2, targets=("q_proj",))


def test_bad_flow_parameters_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValidationError, match="greenish"):
        FlowGRPOParams(reward="greenish")
    with pytest.raises(ValidationError, match="groups"):
        FlowGRPOParams(groups=1)
    with pytest.raises(ValidationError, match="starts from a pre-trained model"):
        FlowPipelineParams(stages=("flow_grpo",))
    with pytest.raises(ValidationError, match="stages must be"):
        FlowPipelineParams(stages=("flow_grpo", "flow_pretrain"))
    with pytest.raises(ValidationError, match="does not exist"):
        ImageDataParams(source="folder", path=str(tmp_path / "missing"))
    with pytest.raises(ValidationError, match="not a SimpleDiT directory"):
        FlowPipelineParams(model=dict(pretrained=str(tmp_path)))
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        FlowGRPOParams(group=4)
