#!/usr/bin/env bash
# N kvserve replicas behind SGLang Model Gateway, all on this machine (loopback by default).
#
#   deploy/router/run_local.sh [-n REPLICAS] [-p POLICY] [-- KVSERVE_SERVE_ARGS...]
#
#   -n  replicas (default 2), on ports BASE_PORT, BASE_PORT+1, ... (BASE_PORT default 8001)
#   -p  gateway policy: cache_aware (default), round_robin, power_of_two, random
#   after --: passed to every `kvserve serve` (e.g. -- --model /models/llama.gguf --max-num-seqs 64)
#
# Environment: HOST (default 127.0.0.1), GATEWAY_PORT (8000), GATEWAY_METRICS_PORT (29000),
# BASE_PORT (8001), THREADS_PER_REPLICA (OMP_NUM_THREADS of each replica; default: cores / N),
# RUN_DIR (logs and pid files; default ./router-run), KVSERVE and SGLANG_ROUTER (the commands).
#
# Clients talk to http://HOST:GATEWAY_PORT/v1 as to one kvserve. Ctrl-C (or SIGTERM) stops the
# gateway first, then drains every replica (SIGTERM: in-flight requests finish).
set -euo pipefail

replicas=2
policy=cache_aware
while getopts "n:p:h" opt; do
    case "$opt" in
        n) replicas=$OPTARG ;;
        p) policy=$OPTARG ;;
        h) sed -n '2,16p' "$0"; exit 0 ;;
        *) sed -n '2,16p' "$0" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
if ! [[ "$replicas" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_local.sh: -n must be a positive integer, got '$replicas'" >&2
    exit 2
fi

host=${HOST:-127.0.0.1}
base_port=${BASE_PORT:-8001}
gateway_port=${GATEWAY_PORT:-8000}
gateway_metrics_port=${GATEWAY_METRICS_PORT:-29000}
run_dir=${RUN_DIR:-./router-run}
kvserve=${KVSERVE:-kvserve}
sglang_router=${SGLANG_ROUTER:-sglang-router}
cores=$(nproc)
threads=${THREADS_PER_REPLICA:-$(( cores / replicas > 0 ? cores / replicas : 1 ))}
mkdir -p "$run_dir"

pids=()
stop_all() {
    trap - INT TERM EXIT
    # Gateway first (its pid is last), so no new request reaches a draining replica.
    for (( i=${#pids[@]}-1; i>=0; i-- )); do
        kill -TERM "${pids[$i]}" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap stop_all INT TERM EXIT

worker_urls=()
for (( i=0; i<replicas; i++ )); do
    port=$((base_port + i))
    OMP_NUM_THREADS=$threads "$kvserve" serve --host "$host" --port "$port" "$@" \
        >"$run_dir/kvserve-$i.log" 2>&1 &
    pids+=("$!")
    echo "$!" >"$run_dir/kvserve-$i.pid"
    worker_urls+=("http://$host:$port")
done

# The gateway takes a worker once it answers /health; waiting here makes start-up errors visible.
for (( i=0; i<replicas; i++ )); do
    url=${worker_urls[$i]}
    until curl -sf -o /dev/null "$url/health"; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            echo "kvserve replica $i exited; its log ($run_dir/kvserve-$i.log) ends with:" >&2
            tail -n 20 "$run_dir/kvserve-$i.log" >&2
            exit 1
        fi
        sleep 1
    done
    echo "replica $i ready at $url"
done

# Health every 5 s and out after 2 failures: a crashed replica leaves the rotation quickly; the
# gateway retries a failed request on another worker meanwhile.
"$sglang_router" launch --host "$host" --port "$gateway_port" \
    --prometheus-host "$host" --prometheus-port "$gateway_metrics_port" \
    --worker-urls "${worker_urls[@]}" --policy "$policy" \
    --health-check-endpoint /health --health-check-interval-secs 5 --health-failure-threshold 2 \
    --log-level info >"$run_dir/gateway.log" 2>&1 &
pids+=("$!")
echo "$!" >"$run_dir/gateway.pid"

until curl -sf -o /dev/null "http://$host:$gateway_port/readiness"; do
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then
        echo "the gateway exited; $run_dir/gateway.log ends with:" >&2
        tail -n 20 "$run_dir/gateway.log" >&2
        exit 1
    fi
    sleep 1
done
echo "gateway ($policy) ready at http://$host:$gateway_port/v1 (metrics: http://$host:$gateway_metrics_port/metrics); Ctrl-C stops everything"
wait "${pids[-1]}"
