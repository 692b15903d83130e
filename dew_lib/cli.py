"""The `dew` command: query the run store from a shell, also while runs are writing it, and serve
a trained policy over HTTP.

    dew sql "SELECT update, avg(reward) FROM sessions GROUP BY update ORDER BY update"
    dew sql --csv "SELECT * FROM metrics WHERE name = 'loss'" > loss.csv
    dew runs                      # every run with its stages, status and headline metrics
    dew schema [TABLE]            # the tables and what their columns hold
    dew store check               # damaged files of the store; `dew store repair` moves them aside
    dew serve CHECKPOINT_DIR      # vLLM's OpenAI-compatible API over Dew's native server
    dew plan --model qwen3-8b --mesh fsdp=8 --stage grpo --seq-len 4096 --batch 64 --device h200

`--store PATH` (default: $DEW_STORE, else `runs`) is the project directory, its `dew.duckdb` or
its `store/` directory; it and the output options go before the command or after it
(`dew --store X sql ...`). `dew sql` only reads: a statement that is not one query is refused
(dew_lib/store/readonly.py). A query that fails (bad SQL, an unknown table, a damaged file it
needs), a store that does not exist or cannot be read prints one message to stderr and exits with
status 1. `dew serve` runs
until SIGTERM or Ctrl-C (see docs/serve.md); a checkpoint it cannot load or a port it cannot bind
prints one message and exits with status 1.

Not here: writing the store (dew_lib.store), running stages (the Prefect flows), the server
itself (dew_lib.serve).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import decimal
import json
import math
import os
import sys
import uuid
from collections.abc import Sequence
from typing import Any


def _plain(value: Any) -> Any:
    """A JSON-ready value: NaN and infinities become null, times ISO strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal):
        return _plain(float(value))
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, datetime.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(_plain(value), separators=(",", ":"))
    return str(value)


def render_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int) -> str:
    """An aligned text table; cells longer than max_width are cut with an ellipsis."""
    def cut(text: str) -> str:
        text = text.replace("\n", "\\n")
        return text if max_width <= 0 or len(text) <= max_width else text[: max_width - 1] + "…"

    cells = [[cut(_cell(v)) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float, decimal.Decimal)) and not isinstance(row[i], bool)
                   for row in rows if row[i] is not None) for i in range(len(columns))]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip(),
             "-+-".join("-" * w for w in widths)]
    for row in cells:
        lines.append(" | ".join(v.rjust(w) if num else v.ljust(w)
                                for v, w, num in zip(row, widths, numeric, strict=True)).rstrip())
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def emit(columns: Sequence[str], rows: Sequence[Sequence[Any]], form: str, max_width: int, out) -> None:
    if form == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if v is None else json.dumps(_plain(v)) if isinstance(v, (dict, list, tuple))
                             else _plain(v) for v in row])
    elif form == "json":
        records = [json.dumps({c: _plain(v) for c, v in zip(columns, row, strict=True)}, allow_nan=False)
                   for row in rows]  # one record per line: greppable, and still one JSON array
        out.write("[\n" + ",\n".join(records) + "\n]\n" if records else "[]\n")
    else:
        out.write(render_table(columns, rows, max_width) + "\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dew", description="Query Dew's run store, serve a policy, launch a multi-process job.")
    # The options exist before the command (with the defaults) and after it (SUPPRESS: a
    # subcommand that does not see one leaves what was given before it).
    parser.set_defaults(store=os.environ.get("DEW_STORE", "runs"), form=None, max_width=48)

    def add_store(sub):
        sub.add_argument("--store", default=argparse.SUPPRESS,
                         help="project directory, its dew.duckdb or its store/ (default: $DEW_STORE or runs)")

    def add_format(sub):
        group = sub.add_mutually_exclusive_group()
        group.add_argument("--csv", dest="form", action="store_const", const="csv", default=argparse.SUPPRESS,
                           help="print CSV")
        group.add_argument("--json", dest="form", action="store_const", const="json", default=argparse.SUPPRESS,
                           help="print a JSON array")
        sub.add_argument("--max-width", type=int, default=argparse.SUPPRESS,
                         help="cut table cells longer than this (0: never; tables only; default 48)")

    add_store(parser)
    add_format(parser)
    commands = parser.add_subparsers(dest="command", required=True)

    sql = commands.add_parser("sql", help="run a SQL query over the store's views")
    sql.add_argument("query", help='e.g. "SELECT * FROM runs"')
    add_store(sql)
    add_format(sql)
    runs = commands.add_parser("runs", help="list runs with their stages, status and headline metrics")
    add_store(runs)
    add_format(runs)
    schema = commands.add_parser("schema", help="describe the store's tables")
    schema.add_argument("table", nargs="?", help="one table (default: all)")
    health = commands.add_parser(
        "store", help="check the store for damaged files, or move them aside",
        description="check: list damaged files (exit 1 when there are any); queries then read around "
                    "them. repair: move them into store/.quarantine/ (recorded, never deleted) and republish.")
    health.add_argument("action", choices=("check", "repair"))
    add_store(health)
    add_format(health)
    _serve_parser(commands)
    launch = commands.add_parser(
        "launch", help="run a command as a multi-process JAX job on this host",
        description="Start the command N times as one JAX job (dew_lib.train.distributed.initialize() "
                    "joins it); a process that fails ends the others.")
    launch.add_argument("--processes", type=int, required=True, help="processes in the job")
    launch.add_argument("--local-devices", type=int, default=None,
                        help="host devices per process on CPU (default: the platform's own)")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python train.py")
    _plan_parser(commands)
    return parser


