#!/usr/bin/env bash
# Assemble the wheels an offline GPU host needs for trainer.backend=verl, on a machine that can reach PyPI.
#
#   scripts/offline_wheelhouse.sh [options] [PACKAGE ...]        (default packages: vllm==0.24.0 verl==0.9.1 ray)
#
#   --out DIR           wheelhouse directory (default: wheelhouse)
#   --python VERSION    the host's Python, e.g. 3.12 (default 3.12 -> cp312)
#   --platform TAG      wheel platform tag; repeatable (default: manylinux_2_28_x86_64, manylinux2014_x86_64, ...)
#   --have FILE         `pip freeze` of the host: those projects are pinned to the host's versions and not fetched
#   --skip NAME         a project not to fetch (repeatable; default: flashinfer-cubin)
#   --slim-ray          drop ray/jars and the dashboard client build from the ray wheel (~100 MB less)
#   --split SIZE        also pack the wheelhouse into parts of at most SIZE (split -b syntax, e.g. 1900M)
#
# Resolution runs once (`pip install --dry-run --report`, nothing is downloaded for it), with the host's packages as
# constraints, so the wheels fit what the host has (e.g. torch 2.11.0); only the missing projects are downloaded.
# The script ends by printing the one command that installs the wheelhouse on the host (docs/scale_out.md).
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

OUT=wheelhouse PYVER=3.12 HAVE="" SPLIT="" SLIM_RAY=0
PLATFORMS=() SKIPS=(flashinfer-cubin) PACKAGES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
        --python) PYVER="${2:?--python needs a version like 3.12}"; shift 2 ;;
        --platform) PLATFORMS+=("${2:?--platform needs a tag}"); shift 2 ;;
        --have) HAVE="${2:?--have needs a pip freeze file}"; shift 2 ;;
        --skip) SKIPS+=("${2:?--skip needs a project name}"); shift 2 ;;
        --slim-ray) SLIM_RAY=1; shift ;;
        --split) SPLIT="${2:?--split needs a size like 1900M}"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) PACKAGES+=("$1"); shift ;;
    esac
done
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || die "--python must look like 3.12, got '$PYVER'"
[ -z "$HAVE" ] || [ -f "$HAVE" ] || die "--have file '$HAVE' not found (make it on the host with: pip freeze > have.txt)"
[ -z "$SPLIT" ] || [[ "$SPLIT" =~ ^[0-9]+[KMG]?$ ]] || die "--split must be a size like 1900M, got '$SPLIT'"
[ ${#PACKAGES[@]} -gt 0 ] || PACKAGES=(vllm==0.24.0 verl==0.9.1 ray)
[ ${#PLATFORMS[@]} -gt 0 ] || PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 linux_x86_64)
ABI="cp${PYVER/./}"
PY="${PYTHON:-python3}"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

# The host's packages, normalized, as name==version constraints (editable / URL lines are skipped).
: > "$WORK/constraints.txt"
if [ -n "$HAVE" ]; then
    grep -E '^[A-Za-z0-9_.-]+==[^ ]+$' "$HAVE" > "$WORK/constraints.txt" || true
fi

TARGET_FLAGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none)
for p in "${PLATFORMS[@]}" any; do TARGET_FLAGS+=(--platform "$p"); done

echo "resolving ${PACKAGES[*]} for $ABI (${PLATFORMS[*]})" >&2
"$PY" -m pip install --dry-run --quiet --ignore-installed --target "$WORK/target" --report "$WORK/report.json" \
    -c "$WORK/constraints.txt" "${TARGET_FLAGS[@]}" "${PACKAGES[@]}"

# name==version of every resolved project the host lacks (not in --have, not skipped).
"$PY" - "$WORK/report.json" "$WORK/constraints.txt" "${SKIPS[@]}" > "$WORK/needed.txt" <<'EOF'
import json, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
report, constraints, skips = sys.argv[1], sys.argv[2], {norm(s) for s in sys.argv[3:]}
have = {norm(line.split("==")[0]) for line in open(constraints) if "==" in line}
for item in json.load(open(report))["install"]:
    meta = item["metadata"]
    if norm(meta["name"]) not in have | skips:
        print(f"{meta['name']}=={meta['version']}")
EOF
echo "fetching $(wc -l < "$WORK/needed.txt") wheels the host lacks" >&2
if [ -s "$WORK/needed.txt" ]; then
    "$PY" -m pip download --quiet --no-deps -d "$OUT" "${TARGET_FLAGS[@]}" -r "$WORK/needed.txt"
fi

if [ "$SLIM_RAY" = 1 ]; then
    for wheel in "$OUT"/ray-*.whl; do
        [ -e "$wheel" ] || continue
        "$PY" - "$wheel" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
dropped = ("ray/jars/", "ray/dashboard/client/build/")
tmp = path + ".slim"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith(dropped):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not line.startswith(dropped)).encode()
        dst.writestr(info, data)
os.replace(tmp, path)
EOF
        echo "slimmed $(basename "$wheel")" >&2
    done
fi

du -sh "$OUT" >&2
name="$(basename "$OUT")"
if [ -n "$SPLIT" ]; then
    tar -C "$(dirname "$OUT")" -cf - "$name" | split -b "$SPLIT" - "$OUT.tar.part-"
    ls -l "$OUT".tar.part-* >&2
    echo "copy $name.tar.part-* to the host, then run there:"
    echo "cat $name.tar.part-* | tar -xf - && pip install --no-index --no-deps $name/*.whl"
    echo "(or into a directory on PYTHONPATH: pip install --no-index --no-deps --target DIR $name/*.whl)"
else
    echo "copy $OUT to the host, then run there:"
    echo "pip install --no-index --no-deps $name/*.whl"
    echo "(or into a directory on PYTHONPATH: pip install --no-index --no-deps --target DIR $name/*.whl)"
fi
