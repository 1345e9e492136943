#!/usr/bin/env bash
# The GPU checks of record, on a machine with a CUDA GPU and no network: install flashx from this
# tree, then grade every backend available on CUDA with the conformance suite, or run the benchmark
# sweep, or both. What is meant to be committed lands in $OUT (default /tmp/flashx-out); the logs
# beside it; a short table last.
#
#   scripts/gpu.sh conformance     # flashx info and demo, then the suite per backend (cases, properties,
#                                  # slow tier, each in a time box) -> $OUT/conformance-<device>.md
#   scripts/gpu.sh bench           # the full sweep, as the device's record (flashx bench --record):
#                                  # $OUT/<device>.json, .md, .png and history.csv (the tree's, with this run's rows)
#   scripts/gpu.sh bench ARGS...   # a partial sweep (say --quick, --impl flashx-triton flex) -> $OUT, not the record
#   scripts/gpu.sh all             # conformance, then the full sweep
#
# Copy $OUT's record files into benchmarks/results/ and commit them. Time boxes (seconds):
# CONFORMANCE_SECONDS (cases and properties, side by side; 360), SLOW_SECONDS (150), BENCH_SECONDS (500).
set -uo pipefail
OUT=${OUT:-/tmp/flashx-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
device=$(python3 -c "import torch; from flashx_bench.records import device_slug; print(device_slug(torch.cuda.get_device_name()))")

conformance() {
    flashx info 2>&1 | tee "$OUT/info.txt"
    flashx demo 2>&1 | tee -a "$OUT/info.txt"
    # pytest-xdist, where installed, spreads the cases (compile-bound) over the cores; the slow
    # tier's multi-GiB cases then run alone.
    workers=$(python3 -c "import xdist" 2>/dev/null && printf -- "-n %s" "${CONFORMANCE_WORKERS:-8}")
    two=${workers:+-n 2}
    for backend in $(python3 -c "import flashx; print(' '.join(i.name for i in flashx.backends() if i.available and 'cuda' in i.devices))"); do
        run_part() {  # name, -m expression, -k expression, seconds, pytest-xdist option
            # SIGINT lets pytest finish its report when the time box closes
            timeout -s INT "$4" python3 -m pytest --pyargs flashx_conformance --flashx-backend "$backend" \
                --flashx-device cuda -m "$2" -k "$3" $5 --flashx-report "$OUT/conformance-$backend-$1.json" \
                -p no:cacheprovider -q -rfE 2>&1 | tee "$OUT/conformance-$backend-$1.log" | grep -vE "^\.|^s|^\[gw|^$" | tail -30
        }
        # The hypothesis properties are two long cases (each draw compiles new variants): they run
        # beside the spread cases from the start, not last, where the time box would cut them off.
        run_part properties "not slow" "test_properties" "${CONFORMANCE_SECONDS:-360}" "$two" &
        run_part cases "not slow" "not test_properties" "${CONFORMANCE_SECONDS:-360}" "$workers"
        wait
        if [ "$backend" = cupy ]; then  # its own kind is torch: graded again as a CuPy caller's
            run_part cupy-arrays "not slow" "not test_properties" "${CONFORMANCE_SECONDS:-360}" "$workers --flashx-arrays cupy"
        fi
        run_part slow "slow" "" "${SLOW_SECONDS:-150}" ""
    done
    python3 -m flashx_conformance.summary "$OUT"/conformance-*.json --markdown "$OUT/conformance-$device.md" \
        --json "$OUT/conformance-summary.json"
}

bench() {
    if [ $# -eq 0 ]; then
        flashx bench --record --time-limit "${BENCH_SECONDS:-500}" --compile-budget 240 2>&1 | tee "$OUT/bench.log" | tail -40
        cp benchmarks/results/"$device".* benchmarks/results/history.csv "$OUT/"
    else
        flashx bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
    fi
}

mode=${1:-conformance}
shift || true
case "$mode" in
conformance) conformance ;;
bench) bench "$@" ;;
all) conformance; bench ;;
*) echo "usage: scripts/gpu.sh conformance | bench [ARGS...] | all" >&2; exit 2 ;;
esac