def _plan_parser(commands) -> None:
    from dew_lib.plan_tables import DEVICE_BYTES, MODELS, STAGES

    plan = commands.add_parser(
        "plan", help="say what a training step needs on each device, before loading any weight",
        description="Compile the stage's real update on abstract shapes over host devices arranged as "
                    "the mesh, and print each device's bytes (parameters, optimizer state, reference, "
                    "gradient sum, batch, XLA's temporary peak) against the device's memory. Exit status "
                    "2 when it does not fit.")
    plan.add_argument("--model", required=True,
                      help=f"{', '.join(MODELS)}, or a config.json (or a checkpoint directory holding one)")
    plan.add_argument("--mesh", default="data=1",
                      help="axis=size pairs: fsdp=8, data=2,fsdp=2,tensor=2, fsdp=2,expert=4 (default data=1)")
    plan.add_argument("--stage", choices=STAGES, required=True)
    plan.add_argument("--seq-len", type=int, required=True, help="ids per row")
    plan.add_argument("--batch", type=int, required=True, help="rows per step (DPO: pairs)")
    plan.add_argument("--accumulate", type=int, default=1, help="micro-steps the batch is split into (default 1)")
    plan.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="parameters and activations (default bfloat16)")
    plan.add_argument("--remat", action="store_true", help="recompute each layer's activations in the backward pass")
    plan.add_argument("--suggest", type=int, default=None, metavar="DEVICES",
                      help="plan every fsdp x expert mesh of DEVICES devices (expert dividing the expert count; "
                           "--mesh's tensor kept) and say which to train on and why")
    size = plan.add_mutually_exclusive_group()
    size.add_argument("--device", choices=sorted(DEVICE_BYTES), help="the device's memory from the known table")
    size.add_argument("--device-bytes", type=int, help="the device's memory in bytes")


