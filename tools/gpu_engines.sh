#!/usr/bin/env bash
# tools/gpu_engines.sh: Dew's remote-engine clients and weight pushes against a real vLLM on an
# NVIDIA GPU, in one run, ending in one summary table (exit status 1 when any step failed).
#
#   1. venvs under $WORK: one with vLLM ($VLLM_VERSION, torch comes with it), one with Dew
#      (`pip install -e .[test]` of this checkout plus JAX's CUDA plugin; no torch: checked)
#   2. a Qwen3-shaped checkpoint with random weights, written by Dew (tools/gpu_engines.py)
#   3. `vllm serve` on it with the flags Dew's completions client and pushes need
#      (VLLM_SERVER_DEV_MODE=1, --logprobs-mode processed_logprobs, --weight-transfer-config
#      '{"backend": "nccl"}'), /health awaited, its process group killed on exit, whatever happens
#   4. tests/test_real_engines.py against it (DEW_VLLM_URL): draws on /v1/completions, their
#      log-probs against vLLM's own prompt log-probs, errors
#   5. SafetensorsReload read back: the same weights give identical log-probs, changed ones move
#      them, the launch weights back give identical log-probs again
#   6. NCCLPush: the same read-back and the median push time, against the spec's 6.8-7.3 s for
#      Qwen3-0.6B (needs two GPUs: NCCL refuses two ranks on one GPU; skipped with one)
#   7. vLLM again with --enable-lora --max-lora-rank $LORA_RANK --max-loras 2 and
#      VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: AdapterReload pushes three adapter versions through
#      /v1/load_lora_adapter, each drawn from by its name, the oldest unloaded (tools/gpu_engines.py lora)
#   8. vLLM again with --enable-scale-out --return-sampling-mask, for the token route's tests: an
#      engine with that flag refuses every request without a top-k, /v1/completions included
#
# Run from anywhere:  bash tools/gpu_engines.sh        (needs nvidia-smi, pip access, ~15 GB disk)
#                     bash tools/gpu_engines.sh --dry-run
# --dry-run needs no GPU and no vLLM: `dew serve` stands in for vLLM (CPU, tiny model), so the
# checkpoint, launch, health wait, wire tests, reload read-back, cleanup and summary all run.
#
# Settings (environment):
#   WORK=/tmp/dew-gpu          scratch: venvs, checkpoint, logs
#   VLLM_VERSION=0.30.0        the vLLM the spec's routes were checked against
#   PYTHON=python3             makes the venvs (3.11 to 3.14)
#   JAX_CUDA=cuda12            JAX's CUDA plugin extra (cuda13 for a CUDA 13 driver)
#   PRESET=small               small: Qwen3-0.6B's widths, 4 layers; 0.6b: all 28 (1.1 GiB, the
#                              spec's size); LAYERS=N overrides the layer count
#   TOKENIZER=<repo>/../shared/data/tokenizers/qwen3 if present, else the hub id Qwen/Qwen3-0.6B
#   PORT=8123  HEALTH_TIMEOUT=900  PUSHES=5  VLLM_GPU_UTIL=0.8  VLLM_EXTRA_ARGS=  LORA_RANK=8
#   VLLM_GPU, TRAINER_GPU      GPU indices (default 1 and 0 with two or more GPUs, else both 0)
#   DEW_PYTHON, VLLM_BIN       reuse an existing Dew python / vllm executable instead of the venvs
#   NCCL_LIBRARY, NCCL_VERSION vLLM's libnccl.so.2 and its version (default: found in vLLM's venv)
#
# Not run on a GPU yet: written and dry-run on a CPU machine (see docs/inference.md).

# shellcheck disable=SC2329  # the step functions run through `step NAME FUNCTION`
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY_RUN=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_engines.sh: unknown argument $arg (use --dry-run or --help)" >&2; exit 2 ;;
  esac
done

WORK=${WORK:-/tmp/dew-gpu}
VLLM_VERSION=${VLLM_VERSION:-0.30.0}
PYTHON=${PYTHON:-python3}
JAX_CUDA=${JAX_CUDA:-cuda12}
PRESET=${PRESET:-small}
LAYERS=${LAYERS:-}
if [ -z "${TOKENIZER:-}" ]; then
  if [ -d "$ROOT/../shared/data/tokenizers/qwen3" ]; then
    TOKENIZER=$(cd "$ROOT/../shared/data/tokenizers/qwen3" && pwd)
  else
    TOKENIZER=Qwen/Qwen3-0.6B
  fi
