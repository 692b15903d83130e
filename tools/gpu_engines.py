"""The Python half of tools/gpu_engines.sh: a checkpoint to launch vLLM on, and the weight pushes read back.

Runs in Dew's own environment (no torch). Three subcommands, each printing one JSON line
(`{"ok": bool, "detail": "...", ...}`) as its last line and exiting 1 when a check failed:

    checkpoint --out DIR [--preset small|0.6b|tiny] [--tokenizer PATH_OR_HUB_ID] [--layers N]
        a Qwen3-shaped checkpoint with random weights (Dew's decoder, `Pretrained.save` in
        bfloat16): Qwen3-0.6B's widths and vocabulary with 4 layers (small), all 28 (0.6b,
        1.1 GiB, the size the spec timed), or a few-MB model for CPU dry runs (tiny).
    reload --url URL --dir DIR [--engine vllm]
        `SafetensorsReload` read back: the engine's probe answer at launch, then after pushing
        the same weights (identical), after pushing weights with down_proj halved (moved), and
        after pushing the launch weights back (identical again).
    nccl --url URL --dir DIR --library LIBNCCL [--pushes 5]
        `NCCLPush` from this process's first GPU: the same read-back, and the median push time
        of `--pushes` pushes after a first one that also opens the NCCL group.
    lora --url URL --dir DIR [--rank 8] [--engine vllm]
        `AdapterReload` against an engine launched on DIR with LoRA on (vLLM: --enable-lora
        --max-lora-rank R --max-loras 2 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): pushes a fresh
        adapter (B zero: the base's draw), then two trained ones; each is listed on /v1/models
        with the base as parent, each name draws its own probe, the two newest differ from the
        base and from each other, and the oldest is unloaded (its name answers 404).

The probe is one seeded completion of a fixed prompt (sampled ids and their log-probs) with
`prompt_logprobs: 0`, so vLLM answers the prompt's log-probabilities too; `--no-prompt-logprobs`
leaves that field out for an engine that refuses it (`dew serve`, which CPU dry runs use). "Identical" means
bit-equal after the JSON round trip, as the spec reports on real hardware; `--tolerance` relaxes it.

Not here: launching the engine (the shell script does), the wire tests (tests/test_real_engines.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# Qwen3-0.6B's config.json (Qwen/Qwen3-0.6B), the fields the decoder reads; bench/gpu.py uses the same.
QWEN3_06B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151_936,
                 hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                 max_position_embeddings=40_960)
PRESETS = {
    "small": dict(QWEN3_06B, num_hidden_layers=4),
    "0.6b": QWEN3_06B,
    "tiny": dict(QWEN3_06B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
}
QWEN3_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>: Qwen3's generation_config eos_token_id
PROMPT = np.random.default_rng(0).integers(0, 151_643, 24).tolist()  # ids below the special tokens
PROBE_TOKENS = 8
PROBE_SEED = 1234


def tokenizer_source(value: str) -> str:
    """A local tokenizer directory, or else a Hugging Face hub id (downloaded by transformers)."""
    return str(Path(value).resolve()) if Path(value).is_dir() else value


# ---- checkpoint -----------------------------------------------------------------------------------

def write_checkpoint(out: str, preset: str, tokenizer: str, layers: int | None, seed: int) -> dict:
    import jax
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from dew_lib.models.decoder import CausalTransformer
    from dew_lib.models.pretrained import Pretrained
    from dew_lib.models.pretrained.families import decoder_options

    config = dict(PRESETS[preset])
    if layers is not None:
        config["num_hidden_layers"] = layers
    _, options = decoder_options(config)
    model = CausalTransformer(**options, dtype=jnp.float32, param_dtype=jnp.float32)
    variables = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
    tok = AutoTokenizer.from_pretrained(tokenizer_source(tokenizer))
    if len(tok) > config["vocab_size"]:
        raise SystemExit(f"the tokenizer has {len(tok)} ids, more than the model's {config['vocab_size']}")
    pretrained = Pretrained.from_model(
        model, tokenizer=tok, config={"eos_token_id": QWEN3_EOS[0], "bos_token_id": QWEN3_EOS[1]},
        generation_config={"eos_token_id": QWEN3_EOS, "bos_token_id": QWEN3_EOS[1]})
    path = pretrained.save(variables, out)  # bfloat16
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables))
    return {"ok": True, "detail": f"{preset}, {config['num_hidden_layers']} layers, {count / 1e6:.1f}M "
            f"parameters, {size / 2**30:.2f} GiB safetensors in {path}", "path": str(path),
            "parameters": count, "bytes": size}


# ---- probing the engine ----------------------------------------------------------------------------

def served_model(url: str) -> str:
    import httpx

    answer = httpx.get(f"{url}/v1/models", timeout=30)
    answer.raise_for_status()
    (entry, *_) = answer.json()["data"]
    return entry["id"]


def probe_body(model: str, prompt_logprobs: bool = True) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 1.0,
            "seed": PROBE_SEED, "logprobs": 0, "return_tokens_as_token_ids": True}
    return {**body, "prompt_logprobs": 0} if prompt_logprobs else body


def read_probe(answer: dict) -> dict:
    """The sampled ids, their log-probs and (when sent) the prompt's log-probs from a completion."""
    (choice,) = answer["choices"]
    logprobs = choice["logprobs"]
    ids = [int(str(token).rsplit(":", 1)[-1]) for token in logprobs["tokens"]]
    out = {"ids": ids, "sampled": [float(v) for v in logprobs["token_logprobs"]], "prompt": None}
    rows = choice.get("prompt_logprobs")
    if rows is not None:  # vLLM: [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]
        if len(rows) != len(PROMPT) or rows[0] is not None:
            raise RuntimeError(f"prompt_logprobs has {len(rows)} rows for a {len(PROMPT)}-id prompt")
        missing = [token for token, row in zip(PROMPT[1:], rows[1:]) if str(token) not in row]
        if missing:
            raise RuntimeError(f"prompt_logprobs lacks the prompt's own ids {missing[:5]}")
        out["prompt"] = [float(row[str(token)]["logprob"]) for token, row in zip(PROMPT[1:], rows[1:])]
    return out


