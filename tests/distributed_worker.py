"""One process of a `dew launch` job (or a run alone), for the multi-process tests.

python tests/distributed_worker.py RECIPES OUT [--directory D] [--steps N] [--pause S]
RECIPES: comma-separated sft, dpo, grpo, flow (Flow-GRPO), async (GRPO through one RolloutScheduler
per process, each on its own native server), async-fail (the same with a reward that fails on
process 1 only), episodes (EpisodeRollout: process 0's episodes take one turn, process 1's three),
episodes-fail (the same with a tool that fails on process 1; each process logs its environments'
enters and exits to OUT-environments-<process>.log), episodes-mismatch (max_turns 2 on
process 1), episodes-journal (the episodes with an EpisodeJournal per process in
DIRECTORY/journal; see kill_here for DEW_TEST_KILL), ppo (PPORollout over the episodes, with a
critic, two epochs per collection); each trains a tiny model on a fixed sequence of global
batches, of which each process reads its own rows, and process 0 writes the final state's
leaves to OUT-<recipe>.npz. --directory checkpoints every step (one recipe); --pause sleeps
before each step so a test can kill the job mid-run; --mesh arranges the devices (MeshSpec.parse:
"fsdp=8", "data=2,fsdp=2,tensor=2"). Prints `pid <n>` first, one line per finished step, and at
the end how the state is split: `split <recipe> <leaves> leaves <bytes> bytes on device 0 of
<bytes>`, and any leaf whose shard is not its bytes over the product of its spec's mesh axes.
"""

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from dew_lib.train import distributed  # noqa: E402

distributed.initialize()

import itertools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from conftest import tiny_model  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from dew_lib import Dataset, Field, InputSpec, Trainer, models, presets  # noqa: E402
from dew_lib.diffusion import FlowGRPOObjective, FlowRollout  # noqa: E402
from dew_lib.inference import NativeRolloutServer, Server, ServeTask, TextGeneration  # noqa: E402
from dew_lib.objectives import DPOObjective, GRPOObjective, LMObjective, PPOObjective, ValueHead  # noqa: E402
from dew_lib.records import EpisodeStatus, Observation  # noqa: E402
from dew_lib.rollouts import (  # noqa: E402
    EpisodeJournal,
    EpisodeRollout,
    PPORollout,
    PromptSource,
    RolloutScheduler,
    SampledRollout,
    prompt_tasks,
)
from dew_lib.sampling import Sampling  # noqa: E402
from dew_lib.train.mesh import MeshSpec  # noqa: E402
from dew_lib.train.sinks import LineLog  # noqa: E402

ROWS = 8  # global rows per batch (GRPO: 4 prompts drawn twice; Flow-GRPO: 2 sources drawn 4 times)


def sft_batch(rng):
    text = rng.integers(1, 32, size=(ROWS, 9)).astype(np.int32)
    real = rng.integers(2, 10, size=ROWS)
    segments = (np.arange(9)[None] < real[:, None]).astype(np.int32)
    return {"text": text * segments, "text_segment_ids": segments}


def dpo_batch(rng):
    prompt = rng.integers(1, 32, size=(ROWS, 2))
    chosen = np.concatenate([prompt, rng.integers(1, 32, size=(ROWS, 3))], axis=1).astype(np.int32)
    rejected = np.concatenate([prompt, rng.integers(1, 32, size=(ROWS, 3))], axis=1).astype(np.int32)
    mask = np.tile([0, 0, 1, 1, 1], (ROWS, 2, 1)).astype(np.int32)
    return {"input_ids": np.stack([chosen, rejected], axis=1), "completion_mask": mask}


def grpo_batch(rng):
    rows = ROWS // 2
    lengths = rng.integers(1, 4, size=rows).astype(np.int32)
    prompt = rng.integers(3, 32, size=(rows, 3)).astype(np.int32) * (np.arange(3)[None] >= 3 - lengths[:, None])
    truth = np.zeros((rows, 1), np.int32) + ord("7")
    return {"prompt": prompt.astype(np.int32), "prompt_length": lengths, "ground_truth": truth,
            "data_source": np.tile(np.frombuffer(b"toy", np.uint8).astype(np.int32), (rows, 1)),
            "extra_info": np.zeros((rows, 0), np.int32)}