fi
PORT=${PORT:-8123}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-900}
PUSHES=${PUSHES:-5}
VLLM_GPU_UTIL=${VLLM_GPU_UTIL:-0.8}
VLLM_EXTRA_ARGS=${VLLM_EXTRA_ARGS:-}
LORA_RANK=${LORA_RANK:-8}  # one of vLLM's --max-lora-rank choices (8, 16, 32, 64, ...)
MODEL_NAME=dew-qwen3-check
URL="http://127.0.0.1:$PORT"
CKPT="$WORK/checkpoint"
LOGS="$WORK/logs"
if [ "$DRY_RUN" = 1 ]; then
  PRESET=tiny
  ENGINE_KIND=dew
else
  ENGINE_KIND=vllm
fi
mkdir -p "$LOGS"

# ---- bookkeeping -----------------------------------------------------------------------------

NAMES=()
STATES=()
TIMES=()
DETAILS=()

record() {  # record NAME STATE SECONDS DETAIL
  NAMES+=("$1"); STATES+=("$2"); TIMES+=("$3"); DETAILS+=("$4")
  echo "== $1: $2${4:+ ($4)}"
}

failed() {  # failed NAME: did step NAME fail or not run?
  local i
  for i in "${!NAMES[@]}"; do
    if [ "${NAMES[$i]}" = "$1" ]; then [ "${STATES[$i]}" != PASS ]; return; fi
  done
  return 0
}

detail_of() {  # the "detail" of a JSON last line (tools/gpu_engines.py), else the last line itself
  local last
  last=$(grep -v '^[[:space:]]*$' "$1" | tail -n 1)
  "$PYTHON" -c 'import json, sys
try:
    print(json.loads(sys.argv[1])["detail"][:300])
except Exception:
    print(sys.argv[1][:300])' "$last" 2>/dev/null || echo "${last:0:300}"
}

step() {  # step NAME COMMAND...: run it in this shell, log to $LOGS/NAME.log, record PASS or FAIL
  local name=$1 start=$SECONDS rc tee_pid
  shift
  echo "== $name: $*"
  exec 9> >(tee "$LOGS/$name.log")  # fd 9, not a pipeline: the command's variables must survive
  tee_pid=$!
  "$@" >&9 2>&1
  rc=$?
  exec 9>&-
  wait "$tee_pid" 2>/dev/null  # the log is complete before it is read
  if [ "$rc" = 0 ]; then
    record "$name" PASS $((SECONDS - start)) "$(detail_of "$LOGS/$name.log")"
  else
    record "$name" FAIL $((SECONDS - start)) "exit $rc: $(detail_of "$LOGS/$name.log"); log $LOGS/$name.log"
  fi
}

skip() { record "$1" SKIP 0 "$2"; }

# ---- the engine, and always stopping it ------------------------------------------------------

ENGINE_PID=
ENGINE_PGID=

stop_engine() {
  [ -n "$ENGINE_PID" ] || return 0
  local target=$ENGINE_PID i
  [ -n "$ENGINE_PGID" ] && target="-$ENGINE_PGID"
  kill -TERM -- "$target" 2>/dev/null
  for i in $(seq 1 30); do
    kill -0 "$ENGINE_PID" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- "$target" 2>/dev/null
  wait "$ENGINE_PID" 2>/dev/null
  ENGINE_PID=
}
trap stop_engine EXIT
trap 'stop_engine; exit 130' INT
trap 'stop_engine; exit 143' TERM