def probe(url: str, model: str, prompt_logprobs: bool = True) -> dict:
    import httpx

    answer = httpx.post(f"{url}/v1/completions", json=probe_body(model, prompt_logprobs), timeout=300)
    if answer.status_code != 200:
        raise RuntimeError(f"probe: HTTP {answer.status_code}: {answer.text[:500]}")
    read = read_probe(answer.json())
    if prompt_logprobs and read["prompt"] is None:
        raise RuntimeError("the engine answered without prompt_logprobs; pass --no-prompt-logprobs for "
                           "an engine that does not report them")
    return read


def difference(a: dict, b: dict) -> float:
    """Largest |log-prob| difference between two probes (inf when the sampled ids differ)."""
    if a["ids"] != b["ids"]:
        return float("inf")
    gaps = [np.abs(np.subtract(a["sampled"], b["sampled"])).max(initial=0.0)]
    if a["prompt"] is not None and b["prompt"] is not None:
        gaps.append(np.abs(np.subtract(a["prompt"], b["prompt"])).max(initial=0.0))
    return float(max(gaps))


def halved(variables: Any) -> Any:
    """The same weights with every layer's down_proj halved (the spec's changed policy)."""
    params = dict(variables["params"])
    layers = dict(params["layers"])
    layers["down_proj"] = {**layers["down_proj"], "kernel": layers["down_proj"]["kernel"] * 0.5}
    return {**variables, "params": {**params, "layers": layers}}


def read_back(push, variables: Any, url: str, model: str, tolerance: float, first: int,
              prompt_logprobs: bool = True) -> tuple[bool, list[str]]:
    """Push the launch weights, changed weights and the launch weights again; probe after each."""
    base = probe(url, model, prompt_logprobs)
    lines, ok = [f"probe: {len(base['ids'])} sampled ids and their log-probs"
                 f"{f', {len(PROMPT) - 1} prompt log-probs' if prompt_logprobs else ''}"], True
    for version, weights, want in ((first, variables, "same"), (first + 1, halved(variables), "moved"),
                                   (first + 2, variables, "same")):
        started = time.perf_counter()
        push(weights, version)
        seconds = time.perf_counter() - started
        gap = difference(base, probe(url, model, prompt_logprobs))
        good = gap <= tolerance if want == "same" else gap > max(tolerance, 1e-3)
        ok &= good
        label = "launch weights" if want == "same" else "down_proj halved"
        lines.append(f"v{version} {label}: pushed in {seconds:.2f} s, max |d log p| = {gap:.4g} "
                     f"({'identical' if gap == 0 else 'differs'}; want {want}) {'ok' if good else 'FAIL'}")
    return ok, lines


