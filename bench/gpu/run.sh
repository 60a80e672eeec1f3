#!/usr/bin/env bash
# The one command a lent GPU machine runs (README, "On a GPU"):
#
#   bash bench/gpu/run.sh OUT [suite args...]      # e.g. OUT="$OUT", or --stages offload,plan
#
# Installs the carried wheels (.whl/, from bench/gpu/fetch_wheels.sh) into a folder put on
# PYTHONPATH, runs `python -m bench.gpu.suite` into a scratch folder, then, whatever happened
# (a stage failed, the suite died or was stopped), leaves four files in OUT: gpu_results.tar.gz
# (every file the suite wrote, this log and the pip list; unpack it into bench/results),
# gpu_suite.md (the one-screen summary) and gpu_suite.json beside it, and gpu_run.log.
# Exit status: the suite's; 124 when ACTPLAN_DEADLINE stopped it; 128+N on signal N.
# Settings: ACTPLAN_PYTHON (python3), ACTPLAN_WHEELS (.whl), ACTPLAN_SITE (/tmp/site: where the
# wheels go), ACTPLAN_DEADLINE (560 s, inside the device's 600 s a command; 0: none).
set -u
[ $# -ge 1 ] || { echo "usage: $0 OUT [suite args...]" >&2; exit 2; }
mkdir -p "$1" && out=$(cd "$1" && pwd) && shift && cd "$(dirname "$0")/../.." || exit 2
py=${ACTPLAN_PYTHON:-python3}
site=${ACTPLAN_SITE:-/tmp/site}
work=$(mktemp -d) || exit 2
results=$work/results
log=$out/gpu_run.log
mkdir -p "$results"
status=1

pack() {
    trap '' INT TERM HUP
    cd "$results" || exit "$status"
    if [ ! -f gpu_suite.md ]; then
        # shellcheck disable=SC2016  # the backquotes are markdown's
        printf '# actplan GPU suite\n\n- the suite wrote no summary (exit %s); the end of gpu_run.log:\n\n```\n%s\n```\n' \
            "$status" "$(tail -n 15 "$log")" >gpu_suite.md
    elif [ "$status" -gt 1 ]; then
        echo "- bench/gpu/run.sh: the suite ended with exit $status (124: at ACTPLAN_DEADLINE)" >>gpu_suite.md
    fi
    cp "$log" .
    files=(*)
    echo "bench/gpu/run.sh: exit $status; packing ${#files[@]} files into $out" | tee -a "$log"
    tar -czf "$out/gpu_results.tar.gz" --warning=no-file-changed . || echo "tar failed" >>"$out/gpu_run.log"
    cp gpu_suite.md "$out/"
    [ ! -f gpu_suite.json ] || cp gpu_suite.json "$out/"
    cd / && rm -rf "$work"
    exit "$status"
}
trap pack EXIT
trap 'status=129; exit' HUP
trap 'status=130; exit' INT
trap 'status=143; exit' TERM

export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
shopt -s nullglob
wheels=("${ACTPLAN_WHEELS:-.whl}"/*.whl)
{
    if [ ${#wheels[@]} -gt 0 ]; then
        echo "installing ${#wheels[@]} wheels into $site"
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "${wheels[@]}"
    else
        echo "no wheels in ${ACTPLAN_WHEELS:-.whl}: installing nothing"
    fi
    "$py" -m pip list --format=freeze >"$results/gpu_pip_list.txt" 2>&1
    "$py" -c 'import pydantic as p; print("pydantic", p.VERSION, "from", p.__file__)'
    timeout --foreground -k 10 "${ACTPLAN_DEADLINE:-560}" "$py" -m bench.gpu.suite --out "$results" "$@"
    echo $? >"$work/status"
} 2>&1 | tee "$log"
status=$(cat "$work/status" 2>/dev/null || echo 1)