start_engine() {  # start_engine completions|lora|token: the server in its own session (setsid)
  local mode=$1 flags=() lora_updating=False log="$LOGS/server-$1.log"  # the engine's own output
  [ "$mode" = token ] && flags=(--enable-scale-out --return-sampling-mask)
  # two adapters at once: the newest version and the one draws in flight may still use
  [ "$mode" = lora ] && flags=(--enable-lora --max-lora-rank "$LORA_RANK" --max-loras 2) && lora_updating=True
  if curl -s -o /dev/null "$URL/health" 2>/dev/null; then
    echo "something already answers on $URL; stop it or set PORT"
    return 1
  fi
  if [ "$ENGINE_KIND" = vllm ]; then
    # --enable-return-routed-experts is left out: Dew writes dense checkpoints, which route nothing.
    # --return-tokens-as-token-ids is not needed: Dew's client asks for it in every request.
    # shellcheck disable=SC2086  # VLLM_EXTRA_ARGS is a list of flags
    (export VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING="$lora_updating" CUDA_VISIBLE_DEVICES="$VLLM_GPU"
     [ -n "$NCCL_LIBRARY" ] && export VLLM_NCCL_SO_PATH="$NCCL_LIBRARY"
     exec setsid "$VLLM_BIN" serve "$CKPT" --host 127.0.0.1 --port "$PORT" \
       --served-model-name "$MODEL_NAME" --dtype bfloat16 --max-model-len 2048 --seed 0 \
       --gpu-memory-utilization "$VLLM_GPU_UTIL" \
       --logprobs-mode processed_logprobs --weight-transfer-config '{"backend": "nccl"}' \
       ${flags[@]+"${flags[@]}"} $VLLM_EXTRA_ARGS) > "$log" 2>&1 9>&- &
  else
    (exec setsid "$DEW_BIN/dew" serve "$CKPT" --host 127.0.0.1 --port "$PORT" \
       --served-model-name "$MODEL_NAME" --slots 4 --capacity 512 --dev-endpoints) > "$log" 2>&1 9>&- &
  fi
  ENGINE_PID=$!
  sleep 1
  ENGINE_PGID=$(ps -o pgid= -p "$ENGINE_PID" 2>/dev/null | tr -d ' ')
  [ "$ENGINE_PGID" = "$ENGINE_PID" ] || ENGINE_PGID=  # setsid forked: kill the process itself
  local waited=0
  until curl -sf "$URL/health" > /dev/null 2>&1 && curl -sf "$URL/v1/models" > /dev/null 2>&1; do
    if ! kill -0 "$ENGINE_PID" 2>/dev/null; then
      echo "the engine exited before answering /health; the end of $log:"
      tail -n 40 "$log"
      return 1
    fi
    if [ "$waited" -ge "$HEALTH_TIMEOUT" ]; then
      echo "no answer on $URL/health within ${HEALTH_TIMEOUT}s; the end of $log:"
      tail -n 40 "$log"
      return 1
    fi
    sleep 5
    waited=$((waited + 5))
  done
  echo "$ENGINE_KIND ($mode) answers on $URL after ${waited}s (pid $ENGINE_PID; log $log)"
}

# ---- the steps -------------------------------------------------------------------------------

check_python() {
  "$PYTHON" -c 'import sys; v = sys.version_info[:2]
sys.exit(0 if (3, 11) <= v < (3, 15) else f"{sys.executable} is Python {v}; Dew needs 3.11+, vLLM below 3.15 (set PYTHON)")' \
    && "$PYTHON" --version
}

gpus() {
  nvidia-smi -L && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
}

install_vllm() {
  [ -x "$WORK/vllm-venv/bin/python" ] || "$PYTHON" -m venv "$WORK/vllm-venv" || return 1
  "$WORK/vllm-venv/bin/pip" install --quiet --upgrade pip || return 1
  "$WORK/vllm-venv/bin/pip" install "vllm==$VLLM_VERSION" || return 1
  "$WORK/vllm-venv/bin/vllm" --version
}

install_dew() {
  [ -x "$WORK/dew-venv/bin/python" ] || "$PYTHON" -m venv "$WORK/dew-venv" || return 1
  "$WORK/dew-venv/bin/pip" install --quiet --upgrade pip || return 1
  "$WORK/dew-venv/bin/pip" install --quiet -e "${ROOT}[test]" || return 1
  local jax_version
  jax_version=$("$WORK/dew-venv/bin/python" -c 'import jax; print(jax.__version__)') || return 1
  if [ "$DRY_RUN" = 0 ]; then  # JAX's CUDA plugin, matching the jax Dew installed (as `make bench-gpu`)
    "$WORK/dew-venv/bin/pip" install --quiet "jax[$JAX_CUDA]==$jax_version" || return 1
  fi
  no_torch "$WORK/dew-venv/bin/python" \
    && env -u JAX_PLATFORMS "$WORK/dew-venv/bin/python" -c 'import jax; print("jax", jax.__version__, jax.devices())'
}

