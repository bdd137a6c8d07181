#!/usr/bin/env bash
# Two vLLM servers share one lmcache_async sidecar (or one Redis) and publish their KV events
# to a KV-aware router's index, NVIDIA Dynamo's standalone indexer.
#
#   examples/vllm_fleet.sh --make-model DIR            # a tiny random Llama, no tokenizer
#   examples/vllm_fleet.sh DIR [--redis URL] [--keep]  # stand the fleet up and use it
#   examples/vllm_fleet.sh --dry-run [DIR]             # print the commands, check their flags
#
# Needs lmcache_async with its vllm and router extras (pip install -e '.[vllm,router]'),
# Linux (setsid) and curl. Each server listens on a free loopback port:
#   1. lmcache-async serve on an ipc:// socket, publishing its tiers' blocks (--events);
#   2. two `vllm serve` (python -m vllm.entrypoints.openai.api_server) with the connector
#      (sidecar_url; sidecar_events: each server's --kv-events-config stream carries the
#      sidecar's blocks beside its own) and prompts as token ids (--skip-tokenizer-init).
#      With --redis URL, no sidecar: each server's embedded cache keeps its chunks there;
#   3. the index, subscribed to both streams as workers 1 and 2 (its HTTP on all interfaces);
#      a router POSTs /query {"token_ids": [...], "model_name": "tiny"} for each worker's
#      match. llm-d's KV-cache indexer would subscribe to the same two endpoints.
#        python -m dynamo.indexer --port PORT --block-size 32 --model-name tiny \
#            --workers "1=tcp://127.0.0.1:EVENTS1,2=tcp://127.0.0.1:EVENTS2"
# A prompt sent to server 1 shows in the index under worker 1; sent to server 2, it is
# loaded by the connector. Everything is stopped at the end (--keep: at Ctrl-C); every wait
# is bounded. --dry-run starts no vLLM: vLLM's own parser and the connector's settings check
# both servers' flags, and the sidecar and the indexer start as shown, answer, and stop.
set -euo pipefail

MODEL="" DRY_RUN=0 KEEP=0 REDIS="" NAME=tiny BLOCK=32 CHUNK=64 START_TIMEOUT=300
while (($#)); do
    case $1 in
        --make-model)  # 2 layers, vocabulary 1024, random weights of a fixed seed
            python -m lmcache_async.bench.tiny_llama "$2"
            echo "model saved in $2"; exit 0 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --keep) KEEP=1; shift ;;
        --redis) REDIS=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
        *) MODEL=$1; shift ;;
    esac
done
if [[ -z $MODEL ]]; then
    ((DRY_RUN)) || { echo "give a model directory (see --help)" >&2; exit 2; }
    MODEL=MODEL_DIR
