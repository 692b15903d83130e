"""The training tasks of the rectified-flow stages: flow-matching pre-training and Flow-GRPO.

They follow tasks/train.py: a stage works in the directory of its inputs,
`runs/<name>/<stage>/<key[:12]>/` (tasks/storage.py `stage_directory`); a retry continues from
the last checkpoint there (`Trainer.fit` restores it and the store drops what earlier attempts
recorded after it), `result.json`, written last, lets a rerun with the same inputs skip the
stage, and changed inputs train from step 0 in a directory of their own (or, when only `steps`
grew, on from a copy of the shorter run's checkpoint).

What they add is what an image stage shows. At every logged step (and at the start and the
end) the live model samples the same fixed noise with the deterministic sampler; the grid is
saved as `previews/step-NNNNNN.png` in the stage directory and published as a markdown
artifact. Flow-GRPO also saves the grid of that step's rollout (`previews/rollout-NNNNNN.png`)
and records every sample of every rollout (reward, group mean and standard deviation,
advantage, kept, and the image as a PNG) in the run store's `samples` table.

What each stage trains (objective, data, rollout) comes from dew_lib.recipes.flow
(`build_flow_pretrain`, `build_flow_grpo`): these tasks turn their pydantic parameters into its
options, load the images or the saved model, and wrap the result in previews and the run store.

The previews need the live parameters. Flow-GRPO renders them in its rollout wrapper, which sees
the state; pre-training has no rollout, so its `PreviewHook` is a sink whose `before_step` hook
receives the state each update starts from.

Not here: what the options build (dew_lib/recipes/flow.py), conditioned models (prompts or
labels), guidance, image stages as multi-process jobs (the library runs FlowRollout across processes).
"""

from __future__ import annotations

import glob
import os

import jax
import numpy as np
from prefect import get_run_logger, task

from dew_lib.diffusion import FlowRollout, encode_png, presets
from dew_lib.diffusion.preview import to_uint8
from dew_lib.models import dit as dits
from dew_lib.recipes.flow import build_flow_grpo, build_flow_pretrain
from dew_lib.recipes.options import optimizer
from dew_lib.recipes.recorded import RecordedRollout
from dew_lib.train.sinks import Sink
from dew_lib.train.trackers import TrackerOptions
from dew_lib.train.trainer import Trainer
from tasks.images import build_dit, load_dit, load_images, reward_named, save_dit
from tasks.lifecycle import Start, begin, conclude, stage_sinks, stage_trackers, write_result
from tasks.manifests import DiTRef, ImageManifest, ImageStageResult, fingerprint, keyed
from tasks.params import DiTParams, FlowGRPOParams, FlowPretrainParams, StageParams
from tasks.records import open_stage
from tasks.refusals import RunRefused, retry_unless_refused
from tasks.ui import keep_last_checkpoint, publish_images

LINKS = ("model", "checkpoints", "previews", "metrics.jsonl", "curves.png")  # also under runs/<name>/<stage>/
SHOWN = ("loss", "reward", "pg_loss", "kl", "clipfrac", "grad_norm",
         "steps_per_second")


class Previews:
    """Samples of the live model on fixed noise, saved as PNGs and published to the UI.

    scored: a reward; each preview then reports its samples' mean reward (kept in `means`).
    """

    def __init__(self, stage: str, objective, rows: int, shape, directory: str, scored=None):
        self.stage, self.objective, self.scored = stage, objective, scored
        self.batch = {"image": np.zeros((rows, *shape), np.uint8)}  # unconditioned: only its size counts
        self.directory = os.path.join(directory, "previews")
        self.means: dict[int, float | None] = {}

    def __call__(self, params, step: int, record=None) -> None:
        preview = self.objective.preview(params, self.batch, step, scored=self.scored)
        os.makedirs(self.directory, exist_ok=True)
        shown = [("live model, fixed noise", self._save(f"step-{step:06d}.png", preview.png(columns=8)))]
        lines = []
        if preview.scores is not None:
            self.means[step] = float(preview.scores.mean())
            lines.append(f"Mean reward of these samples: {self.means[step]:.4f}")
        else:
            self.means[step] = None
        if record is not None:
            shown.append((f"rollout {step}", self._save(f"rollout-{step:06d}.png",
                                                        record.preview().png(columns=8))))
            lines.append(f"Rollout mean reward {record.rewards.mean():.4f}; {int(record.kept.sum())} "
                         f"of {len(record.kept)} samples kept (nonzero advantage)")
        publish_images(self.stage, step, shown, lines)

    def _save(self, name: str, png: bytes) -> str:
        path = os.path.join(self.directory, name)
        with open(path + ".tmp", "wb") as handle:
            handle.write(png)
        os.replace(path + ".tmp", path)
        return path