no_torch() {  # Dew's environment must not hold torch (Dew never imports it; NCCLPush uses ctypes)
  "$1" -c 'import importlib.util, sys
sys.exit("torch is installed in Dew'"'"'s environment; it must not be" if importlib.util.find_spec("torch") else 0)' \
    && echo "no torch in $1"
}

write_checkpoint() {
  # shellcheck disable=SC2046  # --layers N only when LAYERS is set
  JAX_PLATFORMS=cpu "$DEW_PY" "$ROOT/tools/gpu_engines.py" checkpoint --out "$CKPT" --preset "$PRESET" \
    --tokenizer "$TOKENIZER" $([ -n "$LAYERS" ] && echo --layers "$LAYERS")
}

wire_tests() {  # wire_tests completions|token: the module's tests for that launch
  local mode=$1 out="$LOGS/tests-$1.pytest" mask=0 select="not mask"
  [ "$mode" = token ] && mask=1 select=mask
  (cd "$ROOT" && JAX_PLATFORMS=cpu DEW_VLLM_URL="$URL" DEW_VLLM_MODEL="$MODEL_NAME" \
     DEW_VLLM_ENGINE="$ENGINE_KIND" DEW_VLLM_SAMPLING_MASK="$mask" \
     "$DEW_PY" -m pytest -q -rs -p no:cacheprovider -k "$select" tests/test_real_engines.py) > "$out" 2>&1
  local rc=$?
  cat "$out"
  if [ "$rc" = 0 ] && [ "$ENGINE_KIND" = vllm ] && grep -q ' skipped' "$out"; then
    echo "tests skipped against vLLM itself: $(tail -n 1 "$out")"
    rc=1
  fi
  return "$rc"
}

reload_read_back() {
  local extra=()
  [ "$ENGINE_KIND" = dew ] && extra=(--no-prompt-logprobs)
  JAX_PLATFORMS=cpu "$DEW_PY" "$ROOT/tools/gpu_engines.py" reload --url "$URL" --dir "$CKPT" ${extra[@]+"${extra[@]}"}
}

lora_push() {
  local extra=()
  [ "$ENGINE_KIND" = dew ] && extra=(--no-prompt-logprobs)
  JAX_PLATFORMS=cpu "$DEW_PY" "$ROOT/tools/gpu_engines.py" lora --url "$URL" --dir "$CKPT" --rank "$LORA_RANK" \
    ${extra[@]+"${extra[@]}"}
}

nccl_push() {
  local version=()
  [ -n "$NCCL_VERSION" ] && version=(--nccl-version "$NCCL_VERSION")
  env -u JAX_PLATFORMS CUDA_VISIBLE_DEVICES="$TRAINER_GPU" XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$DEW_PY" "$ROOT/tools/gpu_engines.py" nccl --url "$URL" --dir "$CKPT" --library "$NCCL_LIBRARY" \
    --pushes "$PUSHES" ${version[@]+"${version[@]}"}
}

summary() {
  local i bad=0
  echo
  echo "tools/gpu_engines.sh summary ($([ "$DRY_RUN" = 1 ] && echo "dry run: dew serve, CPU" || echo "vLLM $VLLM_VERSION")," \
    "preset $PRESET${LAYERS:+, $LAYERS layers}; logs in $LOGS)"
  printf '%-16s %-5s %7s  %s\n' step state seconds detail
  printf '%-16s %-5s %7s  %s\n' ---- ----- ------- ------
  for i in "${!NAMES[@]}"; do
    printf '%-16s %-5s %7s  %s\n' "${NAMES[$i]}" "${STATES[$i]}" "${TIMES[$i]}" "${DETAILS[$i]}"
    [ "${STATES[$i]}" = FAIL ] && bad=1
  done
  return "$bad"
}

# ---- the run ---------------------------------------------------------------------------------

step python check_python
if failed python; then summary; exit 1; fi

ENGINE_READY=0
if [ "$DRY_RUN" = 1 ]; then
  ENGINE_READY=1
  skip gpus "dry run"
  skip vllm-install "dry run: dew serve stands in for vLLM"
  VLLM_GPU=
  TRAINER_GPU=
else
  step gpus gpus
  COUNT=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "${COUNT:-0}" -ge 2 ]; then
    VLLM_GPU=${VLLM_GPU:-1}
    TRAINER_GPU=${TRAINER_GPU:-0}
  else
    VLLM_GPU=${VLLM_GPU:-0}
    TRAINER_GPU=${TRAINER_GPU:-0}
  fi
  if failed gpus; then
    skip vllm-install "no GPU answered nvidia-smi (--dry-run runs without one)"
  elif [ -n "${VLLM_BIN:-}" ]; then
    skip vllm-install "VLLM_BIN=$VLLM_BIN"
    ENGINE_READY=1
  else
    step vllm-install install_vllm
    VLLM_BIN="$WORK/vllm-venv/bin/vllm"
    failed vllm-install || ENGINE_READY=1
  fi