def flow_batch(rng):
    return {"image": rng.integers(0, 255, size=(ROWS // 4, 4, 4, 1)).astype(np.uint8)}


def brightness(images, batch):
    return images.mean(axis=(1, 2, 3))


def sevens(data_source, completion, ground_truth, extra_info):
    return float(completion.split().count("7"))


def scheduled(model, fail: bool):
    """One RolloutScheduler for this process, on its own native server. ahead=0 and max_lag=0
    draw every batch under the weights it trains, so a run does not depend on timing."""
    objective = GRPOObjective(model, seq_len=8)
    task = ServeTask(model=model, variables=jax.jit(objective.init)(jax.random.key(9)),
                     sampling=Sampling(temperature=1.0, eos_id=2))
    server = NativeRolloutServer(Server.from_task(task, slots=8, capacity=9, steps=3))

    def reward(data_source, completion, ground_truth, extra_info):
        if fail and jax.process_index() == 1:
            raise ValueError("this grader is down on process 1")
        return float(sum(map(int, completion.split())) % 5)  # differs within a group: advantages are not 0

    source = PromptSource(server, reward, decode=lambda ids: " ".join(map(str, ids)), max_new_tokens=6)
    scheduler = RolloutScheduler(objective, source, server, width=9, rows=ROWS // jax.process_count(),
                                 tasks=prompt_tasks, groups=2, ahead=0, max_lag=0, max_attempts=2,
                                 truncation="score")
    return objective, scheduler


def episodes_batch(rng):
    """Four task rows; their ids give the first two (process 0's) one turn, the last two three."""
    i = int(rng.integers(0, 1000))
    return {"task_id": np.array([3 * i, 3 * i + 3, 3 * i + 2, 3 * i + 5])}


def kill_here(identity, where: str, pause: float = 0.0) -> None:
    """With DEW_TEST_KILL=MARKER:STEP:WHERE, process 1 kills itself (SIGKILL) once, unless MARKER
    exists, at `where` in the collection of trainer step STEP (0-based), after `pause` seconds."""
    spec = os.environ.get("DEW_TEST_KILL")
    if not spec or jax.process_index() != 1:
        return
    marker, step, at = spec.rsplit(":", 2)
    if at == where and identity.step == int(step) and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(pause)
        os.kill(os.getpid(), signal.SIGKILL)


class Tool:
    """Answers each action with [10, 11] for `1 + task_id % 3` turns, then completes; with `fail`,
    every answer on process 1 raises. Logs every enter and exit to `log`. Its state (turns
    answered) is saved and restored for a journal. Process 1 may be killed a second after leaving
    an environment (`kill_here` "release"), when process 0 has finished the collection."""

    def __init__(self, task, log, fail, identity):
        self.turns, self.log, self.fail, self.answered = 1 + int(task.id) % 3, log, fail, 0
        self.identity = identity

    def __enter__(self):
        print("enter", file=self.log, flush=True)
        return self

    def __exit__(self, *exc):
        print("exit", file=self.log, flush=True)
        kill_here(self.identity, "release", pause=1.0)

    def reset(self):
        return Observation([1, 3])

    def step(self, action):
        self.answered += 1
        if self.fail and jax.process_index() == 1:
            raise ConnectionError("the tool's sandbox went away on process 1")
        if self.answered >= self.turns:
            return Observation(status=EpisodeStatus.COMPLETED)
        return Observation([*action.context, *action.tokens, 10, 11])

    def get_state(self):
        return str(self.answered).encode()

    def set_state(self, state):
        self.answered = int(state)


def verify(task, episode):
    """The last action's ids summed, mod 3; process 1 may be killed here (`kill_here` "verify"),
    while process 0 waits for every process's verdicts."""
    kill_here(episode.identity, "verify")
    return float(sum(episode.transitions[-1].action.tokens) % 3)


def episodes(model, out, fail, turns=3, journal=None, policy=None):
    objective = GRPOObjective(model, seq_len=19)
    log = open(f"{out}-environments-{jax.process_index()}.log", "a")
    rollout = EpisodeRollout(policy or TextGeneration(model), lambda task, identity: Tool(task, log, fail, identity),
                             verify,
                             max_prompt_tokens=16, max_new_tokens=4, max_turns=turns, groups=2,
                             sampling=Sampling(temperature=1.0, eos_id=2), truncation="score", journal=journal)
    return objective, episodes_batch, rollout


def ppo(model, out):
    """PPO over the episodes: a critic on the policy's model, advantages whitened over the job's
    batch, each collection trained twice (two epochs)."""
    objective = PPOObjective(model, seq_len=19, critic=ValueHead(model), beta=0.01)
    _, batch, collected = episodes(model, out, fail=False, policy=objective.policy())
    return objective, batch, PPORollout(objective, collected, epochs=2)


def setup(recipe, out, directory=None):
    """The objective, the global batch maker, and the rollout, for one recipe."""
    model = tiny_model()
    if recipe == "ppo":
        return ppo(model, out)
    if recipe == "episodes-journal":
        return episodes(model, out, fail=False, journal=EpisodeJournal(os.path.join(directory, "journal")))
    if recipe.startswith("episodes"):
        mismatched = recipe == "episodes-mismatch" and jax.process_index() == 1
        return episodes(model, out, fail=recipe == "episodes-fail", turns=2 if mismatched else 3)
    if recipe.startswith("async"):
        objective, scheduler = scheduled(model, fail=recipe == "async-fail")
        return objective, grpo_batch, scheduler
    if recipe == "sft":
        return LMObjective(model, seq_len=8), sft_batch, None
    if recipe == "dpo":
        return DPOObjective(model, seq_len=4, beta=0.1), dpo_batch, None
    if recipe == "flow":
        dit = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8, num_layers=1, num_heads=2,
                               mlp_ratio=2)
        objective = FlowGRPOObjective(dit, presets.Flow()(), InputSpec(Field("image", (4, 4, 1))), guidance=None,
                                      beta=0.01, steps=5)
        return objective, flow_batch, FlowRollout(objective, brightness, groups=4, steps=5, train_steps=2)
    objective = GRPOObjective(model, seq_len=8)
    rollout = SampledRollout(objective, reward=sevens, groups=2, max_new_tokens=6,
                             sampling=Sampling(temperature=1.0, eos_id=2), decode=lambda ids: " ".join(map(str, ids)),
                             workers=1)
    return objective, grpo_batch, rollout


def report_split(recipe, state, mesh):
    """Print how much of the state device 0 holds, and any leaf whose shard on it is not its
    bytes divided by the sizes of the mesh axes its sharding names."""
    held = total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = [name for entry in leaf.sharding.spec if entry for name in
                 (entry if isinstance(entry, tuple) else (entry,))]
        split = int(np.prod([mesh.shape[name] for name in names]))
        shard = leaf.addressable_shards[0].data.nbytes
        if shard * split != leaf.nbytes:
            print("uneven", recipe, jax.tree_util.keystr(path), leaf.shape, leaf.sharding.spec, flush=True)
        held, total = held + shard, total + leaf.nbytes
    print("split", recipe, len(jax.tree.leaves(state)), "leaves", held, "bytes on device 0 of", total, flush=True)


def shares(make, partition):
    """This partition's rows of a fixed endless sequence of global batches."""
    rng = np.random.default_rng(11)
    for batch in (make(rng) for _ in itertools.count()):
        rows = len(next(iter(batch.values()))) // partition.count
        yield {k: v[partition.index * rows:(partition.index + 1) * rows] for k, v in batch.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("recipes")
    parser.add_argument("out")
    parser.add_argument("--directory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--mesh", type=MeshSpec.parse, default=MeshSpec())
    args = parser.parse_args()
    print("pid", os.getpid(), flush=True)
    for recipe in args.recipes.split(","):
        objective, make, rollout = setup(recipe, args.out, args.directory)

        def step(state, batch, key, rollout=rollout):
            time.sleep(args.pause)
            return batch if rollout is None else rollout(state, batch, key)

        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0),
                          rollout=step if (rollout or args.pause) else None, mesh=args.mesh)
        data = Dataset(train=lambda partition, make=make: shares(make, partition), batch=ROWS)
        if isinstance(rollout, RolloutScheduler):
            data = rollout.tasks(data)
        try:
            state = trainer.fit(data, steps=args.steps, log_every=1, directory=args.directory,
                                checkpoint_every=1 if args.directory else None, sinks=[LineLog()])
        except (RuntimeError, ConnectionError, ValueError) as error:  # every process says what it raised before the end
            print(recipe, "process", jax.process_index(), "raised:", " ".join(str(error).split()), flush=True)
            time.sleep(1)
            os._exit(3)
        finally:
            if isinstance(rollout, RolloutScheduler):
                rollout.close()
                rollout.source.close()
                rollout.weights.close()
        report_split(recipe, state, trainer.mesh)
        whole = [np.asarray(multihost_utils.process_allgather(x, tiled=True) if not x.is_fully_addressable else x)
                 for x in jax.tree.leaves(state)]  # a leaf split across processes is gathered by all
        if distributed.is_primary():
            np.savez(f"{args.out}-{recipe}.npz", **{str(i): x for i, x in enumerate(whole)})
        print(recipe, "process", jax.process_index(), "of", jax.process_count(), "devices",
              jax.device_count(), "step", int(state.step), flush=True)


if __name__ == "__main__":
    main()