class PreviewHook(Sink):
    """Previews the live model every `every` updates: a sink whose `before_step` hook sees the
    state each update starts from (the step is counted on the host, nothing is read back)."""

    def __init__(self, previews: Previews, every: int):
        self.previews, self.every = previews, every

    def before_step(self, step: int, state) -> None:
        if step % self.every == 0:
            self.previews(state.params, step)

    def write(self, step, metrics) -> None:
        return None


def flow_samples(rollout: FlowRollout, writer, previews: Previews, every: int, images: bool):
    """A FlowRollout's recorder (dew_lib.recipes.RecordedRollout): every sample of the draw in
    the store's `samples` table (with its PNG when `images`), and a preview every `every` updates."""

    def record(state, batch, seconds: float) -> None:
        drawn = rollout.last
        pngs = None
        if images:
            pngs = [encode_png(p[..., 0] if p.shape[-1] == 1 else p) for p in to_uint8(drawn.images)]
        writer.samples(drawn, images=pngs)
        if drawn.step % every == 0:
            previews(state.params, drawn.step, drawn)

    return record


def _labels(stage: str) -> dict[str, str]:
    """How the log names each group of an image stage's inputs when they changed."""
    return {"params": f"{stage} parameters", "model": "model parameters", "data": "the images",
            "start": "the starting model", "seed": "seed"}


def _fit(stage: str, kind: str, params: StageParams, key: str, inputs: dict, directory: str,
         store_root: str, run: str, build, tracking: TrackerOptions | None = None) -> ImageStageResult:
    """An image stage's life (tasks/lifecycle.py): reuse or resume, fit, save, publish.

    inputs: what `key` was computed from, as JSON (named in the log when they change).
    build(writer, resumed, directory) -> (trainer, dataset, previews, extra sinks,
    save(state) -> DiTRef, extra_metrics() -> dict), where resumed is the checkpoint step a retry
    continues from, or None, and directory the one of these inputs. tracking: the trackers the
    stage also logs to, its previews sent as images (TensorBoard) and artifacts (MLflow).
    """
    logger = get_run_logger()
    start = begin(stage, kind, params, key, inputs, directory, store_root, run, links=LINKS,
                  labels=_labels(stage), result=ImageStageResult, logger=logger,
                  shorter=params.schedule == "constant")
    if not isinstance(start, Start):
        return start
    output = os.path.dirname(os.path.abspath(directory))  # the run's directory
    directory = start.directory
    with (open_stage(store_root, run, stage, kind, params.model_dump(mode="json")) as writer,
          stage_trackers(tracking, writer, run, stage, params, output, logger) as trackers):
        checkpoints = os.path.join(directory, "checkpoints")
        if start.resumed is not None:
            writer.discard_after(start.resumed)
        trainer, dataset, previews, extra_sinks, save, extra = build(writer, start.resumed, directory)
        sinks = stage_sinks(stage, params, writer, os.path.join(directory, "metrics.jsonl"), shown=SHOWN,
                            before=extra_sinks, logger=logger, trackers=trackers.sinks)
        state = trainer.fit(dataset, steps=params.steps, log_every=params.log_every,
                            directory=checkpoints, checkpoint_every=params.checkpoint_every, sinks=sinks)
        logger.info("%s: %s", stage, keep_last_checkpoint(checkpoints))
        if params.steps not in previews.means:
            previews(state.params, params.steps)
        model = save(state)
        metrics = conclude(writer, stage, kind, directory, params.steps, model.path, extra=extra())
        trackers.attach(model=model.path, curves=os.path.join(directory, "curves.png"),
                        **{f"preview-{step:06d}": os.path.join(previews.directory, f"step-{step:06d}.png")
                           for step in (0, params.steps)})
    shown = sorted(glob.glob(os.path.join(previews.directory, "*.png")))  # earlier attempts' too
    result = ImageStageResult(stage=stage, kind=kind, model=model, metrics=metrics, directory=directory,
                              previews=shown)
    write_result(directory, key, result)
    logger.info("%s done: %s", stage, {k: round(v, 4) for k, v in metrics.items()
                                       if k in SHOWN or k.startswith("preview")})
    return result