fi

if [ -n "${DEW_PYTHON:-}" ]; then
  DEW_PY=$DEW_PYTHON
  step dew-env no_torch "$DEW_PY"
else
  step dew-install install_dew
  DEW_PY="$WORK/dew-venv/bin/python"
fi
DEW_BIN=$(dirname "$DEW_PY")

if failed dew-install && failed dew-env; then
  skip checkpoint "needs Dew's environment"
else
  step checkpoint write_checkpoint
fi

# The NCCL library both sides load: the trainer by path, vLLM through VLLM_NCCL_SO_PATH (otherwise it
# loads "libnccl.so.2" by name, which resolves to torch's); NCCL refuses a peer of another version.
NCCL_LIBRARY=${NCCL_LIBRARY:-}
NCCL_VERSION=${NCCL_VERSION:-}
VLLM_ENV=
if [ "$ENGINE_KIND" = vllm ] && [ "$ENGINE_READY" = 1 ]; then
  VLLM_ENV=$(dirname "$(dirname "$VLLM_BIN")")
  NCCL_LIBRARY=${NCCL_LIBRARY:-$(find "$VLLM_ENV" -name libnccl.so.2 -path '*nvidia*' 2>/dev/null | head -n 1)}
  NCCL_VERSION=${NCCL_VERSION:-$("$VLLM_ENV/bin/python" -c \
    'import torch; print(".".join(map(str, torch.cuda.nccl.version()[:3])))' 2>/dev/null || true)}
fi

if failed checkpoint || [ "$ENGINE_READY" = 0 ]; then
  skip engine "needs the checkpoint and the engine installed"
else
  step engine start_engine completions
fi

if failed engine; then
  skip wire-tests "needs a running engine"
  skip reload "needs a running engine"
  skip nccl "needs a running engine"
else
  step wire-tests wire_tests completions
  step reload reload_read_back
  if [ "$ENGINE_KIND" = dew ]; then
    skip nccl "dry run: NCCLPush needs vLLM and GPUs"
  elif [ "$VLLM_GPU" = "$TRAINER_GPU" ]; then
    skip nccl "one GPU: NCCL refuses two ranks on the same GPU (Duplicate GPU detected); needs two"
  elif [ -z "$NCCL_LIBRARY" ]; then
    record nccl FAIL 0 "no libnccl.so.2 under vLLM's environment $VLLM_ENV (set NCCL_LIBRARY)"
  else
    echo "NCCL library $NCCL_LIBRARY (version ${NCCL_VERSION:-unknown}); trainer GPU $TRAINER_GPU, vLLM GPU $VLLM_GPU"
    step nccl nccl_push
  fi
fi

stop_engine
if failed checkpoint || [ "$ENGINE_READY" = 0 ]; then
  skip engine-lora "needs the checkpoint and the engine installed"
  skip lora "needs a running engine"
else  # dew serve answers the same LoRA routes under --dev-endpoints, so the dry run runs this too
  step engine-lora start_engine lora
  if failed engine-lora; then
    skip lora "needs a running engine"
  else
    step lora lora_push
  fi
  stop_engine
fi

if [ "$ENGINE_KIND" = dew ]; then
  skip engine-token "dry run: dew serve has no token route"
  skip token-tests "dry run: dew serve has no token route"
elif failed checkpoint || [ "$ENGINE_READY" = 0 ]; then
  skip engine-token "needs the checkpoint and the engine installed"
  skip token-tests "needs a running engine"
else
  step engine-token start_engine token
  if failed engine-token; then
    skip token-tests "needs a running engine"
  else
    step token-tests wire_tests token
  fi
  stop_engine
fi
summary
exit $?
