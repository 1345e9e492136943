#!/usr/bin/env bash
# Grade a branch's kernels on the GPU machine before the branch joins main: each branch travels as
# a tree of its own (git archive) in the ignored folder .branches/, and runs there with that tree
# first on PYTHONPATH (the checkout's editable install supplies the entry points, which then import
# the branch's modules). Each part says which tree its backends came from, so a part that graded
# the wrong code shows it.
#
#   scripts/gpu_branches.sh pack BRANCH...           # here: .branches/<branch>/, then run with carry [".branches"]
#   scripts/gpu_branches.sh conformance BRANCH NAME SECONDS PYTEST_ARGS...
#                                                    # there: the suite on BRANCH's tree in a time box,
#                                                    # report $OUT/conf-NAME.json and its log beside it
#   scripts/gpu_branches.sh run BRANCH COMMAND...    # there: COMMAND with BRANCH's tree first on PYTHONPATH
#
# There, install the checkout once first (python3 -m pip install --no-deps --no-build-isolation -e .).
# Parts may run side by side (&, then wait): each writes only its own files.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
branches="$root/.branches"

tree_path() {  # the PYTHONPATH of a branch's tree, its packages' folders first
    local tree="$branches/$1"
    [ -d "$tree" ] || { echo "no tree $tree: run 'scripts/gpu_branches.sh pack $1' before the GPU call" >&2; exit 2; }
    echo "$tree:$tree/backends:$tree/conformance:$tree/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
}

case "${1:-}" in
pack)
    shift
    grep -qx '/.branches/' "$root/.git/info/exclude" 2>/dev/null || echo '/.branches/' >>"$root/.git/info/exclude"
    for branch in "$@"; do
        rm -rf "${branches:?}/$branch" && mkdir -p "$branches/$branch"
        git -C "$root" archive "$branch" | tar -x -C "$branches/$branch" || exit 1
        echo "$branch: $(git -C "$root" rev-parse --short "$branch") -> .branches/$branch"
    done
    ;;
conformance)
    branch=$2 name=$3 seconds=$4
    shift 4
    out=${OUT:-/tmp/flashx-out}
    mkdir -p "$out"
    path=$(tree_path "$branch") || exit 2
    # from outside the checkout, so that its own rootdir and conftest stay out of the way
    (cd /tmp && PYTHONPATH=$path python3 -c "import flashx_triton, os; print(os.path.dirname(os.path.dirname(flashx_triton.__file__)))" &&
        PYTHONPATH=$path timeout -s INT "$seconds" python3 -m pytest --pyargs flashx_conformance --flashx-device cuda \
            -q -p no:cacheprovider -rfE --flashx-report "$out/conf-$name.json" "$@") >"$out/conf-$name.log" 2>&1
    echo "$name ($branch, from $(head -1 "$out/conf-$name.log")): $(grep -E "passed|failed|error" "$out/conf-$name.log" | tail -1)"
    ;;
run)
    branch=$2
    shift 2
    path=$(tree_path "$branch") || exit 2
    PYTHONPATH=$path "$@"
    ;;
*)
    sed -n '2,15p' "$0"
    exit 2
    ;;
esac