@task(retries=2, retry_delay_seconds=1, retry_condition_fn=retry_unless_refused, task_run_name="train-{stage}")
def pretrain_stage(stage: str, params: FlowPretrainParams, data: ImageManifest, model: DiTParams,
                   directory: str, store_root: str, run: str, seed: int,
                   tracking: TrackerOptions | None = None) -> ImageStageResult:
    """Flow-matching pre-training of a SimpleDiT on `data`, saved under `directory`/<key[:12]>/model
    (also reachable as `directory`/model until other inputs start)."""
    relevant = params.model_copy(update={"log_every": 1, "max_minutes": None})
    key = fingerprint("flow_pretrain", keyed(relevant), model, data.fingerprint, seed)
    inputs = {"params": keyed(relevant), "model": model.model_dump(mode="json"),
              "data": data.fingerprint, "seed": seed}

    def build(writer, resumed, directory):
        if model.pretrained is not None:
            dit, variables, shape, process = load_dit(model.pretrained)
            if tuple(shape) != tuple(data.shape):
                raise RunRefused(f"model.pretrained {model.pretrained} was trained on {tuple(shape)} "
                                 f"images but the data are {tuple(data.shape)}")
        else:
            dit, variables, process = build_dit(model, data.shape[-1]), None, presets.Flow()()
        if data.shape[0] % dit.patch_size or data.shape[1] % dit.patch_size:
            raise RunRefused(f"model.patch_size={dit.patch_size} does not divide the images' "
                             f"{data.shape[0]}x{data.shape[1]} pixels; pick a divisor")
        built = build_flow_pretrain(dit, process, variables, load_images(data), params, seed=seed)
        previews = Previews(stage, built.objective, params.preview_rows, data.shape, directory)
        hook = PreviewHook(previews, params.log_every)
        trainer = Trainer(built.objective, optimizer(params), key=jax.random.key(seed))

        def save(state):
            return save_dit(dit, state.params, data.shape, process, os.path.join(directory, "model"), key)

        return trainer, built.dataset, previews, [hook], save, dict

    return _fit(stage, "flow_pretrain", params, key, inputs, directory, store_root, run, build, tracking)


@task(retries=2, retry_delay_seconds=1, retry_condition_fn=retry_unless_refused, task_run_name="train-{stage}")
def grpo_stage(stage: str, params: FlowGRPOParams, start: DiTRef, directory: str, store_root: str,
               run: str, seed: int, tracking: TrackerOptions | None = None) -> ImageStageResult:
    """Flow-GRPO from the SimpleDiT at `start` against the named reward, saved under
    `directory`/<key[:12]>/model (also reachable as `directory`/model until other inputs start)."""
    relevant = params.model_copy(update={"log_every": 1, "max_minutes": None})
    key = fingerprint("flow_grpo", keyed(relevant), start.fingerprint, seed)
    inputs = {"params": keyed(relevant), "start": start.fingerprint, "seed": seed}
    reward = reward_named(params.reward)

    def build(writer, resumed, directory):
        dit, variables, shape, process = load_dit(start.path)
        built = build_flow_grpo(dit, process, variables, shape, reward, params,
                                key=jax.random.fold_in(jax.random.key(seed), 1))  # adapters, with a rank
        previews = Previews(stage, built.objective, params.preview_rows, shape, directory, scored=reward)
        recorded = RecordedRollout(built.rollout, flow_samples(built.rollout, writer, previews, params.log_every,
                                                               params.store_images))
        if resumed:  # the first rollout's preview shows the starting model otherwise
            previews(variables, 0)
        trainer = Trainer(built.objective, optimizer(params), key=jax.random.key(seed + 1), rollout=recorded)

        def save(state):  # adapters folded into their kernels: a plain SimpleDiT
            plain, folded = dits.merged(built.model, state.params)
            return save_dit(plain, folded, shape, process, os.path.join(directory, "model"), key)

        def extra():
            return {"preview_reward_start": previews.means[0], "preview_reward_final": previews.means[params.steps]}

        return trainer, built.dataset, previews, [], save, extra

    return _fit(stage, "flow_grpo", params, key, inputs, directory, store_root, run, build, tracking)
