"""Hugging Face checkpoints straight into a mesh's shards and back out of them (8 host devices).

`load_pretrained(directory, sharding=mesh)` splits each parameter as a Trainer on that mesh
splits it, each device holding its share; `Pretrained.save` of the split variables writes the
same bytes as of whole ones, pulling one tensor at a time to the host; across two processes
each fills only its own shards and process 0 alone writes the gathered checkpoint.
"""

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import run_on_host_devices

pytestmark = pytest.mark.timeout(300)

# A tiny Qwen3-shaped decoder (tests/conftest.py) saved in float32 under DIRECTORY/whole: 25
# tensors in 14 leaves, every weight split by fsdp=8 and by fsdp=4,tensor=2 (width 16, heads
# 4 x 4, kv heads 2 x 4, MLP 32, vocabulary 32).
CHECKPOINT = """
import jax, numpy as np
from conftest import tiny_model
from dew_lib.models import Pretrained
model = tiny_model()
variables = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32))
Pretrained.from_model(model).save(variables, DIRECTORY / "whole", dtype=None)
"""

SINGLE_PROCESS = """
import math, weakref
import optax
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file
from dew_lib import LMObjective, Trainer
from dew_lib.models import load_pretrained
from dew_lib.models.pretrained import files
from dew_lib.train.mesh import MeshSpec

def read(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if "safetensors" in p.name}

# What the writer holds: each array it pulls from the save's stream, and the bytes of earlier
# ones still alive when it arrives.
alive, pulled = {}, []
class Watched:
    def __init__(self, inner):
        self.inner = inner
    def __iter__(self):
        return self
    def __next__(self):
        name, array = next(self.inner)
        pulled.append((array.nbytes, sum(alive.values())))
        alive[len(pulled)] = array.nbytes
        weakref.finalize(array, alive.pop, len(pulled))
        return name, array
real_save_file = files.save_file
files.save_file = lambda shard, path, metadata=None: real_save_file(
    files.Shard(shard.planned, Watched(shard.stream)), path, metadata)

whole = load_pretrained(DIRECTORY / "whole", tokenizer=False)
tensors = whole.pretrained.tensors
largest, total = max(math.prod(t.shape) * 4 for t in tensors), sum(math.prod(t.shape) * 4 for t in tensors)
# The streaming writer's bytes are the safetensors library's own for the same tensors.
save_file(load_file(DIRECTORY / "whole" / "model.safetensors"), DIRECTORY / "library.safetensors",
          metadata={"format": "pt"})
print("library", read(DIRECTORY)["library.safetensors"] == read(DIRECTORY / "whole")["model.safetensors"])
# the old meaning of a Mesh, replication, is NamedSharding(mesh, P())
mesh = MeshSpec(fsdp=8).build()
replicated = load_pretrained(DIRECTORY / "whole", sharding=NamedSharding(mesh, PartitionSpec()), tokenizer=False)
print("replicated", all(leaf.is_fully_replicated and len(leaf.sharding.device_set) == 8
                        for leaf in jax.tree.leaves(replicated.variables)))

for spec in (MeshSpec(fsdp=8), MeshSpec(fsdp=4, tensor=2)):
    mesh = spec.build()
    trainer = Trainer(LMObjective(whole.model, seq_len=8), optax.adam(1e-2), key=jax.random.key(0), mesh=spec)
    rules = trainer.state_sharding.params  # the Trainer's own layout of its parameters
    for given in (mesh, spec):
        split = load_pretrained(DIRECTORY / "whole", sharding=given, tokenizer=False).variables
        same = jax.tree.leaves(jax.tree.map(lambda leaf, rule: leaf.sharding == rule, split, rules))
        print(spec, type(given).__name__, "rules", all(same), len(same))
    shares, exact, even = set(), True, True
    for leaf, want in zip(jax.tree.leaves(split), jax.tree.leaves(whole.variables), strict=True):
        ways = math.prod(mesh.shape[axis] for entry in leaf.sharding.spec if entry is not None
                         for axis in ((entry,) if isinstance(entry, str) else entry))
        held = {}
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
        even &= len(held) == 8 and set(held.values()) == {leaf.nbytes // ways}
        shares.add(ways)
        exact &= np.array_equal(np.asarray(leaf), np.asarray(want))
    print(spec, "shares", sorted(shares), "even", even, "exact", exact)
    for dtype, label in ((None, "f32"), ("bfloat16", "bf16")):
        for name, tree in (("split", split), ("whole", whole.variables)):
            whole.pretrained.save(tree, DIRECTORY / f"{name}-{label}", dtype=dtype, max_shard_size="8KB")
        a, b = read(DIRECTORY / f"split-{label}"), read(DIRECTORY / f"whole-{label}")
        print(spec, label, "identical", a == b, len(a))
    del pulled[:]
    whole.pretrained.save(split, DIRECTORY / "watched", dtype=None)
    print(spec, "streamed", len(pulled), max(n for n, _ in pulled) == largest,
          max(before for _, before in pulled), largest, total)
"""