def run_reload(url: str, directory: str, engine: str, tolerance: float, prompt_logprobs: bool) -> dict:
    from dew_lib.inference.publish import SafetensorsReload
    from dew_lib.models import load_pretrained

    pretrained, variables = load_pretrained(directory)  # float32 copies of the bfloat16 on disk
    push = SafetensorsReload(pretrained, directory, [url], engine=engine)
    ok, lines = read_back(push, variables, url, served_model(url), tolerance, 1, prompt_logprobs)
    print("\n".join(lines))
    return {"ok": ok, "detail": "; ".join(lines[1:])}


def run_nccl(url: str, directory: str, library: str, pushes: int, nccl_version: str | None,
             tolerance: float, prompt_logprobs: bool) -> dict:
    import jax

    from dew_lib.inference.nccl import NCCLPush
    from dew_lib.models import load_pretrained

    device = jax.devices()[0]
    if device.platform != "gpu":
        return {"ok": False, "detail": f"JAX's first device is {device} ({device.platform}), not a GPU; "
                "install jax[cuda12] (or JAX_CUDA=cuda13) in Dew's environment"}
    pretrained, variables = load_pretrained(directory)
    variables = jax.device_put(variables, device)
    size = sum(int(np.prod(t.shape)) * 2 for t in pretrained.tensors)  # bfloat16 bytes pushed
    model = served_model(url)
    with NCCLPush(pretrained, [url], library, nccl_version=nccl_version, device=device) as push:
        started = time.perf_counter()
        push(variables, 100)  # opens the group, then pushes
        first = time.perf_counter() - started
        times = []
        for version in range(101, 101 + pushes):
            started = time.perf_counter()
            push(variables, version)
            times.append(time.perf_counter() - started)
        ok, lines = read_back(push, variables, url, model, tolerance, 200, prompt_logprobs)
    median = statistics.median(times)
    lines.insert(0, f"NCCLPush of {size / 2**30:.3f} GiB (bfloat16) from {device}: first push (group "
                 f"opened) {first:.2f} s; median of {pushes} pushes {median:.2f} s (min {min(times):.2f}, "
                 f"max {max(times):.2f}); {size / 2**30 / median:.2f} GiB/s")
    lines.insert(1, "spec (docs/publishing.md): Qwen3-0.6B, 1.1 GiB, 6.8-7.3 s per push on 4x RTX 3090 with a "
                 "three-process trainer, of which 4.6-5.1 s gathering across processes, 1.2 s export, 0.9 s "
                 "broadcast; here one process pushes weights already on its GPU (no gather)")
    print("\n".join(lines))
    return {"ok": ok, "detail": f"{size / 2**30:.3f} GiB, median {median:.2f} s over {pushes} pushes "
            f"(first {first:.2f} s); read-back {'ok' if ok else 'FAILED'}", "seconds": times,
            "bytes": size}


def lora_versions(model: Any, variables: Any, rank: int) -> tuple[Any, list[Any]]:
    """The adapted model and three adapter versions on every projection: fresh (B zero), then two
    with B drawn (each moves the model's log-probs)."""
    import jax

    from dew_lib.models import lora

    adapted, fresh = lora.attach(model, variables, lora.LoRA(rank=rank, alpha=2 * rank, targets="all-linear"),
                                 key=jax.random.key(7))

    def drawn(seed: int) -> Any:
        layers = dict(fresh["params"]["layers"])
        for index, target in enumerate(lora.TARGETS):
            b = layers[target]["lora_b"]
            layers[target] = {**layers[target], "lora_b": 0.05 * jax.random.normal(
                jax.random.fold_in(jax.random.key(seed), index), b.shape, b.dtype)}
        return {**fresh, "params": {**fresh["params"], "layers": layers}}

    return adapted, [fresh, drawn(1), drawn(2)]