fi

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB of KV cache for vLLM on CPU
WORK=$(mktemp -d)
declare -A PID_OF=()
stop_all() {  # each process group started here: SIGTERM, then SIGKILL after 20 s
    local pid
    for pid in "${PID_OF[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for pid in "${PID_OF[@]}"; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap stop_all EXIT
trap 'exit 130' INT TERM

show() {  # print a command as one could paste it
    local line="" arg
    for arg in "$@"; do
        if [[ $arg =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then line+="$arg "; else line+="'$arg' "; fi
    done
    echo "  \$ ${line% }"
}
start() {  # start NAME COMMAND...: in a process group of its own, its output in WORK/NAME.log
    show "${@:2}"
    setsid "${@:2}" >"$WORK/$1.log" 2>&1 &
    PID_OF[$1]=$!
}
wait_for() {  # wait_for NAME SECONDS COMMAND...: until COMMAND succeeds, while NAME runs
    local deadline=$((SECONDS + $2))
    until "${@:3}" >/dev/null 2>&1; do
        if ! kill -0 "${PID_OF[$1]}" 2>/dev/null || ((SECONDS > deadline)); then
            echo "$1 did not come up or answer; the end of its log:" >&2
            tail -n 30 "$WORK/$1.log" >&2
            exit 1
        fi
        sleep 0.5
    done
}
health() { curl -sf --max-time 2 "http://127.0.0.1:$1/health"; }

read -r PORT1 PORT2 EVENTS1 EVENTS2 SIDECAR_EVENTS INDEXER < <(python -c '
import socket
socks = [socket.socket() for _ in range(6)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
SIDECAR=ipc://$WORK/lmcache.sock
SERVE=(lmcache-async --log-level WARNING serve --listen "$SIDECAR" --chunk-size "$CHUNK"
       --max-local-cpu-size 1 --events "tcp://127.0.0.1:$SIDECAR_EVENTS")
if [[ -n $REDIS ]]; then
    EXTRA="{\"remote_url\": \"$REDIS\", \"chunk_size\": $CHUNK, \"max_local_cpu_size\": 1}"
else
    EXTRA="{\"sidecar_url\": \"$SIDECAR\", \"chunk_size\": $CHUNK, "
    EXTRA+="\"sidecar_events\": \"tcp://127.0.0.1:$SIDECAR_EVENTS\"}"
fi
CONNECTOR="{\"kv_connector\": \"LMCacheAsyncConnector\", \"kv_role\": \"kv_both\", "
CONNECTOR+="\"kv_connector_module_path\": \"lmcache_async.integrations.vllm\", "
CONNECTOR+="\"kv_load_failure_policy\": \"recompute\", \"kv_connector_extra_config\": $EXTRA}"
vllm_command() {  # vllm_command PORT EVENTS_PORT: sets VLLM
    local events="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
    events+="\"endpoint\": \"tcp://*:$2\"}"
    VLLM=(python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$1"
          --served-model-name "$NAME" --host 127.0.0.1 --skip-tokenizer-init --enforce-eager
          --block-size "$BLOCK" --max-model-len 1024 --num-gpu-blocks-override 64
          --enable-prompt-tokens-details --kv-transfer-config "$CONNECTOR"
          --kv-events-config "$events")
}
INDEX=(python -m dynamo.indexer --port "$INDEXER" --block-size "$BLOCK" --model-name "$NAME"
       --workers "1=tcp://127.0.0.1:$EVENTS1,2=tcp://127.0.0.1:$EVENTS2")

if ((DRY_RUN)); then
    vllm_command "$PORT1" "$EVENTS1"; FIRST=("${VLLM[@]:3}"); show "${VLLM[@]}"
    vllm_command "$PORT2" "$EVENTS2"; SECOND=("${VLLM[@]:3}"); show "${VLLM[@]}"
    # vLLM's own parser, then the connector's settings; vLLM's import chatter goes to a log.
    if ! python - "${FIRST[@]}" ::: "${SECOND[@]}" >"$WORK/check.log" 2>&1 <<'PY'; then
import sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
from lmcache_async.integrations.vllm import ConnectorSettings
split = sys.argv.index(":::")
for argv in (sys.argv[1:split], sys.argv[split + 1 :]):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    ConnectorSettings.from_extra_config(args.kv_transfer_config.kv_connector_extra_config)
PY
        cat "$WORK/check.log" >&2; exit 1
    fi
    echo "vLLM and the connector accept both servers' flags"
fi
if [[ -z $REDIS ]]; then
    start sidecar "${SERVE[@]}"
    wait_for sidecar 60 lmcache-async ctl health --url "$SIDECAR" --timeout 2
    echo "sidecar: healthy"
fi
if ((!DRY_RUN)); then
    vllm_command "$PORT1" "$EVENTS1"; start vllm1 "${VLLM[@]}"
    vllm_command "$PORT2" "$EVENTS2"; start vllm2 "${VLLM[@]}"
    echo "waiting for both vLLM servers (up to $START_TIMEOUT s; logs in $WORK)"
    wait_for vllm1 "$START_TIMEOUT" health "$PORT1"
    wait_for vllm2 "$START_TIMEOUT" health "$PORT2"
fi
# Started after the servers, so that it subscribes to their streams at once.
start indexer "${INDEX[@]}"
wait_for indexer 60 health "$INDEXER"
echo "indexer: answers on http://127.0.0.1:$INDEXER"
((DRY_RUN)) && exit 0

complete() {  # complete PORT TOKENS: "CACHED of PROMPT" tokens of a one-token completion
    curl -sf --max-time 300 "http://127.0.0.1:$1/v1/completions" \
        -H 'Content-Type: application/json' \
        -d "{\"model\": \"$NAME\", \"prompt\": $2, \"max_tokens\": 1}" | python -c '
import json, sys
usage = json.load(sys.stdin)["usage"]
cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
print(cached, "of", usage["prompt_tokens"])'
}
match() {  # match WORKER TOKENS: what the index says that worker holds of TOKENS ({}: none)
    curl -sf --max-time 10 "http://127.0.0.1:$INDEXER/query" \
        -H 'Content-Type: application/json' \
        -d "{\"token_ids\": $2, \"model_name\": \"$NAME\"}" | python -c '
import json, sys
print(json.dumps(json.load(sys.stdin)["instances"].get(sys.argv[1], {})))' "$1"
}
holds() { [[ $(match "$1" "$2") != "{}" ]]; }
PROBES=0
probe() {  # probe WORKER: a new prompt to WORKER's server; fails until the index shows it
    local port=$PORT1 tokens="[$((++PROBES)), $(seq -s ', ' 101 163)]"  # 2 blocks, unseen
    [[ $1 == 2 ]] && port=$PORT2
    complete "$port" "$tokens" >/dev/null && holds "$1" "$tokens"
}
wait_for indexer 60 probe 1
wait_for indexer 60 probe 2
echo "indexer: sees both servers' KV events"

PROMPT=$(python -c 'print(list(range(10, 330)))')  # 320 token ids: 10 blocks, 5 chunks
echo "server 1: $(complete "$PORT1" "$PROMPT") prompt tokens cached"
wait_for indexer 60 holds 1 "$PROMPT"
echo "index: worker 1 holds the prompt: $(match 1 "$PROMPT")"
echo "server 2: $(complete "$PORT2" "$PROMPT") prompt tokens cached (the connector loaded them)"
wait_for indexer 60 holds 2 "$PROMPT"
echo "index: worker 2 holds it too: $(match 2 "$PROMPT")"
if ((KEEP)); then echo "running; Ctrl-C stops everything"; wait; fi