def script(*parts: str, directory) -> str:
    return "\n".join([f"from pathlib import Path\nDIRECTORY = Path({str(directory)!r})"]
                     + [textwrap.dedent(part) for part in parts])


def test_a_checkpoint_loads_into_the_trainer_s_shards_and_saves_back_byte_for_byte(tmp_path):
    lines = run_on_host_devices(script(CHECKPOINT, SINGLE_PROCESS, directory=tmp_path), devices=8).splitlines()
    assert "library True" in lines and "replicated True" in lines
    for spec in ("fsdp=8,tensor=1", "fsdp=4,tensor=2"):
        # every leaf sharded as the Trainer shards that parameter, from a Mesh or a MeshSpec
        assert f"{spec} Mesh rules True 14" in lines and f"{spec} MeshSpec rules True 14" in lines
        # norms whole on every device, every weight split 8 ways (its width over fsdp, and its
        # heads, MLP units or vocabulary over tensor), each device holding 1/8 of its bytes;
        # the values exactly those of the whole load
        assert f"{spec} shares [1, 8] even True exact True" in lines
        # saving the split tree writes the bytes saving the whole one does (4 shards of 8KB)
        assert f"{spec} f32 identical True 5" in lines and f"{spec} bf16 identical True 3" in lines
        # one tensor at a time: when each reaches the writer, no earlier one is still held
        streamed = next(line for line in lines if line.startswith(f"{spec} streamed")).split()
        assert streamed[2:5] == ["25", "True", "0"], streamed
        assert int(streamed[6]) > 10 * int(streamed[5])  # the model: 22912 bytes, the largest tensor 2048


MULTIPROCESS = """
import sys
from pathlib import Path
from dew_lib.train import distributed
distributed.initialize()
import jax
from dew_lib.models import load_pretrained
from dew_lib.train.mesh import MeshSpec
DIRECTORY = Path(sys.argv[1])
loaded = load_pretrained(DIRECTORY / "whole", sharding=MeshSpec(fsdp=8), tokenizer=False)
leaves = jax.tree.leaves(loaded.variables)
own = sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)
print(f"spans {sum(not leaf.is_fully_addressable for leaf in leaves)} "
      f"own {own} of {sum(leaf.nbytes for leaf in leaves)} on {jax.local_device_count()}")
loaded.pretrained.save(loaded.variables, DIRECTORY / "two", dtype=None, write=distributed.is_primary())
print("saved")
"""


@pytest.mark.slow
def test_two_processes_fill_their_own_shards_and_process_0_alone_writes_the_gathered_save(tmp_path):
    run_on_host_devices(script(CHECKPOINT, directory=tmp_path), devices=1)
    job = tmp_path / "job.py"
    job.write_text(MULTIPROCESS)
    done = subprocess.run([sys.executable, "-m", "dew_lib.cli", "launch", "--processes", "2", "--local-devices",
                           "4", "--", sys.executable, str(job), str(tmp_path)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    held = [line.split() for line in done.stdout.splitlines() if " spans " in line]
    assert len(held) == 2 and "[1] saved" in done.stdout, done.stdout
    for words in held:  # every leaf spans both processes; each process fills its 4 devices' shards
        assert words[2] == "14" and words[-1] == "4", words
        assert int(words[4]) < int(words[6]), words
    written = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert written == ["config.json", "model.safetensors"]  # no dew_policy.json, no second writer's stage
    assert (tmp_path / "two" / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "two" / "config.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no stage left
