#!/usr/bin/env bash
# Starts one real vLLM engine (CPU build, tiny Qwen3 with random weights) the
# way kvroute's real-vLLM tests and `kvroute-bench --engine vllm` run it: KV
# events on ZMQ, the kvroute_hooks snapshot plugin, prefix caching on, and a
# small KV capacity so evictions happen. Needs scripts/install-vllm.sh first.
#
#   scripts/vllm-serve.sh --port 8001 --events-port 5557 --replay-port 5558 \
#       --snapshot-port 5560 [--num-blocks 256] [--block-size 32] [-- more vllm flags]
#
# The model is `tiny-qwen3`: ../shared/testdata/models/tiny-qwen3's config (written
# here when that folder is absent) beside the Qwen3 tokenizer files, weights
# random (`--load-format dummy`): routing needs real token ids and a real KV
# cache, not good answers. Facts this relies on, checked with vLLM 0.32.0:
# - the CPU attention backend needs a block size that is a multiple of 32;
# - vLLM binds its event endpoints only when they contain `*` (else its PUB
#   socket connects, and a sidecar connecting to it receives nothing);
# - `--num-gpu-blocks-override` sets the KV capacity, `--max-model-len` must fit in it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${KVROUTE_VLLM_VENV:-$root/target/vllm-venv}
port= events= replay= snapshot= blocks=256 block_size=32 host=127.0.0.1
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port=$2; shift 2 ;;
    --host) host=$2; shift 2 ;;
    --events-port) events=$2; shift 2 ;;
    --replay-port) replay=$2; shift 2 ;;
    --snapshot-port) snapshot=$2; shift 2 ;;
    --num-blocks) blocks=$2; shift 2 ;;
    --block-size) block_size=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "vllm-serve.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for v in port events replay snapshot; do
  flag=--$v-port; [ "$v" = port ] && flag=--port
  [ -n "${!v}" ] || { echo "vllm-serve.sh: $flag is required" >&2; exit 2; }
done
[ -x "$venv/bin/vllm" ] || { echo "vllm-serve.sh: no vLLM in $venv: run scripts/install-vllm.sh" >&2; exit 1; }

model=$("$root/scripts/tiny-model.sh")

# Context length: what fits in the KV capacity (vLLM keeps one block back, the
# null block), at most 4096.
max_len=$(( (blocks - 1) * block_size ))
[ "$max_len" -gt 4096 ] && max_len=4096

export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# vLLM pins its OpenMP thread to core 0 by default: several engines on one
# small machine would then share that core while the others idle.
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Dev mode serves POST /reset_prefix_cache, which the tests use (a test engine;
# never set it on a production vLLM).
export VLLM_SERVER_DEV_MODE=${VLLM_SERVER_DEV_MODE:-1}
export KVROUTE_SNAPSHOT_ENDPOINT="tcp://127.0.0.1:$snapshot"
exec "$venv/bin/vllm" serve "$model" \
  --served-model-name tiny-qwen3 --host "$host" --port "$port" \
  --load-format dummy --enforce-eager --dtype bfloat16 \
  --block-size "$block_size" --num-gpu-blocks-override "$blocks" --max-model-len "$max_len" \
  --enable-prefix-caching --enable-prompt-tokens-details \
  --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$events\",\"replay_endpoint\":\"tcp://*:$replay\"}" \
  "${extra[@]}"