def _serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve a Hugging Face checkpoint over vLLM's OpenAI-compatible API",
        description="Serve a checkpoint directory (written by Pretrained.save) with Dew's native "
                    "continuous-batching server behind vLLM's OpenAI-compatible routes.")
    serve.add_argument("directory", help="Hugging Face checkpoint directory (config.json, safetensors, tokenizer)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 takes a free one)")
    serve.add_argument("--slots", type=int, default=8, help="requests decoded together (default 8)")
    serve.add_argument("--capacity", type=int, default=None,
                       help="ids per request, prompt and completion (default: the model's max_seq_len, at most 2048)")
    serve.add_argument("--steps", type=int, default=16, help="decode steps per compiled call (default 16)")
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="local devices the model's heads, MLP and KV cache are split across (default 1)")
    serve.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                       help="serve the PEFT adapter in PATH over the checkpoint as model NAME (repeatable)")
    serve.add_argument("--temperature", type=float, default=1.0, help="served temperature (default 1; 0 is greedy)")
    serve.add_argument("--top-k", type=int, default=None, help="served top-k (default: none; 0 or -1 also mean none)")
    serve.add_argument("--top-p", type=float, default=1.0, help="served top-p (default 1: none)")
    serve.add_argument("--min-p", type=float, default=0.0, help="served min-p (default 0: none)")
    serve.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="precision of weights and activations (default float32)")
    serve.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"), default="raw_logprobs",
                       help="reported log-probs: the model's log-softmax (default) or after temperature and filters")
    serve.add_argument("--served-model-name", default=None,
                       help="model name clients send (default: the directory's name)")
    serve.add_argument("--seed", type=int, default=0, help="seed of the seeds given to requests without one")
    serve.add_argument("--enable-return-routed-experts", action="store_true",
                       help="a mixture of experts: send each completion's routes (routed_experts), as vLLM does")
    dev = serve.add_mutually_exclusive_group()
    dev.add_argument("--dev-endpoints", dest="dev_endpoints", action="store_true", default=False,
                     help="serve /pause, /collective_rpc, /update_weight_version, ... (a weight push needs them; "
                          "whoever reaches them can pause the server: set --api-key too)")
    dev.add_argument("--no-dev-endpoints", dest="dev_endpoints", action="store_false",
                     help="never serve the development routes (the default)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every route but /health "
                            "(default: $DEW_SERVE_API_KEY, else none)")
    serve.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                       help="largest request body in bytes (default 4 MiB; larger ones get 413)")
    serve.add_argument("--max-tokens-limit", type=int, default=None,
                       help="most ids one request may ask for (default: whatever the capacity leaves)")
    serve.add_argument("--read-timeout", type=float, default=30.0,
                       help="seconds a request's headers, then its body, may take to arrive (default 30)")
    serve.add_argument("--write-timeout", type=float, default=30.0,
                       help="seconds a response may wait for its client to read before the request is "
                            "cancelled and the connection dropped (default 30)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="render chat templates sent with requests (in a sandboxed process, 1 s and 1 MiB of "
                            "text at most) instead of refusing them")


def _serve(args) -> int:
    from dew_lib.models.pretrained import CheckpointError, UnsupportedCheckpoint
    from dew_lib.sampling import Sampling
    from dew_lib.serve import ServeOptions, serve
    from dew_lib.serve.adapters import parse_lora_modules

    try:
        top_k = None if args.top_k in (None, 0, -1) else args.top_k
        sampling = Sampling(temperature=args.temperature, top_k=top_k, top_p=args.top_p, min_p=args.min_p)
        options = ServeOptions(  # the key from the environment keeps it out of `ps`
            api_key=args.api_key if args.api_key is not None else os.environ.get("DEW_SERVE_API_KEY") or None,
            max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens_limit,
            read_timeout=args.read_timeout, write_timeout=args.write_timeout,
            trust_request_chat_template=args.trust_request_chat_template)
        serve(args.directory, host=args.host, port=args.port, slots=args.slots, capacity=args.capacity,
              sampling=sampling, dtype=args.dtype, logprobs_mode=args.logprobs_mode,
              served_model_name=args.served_model_name, dev_endpoints=args.dev_endpoints, steps=args.steps,
              seed=args.seed, options=options, tensor_parallel_size=args.tensor_parallel_size,
              routing=args.enable_return_routed_experts,
              lora_modules=parse_lora_modules(args.lora))
    except (CheckpointError, UnsupportedCheckpoint, ValueError, OSError) as error:
        print(f"dew serve: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C after the graceful shutdown uvicorn ran
        return 130
    return 0


def _launch(args) -> int:
    from dew_lib.train.launch import launch

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    try:
        return launch(argv, args.processes, local_devices=args.local_devices)
    except (ValueError, OSError) as error:
        print(f"dew launch: {error}", file=sys.stderr)
        return 1


def _plan(args) -> int:
    """Plan in a child process whose JAX has one CPU device per device of the mesh (their
    count is fixed when JAX starts), unless this is that child."""
    from dew_lib.train.mesh import MeshSpec

    try:
        mesh = MeshSpec.parse(args.mesh)
    except ValueError as error:
        print(f"dew plan: {error}", file=sys.stderr)
        return 1
    mesh = dataclasses.replace(mesh, data=mesh.data or 1)  # on the planning host, data takes only what it is given
    if os.environ.get("DEW_PLAN_CHILD") != "1":
        import subprocess

        devices = f"--xla_force_host_platform_device_count={args.suggest or mesh.devices()}"
        env = {**os.environ, "DEW_PLAN_CHILD": "1", "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": " ".join([*os.environ.get("XLA_FLAGS", "").split(), devices])}
        given = sys.argv[1:] if args.argv_given is None else args.argv_given
        return subprocess.run([sys.executable, "-m", "dew_lib.cli", *given], env=env).returncode
    from dew_lib.train import plan

    config = None
    try:
        config, memory = plan.model_config(args.model), plan.device_bytes(args.device, args.device_bytes)
        if args.suggest is not None:
            choice = plan.suggest(config, devices=args.suggest, stage=args.stage, seq_len=args.seq_len,
                                  batch=args.batch, dtype=args.dtype, remat=args.remat, accumulate=args.accumulate,
                                  tensor=mesh.tensor, device=memory)
            print(choice.report(), flush=True)
            return 2 if memory is not None and choice.chosen is None else 0
        found = plan.plan(config, stage=args.stage, mesh=mesh, seq_len=args.seq_len, batch=args.batch,
                          dtype=args.dtype, remat=args.remat, accumulate=args.accumulate, device=memory)
    except (ValueError, OSError) as error:
        print(f"dew plan: {' '.join(str(error).split())}", file=sys.stderr)
        if config is not None:  # what the config holds, counted even where the decoder refuses it
            from dew_lib.train.plan_moe import count_parameters

            try:
                counted = count_parameters(config).describe().removeprefix("model: ")
                print(f"dew plan: the config counts {counted}", file=sys.stderr)
            except (ValueError, KeyError, TypeError):
                pass
        return 1
    print(found.report(), flush=True)
    return 2 if found.fits is False else 0


def _schema(table: str | None, out) -> int:
    from dew_lib.store.schema import TABLES

    if table is not None and table not in TABLES:
        print(f"dew: no table {table!r}; the tables are {', '.join(TABLES)}", file=sys.stderr)
        return 1
    for name, spec in TABLES.items():
        if table in (None, name):
            key = f" (rows keyed by {spec.key})" if spec.key else ""
            out.write(f"{name}: {spec.about}{key}\n")
            for column, kind, about in spec.columns:
                out.write(f"  {column:<20} {str(kind):<24} {about}\n")
            out.write("\n")
    return 0


def _damage_line(found: dict) -> str:
    where = ", ".join(f"{key} {found[key]}" for key in ("table", "run", "stage") if found.get(key) is not None)
    return f"{found['path']} ({where}): {found['reason']}" if where else f"{found['path']}: {found['reason']}"


def _health(store, args, out) -> int:
    """`dew store check` and `dew store repair` (dew_lib/store/health.py)."""
    from dew_lib.store import StoreNotFound, health

    if not store.exists():
        raise StoreNotFound(f"no run store at {store.project} (expected {store.directory}/format.json)")
    left: list[dict[str, Any]] = []  # what repair could not move aside
    if args.action == "check":
        found = health.check(store)
    else:
        found, left = health.repair(store)
    if args.form:
        keys = ["path", "kind", "table", "run", "stage", "reason"]
        keys += ["moved_to", "why"] if args.action == "repair" else []
        emit(keys, [tuple(os.path.join(store.directory, f["path"]) if k == "path" else f.get(k) for k in keys)
                    for f in found + left], args.form, 0, out)
    elif args.action == "check":
        for f in found:
            out.write(f"damaged: {_damage_line({**f, 'path': os.path.join(store.directory, f['path'])})}\n")
        out.write(f"{len(found)} damaged file{'s' if len(found) != 1 else ''} in {store.directory}"
                  + ("; queries read around damaged parts and rows; `dew store repair` moves them aside\n"
                     if found else "\n"))
    else:
        for f in found:
            out.write(f"moved aside: {os.path.join(store.directory, f['path'])} -> {f.get('moved_to')}\n")
        for f in left:
            out.write(f"left: {os.path.join(store.directory, f['path'])}: {f['why']}\n")
        out.write(f"repaired {len(found)}, left {len(left)}; the quarantine's log is "
                  f"{os.path.join(store.directory, health.QUARANTINE, 'log.jsonl')}\n")
    out.flush()
    return 1 if (found if args.action == "check" else left) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv_given = None if argv is None else list(argv)
    out = sys.stdout
    if args.command == "serve":
        return _serve(args)
    if args.command == "launch":
        return _launch(args)
    if args.command == "plan":
        return _plan(args)
    try:
        if args.command == "schema":
            return _schema(args.table, out)
        import duckdb

        from dew_lib.store import Store, StoreError

        try:
            store = Store(args.store)
            if args.command == "store":
                return _health(store, args, out)
            if args.command == "sql":
                columns, rows = store.rows(args.query)
            else:
                columns, rows = store.runs()
                damaged = store.damaged()
        except (duckdb.Error, StoreError, OSError) as error:
            print(f"dew: {' '.join(str(error).split())}", file=sys.stderr)  # one line
            return 1
        emit(columns, rows, args.form or "table", args.max_width, out)
        out.flush()
        if args.command == "runs" and damaged:  # the table leaves their streams out: say which
            for found in damaged:
                print(f"dew: left out of the figures above: {_damage_line(found)}", file=sys.stderr)
            print("dew: `dew store check` lists damaged files, `dew store repair` moves them aside",
                  file=sys.stderr)
    except BrokenPipeError:  # `dew sql ... | head`: the reader left; that is not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
