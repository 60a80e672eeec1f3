#!/usr/bin/env bash
# Download, here, the wheels the GPU machine's image lacks, for bench/gpu/run.sh to install there.
#
#   bash bench/gpu/fetch_wheels.sh                        # cp312 wheels into .whl/ (git-ignored)
#   bash bench/gpu/fetch_wheels.sh --python-version 3.11 --dest DIR   # e.g. the CPU rehearsal's
#
# The image (see README, "On a GPU") has torch, PyYAML, numpy, scipy, rich, matplotlib,
# transformers, accelerate, pytest, pytest-timeout, hypothesis and typing-extensions, but not
# pydantic (with pydantic-core, annotated-types, typing-inspection) nor torch_remat. Each is
# pinned and fetched with --no-deps, so every dependency is named here: pydantic 2.12 rather than
# the newest because it asks for typing-extensions>=4.14.1, which an image built in 2026 has, where
# pydantic 2.14 asks for 4.16. Older wheels of these names in the folder are removed first, so it
# holds exactly one version of each (two stop the install there). ACTPLAN_PYTHON: the pip to use.
set -euo pipefail

WHEELS=(
    pydantic==2.12.5          # needs the four below and typing-extensions>=4.14.1
    pydantic-core==2.41.5     # the one pydantic 2.12.5 pins; compiled: cp3XX, manylinux x86-64
    annotated-types==0.7.0
    typing-inspection==0.4.2  # typing-extensions>=4.12.0
    torch_remat==0.2.2        # torch>=2.10 (the peers stage)
)
python=${ACTPLAN_PYTHON:-python3}
version=3.12
dest=$(cd "$(dirname "$0")/../.." && pwd)/.whl

while (($#)); do
    case $1 in
        --python-version) version=${2:?--python-version needs e.g. 3.12}; shift 2 ;;
        --dest) dest=${2:?--dest needs a folder}; shift 2 ;;
        *) echo "usage: $0 [--python-version 3.12] [--dest DIR]" >&2; exit 2 ;;
    esac
done

mkdir -p "$dest"
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    rm -f "$dest/${name//-/_}"-*.whl
done
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp "${platforms[@]}" --dest "$dest" "${WHEELS[@]}"

# One wheel per name, and what each needs (extras left out).
"$python" - "$dest" "${WHEELS[@]}" <<'EOF'
import pathlib, re, sys, zipfile

dest, specs = pathlib.Path(sys.argv[1]), sys.argv[2:]
for spec in specs:
    name = spec.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{name}-*.whl"))
    assert len(found) == 1, f"{dest}: want one {name} wheel, found {[p.name for p in found]}"
    with zipfile.ZipFile(found[0]) as wheel:
        meta = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")))
    needs = [
        line.split(":", 1)[1].strip()
        for line in meta.decode().splitlines()
        if line.startswith("Requires-Dist:") and not re.search(r"extra\s*==", line)
    ]
    print(f"{found[0].name}  {found[0].stat().st_size / 1024:.0f} KiB  needs: {', '.join(needs) or '-'}")
EOF
