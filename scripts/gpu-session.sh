#!/usr/bin/env bash
# One call on the lent GPU machine (no network, no nox): install, then either the conformance
# suite for every GPU backend or the benchmark sweep. Full results under $OUT; a short table last.
#   scripts/gpu-session.sh conformance   # flashx info, demo, conformance (full tier, then the slow tier)
#   scripts/gpu-session.sh bench         # ~9 min: python -m benchmarks (ceilings, check, memory, sweep)
set -uo pipefail
OUT=${OUT:-/tmp/flashx-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }

case "${1:-conformance}" in
conformance)
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
        # beside the spread cases from the start instead of last, where the time box cut them off.
        run_part properties "not slow" "test_properties" "${CONFORMANCE_SECONDS:-360}" "$two" &
        run_part cases "not slow" "not test_properties" "${CONFORMANCE_SECONDS:-360}" "$workers"
        wait
        run_part slow "slow" "" "${SLOW_SECONDS:-150}" ""
    done
    python3 -m flashx_conformance.summary "$OUT"/conformance-*.json --markdown "$OUT/conformance.md" --json "$OUT/conformance-summary.json"
    ;;
bench)
    python3 -m benchmarks --out "$OUT" --time-limit "${BENCH_SECONDS:-500}" --compile-budget 240 2>&1 | tee "$OUT/bench.log" | tail -60
    ;;
esac