def run_lora(url: str, directory: str, engine: str, rank: int, tolerance: float, prompt_logprobs: bool) -> dict:
    import dataclasses

    import httpx

    from dew_lib.inference import AdapterReload
    from dew_lib.models import load_pretrained

    pretrained, variables = load_pretrained(directory)
    adapted, versions = lora_versions(pretrained.model, variables, rank)
    push = AdapterReload(dataclasses.replace(pretrained, model=adapted), directory, [url], engine=engine,
                         prefix="gpu-lora")
    base_name = served_model(url)
    base = probe(url, base_name, prompt_logprobs)
    lines, probes, ok = [], {}, True
    for version, weights in enumerate(versions):
        started = time.perf_counter()
        push(weights, version)
        name = push.name(version)
        lines.append(f"v{version}: {push.written[-1]} bytes pushed in {time.perf_counter() - started:.2f} s as {name}")
        probes[version] = probe(url, name, prompt_logprobs) if engine == "vllm" else None
    listed = {entry["id"]: entry.get("parent") for entry in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    want = {push.name(1): base_name, push.name(2): base_name}
    good = all(listed.get(name) == parent for name, parent in want.items()) and push.name(0) not in listed
    ok &= good
    lines.append(f"/v1/models: {listed} ({'ok' if good else 'FAIL: want v1 and v2 with parent ' + base_name})")
    gone = httpx.post(f"{url}/v1/completions", json=probe_body(push.name(0), False), timeout=60).status_code
    ok &= gone == 404
    lines.append(f"the retired v0 answers {gone} ({'ok' if gone == 404 else 'FAIL: want 404'})")
    if engine == "vllm":
        checks = ((0, "base", base, "same"), (1, "base", base, "moved"), (2, "base", base, "moved"),
                  (2, "v1", probes[1], "moved"))
        for version, other, reference, wanted in checks:
            gap = difference(reference, probes[version])
            good = gap <= max(tolerance, 0.05) if wanted == "same" else gap > max(tolerance, 1e-3)
            ok &= good
            lines.append(f"v{version} against {other}: max |d log p| = {gap:.4g} (want {wanted}) "
                         f"{'ok' if good else 'FAIL'}")
    print("\n".join(lines))
    return {"ok": ok, "detail": "; ".join(lines), "bytes": push.written}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="tools/gpu_engines.py", description=__doc__.split("\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    checkpoint = sub.add_parser("checkpoint", help="write a Qwen3-shaped checkpoint with random weights")
    checkpoint.add_argument("--out", required=True)
    checkpoint.add_argument("--preset", choices=sorted(PRESETS), default="small")
    checkpoint.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    checkpoint.add_argument("--tokenizer", default="Qwen/Qwen3-0.6B",
                            help="a local tokenizer directory or a Hugging Face hub id")
    checkpoint.add_argument("--seed", type=int, default=0)
    helps = {"reload": "SafetensorsReload read back", "nccl": "NCCLPush read back",
             "lora": "AdapterReload: adapters pushed, loaded, drawn from and retired"}
    for name in ("reload", "nccl", "lora"):
        command = sub.add_parser(name, help=helps[name])
        command.add_argument("--url", required=True, help="the engine's root URL, http://host:port")
        command.add_argument("--dir", required=True, help="the checkpoint directory the engine was launched on")
        command.add_argument("--tolerance", type=float, default=0.0,
                             help="largest log-prob difference still counted as identical (default: exact)")
        command.add_argument("--no-prompt-logprobs", dest="prompt_logprobs", action="store_false",
                             help="probe without prompt_logprobs (for dew serve, which refuses the field)")
    sub.choices["reload"].add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    sub.choices["lora"].add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    sub.choices["lora"].add_argument("--rank", type=int, default=8, help="the adapters' rank (<= --max-lora-rank)")
    sub.choices["nccl"].add_argument("--library", required=True, help="the engine's own libnccl.so.2")
    sub.choices["nccl"].add_argument("--nccl-version", default=None, help="the engine's NCCL version, e.g. 2.27.3")
    sub.choices["nccl"].add_argument("--pushes", type=int, default=5)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dew_lib from this checkout
    try:
        if args.command == "checkpoint":
            result = write_checkpoint(args.out, args.preset, args.tokenizer, args.layers, args.seed)
        elif args.command == "reload":
            result = run_reload(args.url.rstrip("/"), args.dir, args.engine, args.tolerance,
                                args.prompt_logprobs)
        elif args.command == "lora":
            result = run_lora(args.url.rstrip("/"), args.dir, args.engine, args.rank, args.tolerance,
                              args.prompt_logprobs)
        else:
            result = run_nccl(args.url.rstrip("/"), args.dir, args.library, args.pushes, args.nccl_version,
                              args.tolerance, args.prompt_logprobs)
    except Exception as error:  # noqa: BLE001 - reported as the step's failure
        import traceback

        traceback.print_exc()
        result = {"ok": False, "detail": f"{type(error).__name__}: {str(error)[:300]}"}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
