#!/bin/sh
# One GPU call that does three things, each bounded so the whole fits the device's 600 s per command (machines
# are scarce: one start, three results). Run from the repository root on the GPU machine with
#   carry: [".gpu/sglang-pack/carry", ".gpu/ple-metrics"]
#   command: sh benchmarks/gpu_server/combined_call.sh <commit of this checkout> [server seconds] [scenarios]
# (a shorter call when less device time is left: fewer server seconds, fewer scenarios)
# 1. sglang 0.5.23's own server with CUDA graphs: decode graphs with the sidecar and with the RAM table, and
#    sglang's default prefill graphs with the RAM table (is the failed prefill capture the sidecar's host node?).
# 2. The in-place PLE sidecar against the copied one, lookups into CUDA tensors (benchmarks/ple_in_place).
# 3. The metrics' overhead per lookup, on and off alternating (benchmarks/ple_metrics/gpu_overhead.py), twice.
set -u
commit=${1:?usage: combined_call.sh COMMIT [SERVER_SECONDS] [SCENARIOS]}
server_s=${2:-335}
scenarios=${3:-sidecar-graph,ram-graph,ram-graph-prefill}
mkdir -p "$OUT"
{ echo "commit $commit"; date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } \
    >"$OUT/machine.txt" 2>&1
timeout $((server_s + 15)) python3 scripts/gpu/sglang_server_gpu.py serve --carry .gpu/sglang-pack/carry --out "$OUT/server" \
    --deadline "$server_s" --no-import-probe --first-budget 200 --budget 120 --keep-going \
    --scenarios "$scenarios" \
    --reference benchmarks/gpu_server/call5-h100/results.json >"$OUT/server-runner.log" 2>&1
echo "server rc $?" >>"$OUT/machine.txt"
BENCH_COMMIT=$commit PYTHONPATH=. timeout 160 python3 benchmarks/ple_in_place/bench.py --quick \
    --out "$OUT/ple_in_place" --work /tmp/ple-in-place >"$OUT/ple_in_place.log" 2>&1
echo "ple_in_place rc $?" >>"$OUT/machine.txt"
for i in 1 2; do
    timeout 35 python3 benchmarks/ple_metrics/gpu_overhead.py --site .gpu/ple-metrics --quick --commit "$commit" \
        --out "$OUT/ple_metrics_run$i.json" >"$OUT/ple_metrics_run$i.log" 2>&1
    echo "ple_metrics run $i rc $?" >>"$OUT/machine.txt"
done
cat "$OUT/machine.txt"
tail -25 "$OUT/server-runner.log"
