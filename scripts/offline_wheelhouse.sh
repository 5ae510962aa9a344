#!/usr/bin/env bash
# Assemble the wheels an offline GPU host needs for trainer.backend=verl, on a machine that can reach PyPI.
#
#   scripts/offline_wheelhouse.sh [options] [PACKAGE ...]        (default packages: vllm==0.24.0 verl==0.9.1 ray)
#
#   --out DIR           wheelhouse directory (default: wheelhouse)
#   --python VERSION    the host's Python, e.g. 3.12 (default 3.12 -> cp312)
#   --glibc VERSION     the host's glibc (`ldd --version` there), e.g. 2.39 (default 2.28): wheels up to manylinux_2_<N>
#   --platform TAG      an extra wheel platform tag; repeatable
#   --have FILE         `pip freeze` of the host: those projects are kept at the host's versions and not fetched
#   --skip NAME         a project not to fetch (repeatable; default: flashinfer-cubin)
#   --build NAME        a pure-Python project published only as source: built into a wheel here (repeatable;
#                       default: antlr4-python3-runtime, which hydra-core 1.3 needs)
#   --slim-ray          drop ray/jars and the dashboard client build from the ray wheel (~100 MB less)
#   --split SIZE        also pack the wheelhouse into parts of at most SIZE (split -b syntax, e.g. 1900M)
#
# Resolution runs once with uv (`uv pip compile`, nothing is downloaded for it; `pip install uv` if missing), with
# the host's packages as *overrides*: what the host has is what will run, even where a package pins another version
# (verl 0.9.1 pins transformers<5.11, vllm 0.24.0 pins numba 0.65 and setuptools<81; a host with transformers 5.17,
# numba 0.68 and setuptools 81 runs them). Only the missing projects are downloaded. The script ends by printing the
# one command that installs the wheelhouse on the host (docs/scale_out.md).
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

OUT=wheelhouse PYVER=3.12 GLIBC=2.28 HAVE="" SPLIT="" SLIM_RAY=0
PLATFORMS=() SKIPS=(flashinfer-cubin) BUILDS=(antlr4-python3-runtime) PACKAGES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
        --python) PYVER="${2:?--python needs a version like 3.12}"; shift 2 ;;
        --glibc) GLIBC="${2:?--glibc needs a version like 2.39}"; shift 2 ;;
        --platform) PLATFORMS+=("${2:?--platform needs a tag}"); shift 2 ;;
        --have) HAVE="${2:?--have needs a pip freeze file}"; shift 2 ;;
        --skip) SKIPS+=("${2:?--skip needs a project name}"); shift 2 ;;
        --build) BUILDS+=("${2:?--build needs a project name}"); shift 2 ;;
        --slim-ray) SLIM_RAY=1; shift ;;
        --split) SPLIT="${2:?--split needs a size like 1900M}"; shift 2 ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) PACKAGES+=("$1"); shift ;;
    esac
done
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || die "--python must look like 3.12, got '$PYVER'"
[ -z "$HAVE" ] || [ -f "$HAVE" ] || die "--have file '$HAVE' not found (make it on the host with: pip freeze > have.txt)"
[ -z "$SPLIT" ] || [[ "$SPLIT" =~ ^[0-9]+[KMG]?$ ]] || die "--split must be a size like 1900M, got '$SPLIT'"
[ ${#PACKAGES[@]} -gt 0 ] || PACKAGES=(vllm==0.24.0 verl==0.9.1 ray)
[[ "$GLIBC" =~ ^2\.[0-9]+$ ]] && [ "${GLIBC#2.}" -ge 17 ] || die "--glibc must look like 2.39 (at least 2.17), got '$GLIBC'"
for ((minor = ${GLIBC#2.}; minor >= 17; minor--)); do PLATFORMS+=("manylinux_2_${minor}_x86_64"); done
PLATFORMS+=(manylinux2014_x86_64 linux_x86_64)
ABI="cp${PYVER/./}"
PY="${PYTHON:-python3}"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

# The host's packages as name==version overrides (editable / URL lines are skipped).
: > "$WORK/overrides.txt"
if [ -n "$HAVE" ]; then
    grep -E '^[A-Za-z0-9_.-]+==[^ ]+$' "$HAVE" > "$WORK/overrides.txt" || true
fi
if command -v uv >/dev/null 2>&1; then UV=(uv); elif "$PY" -m uv --version >/dev/null 2>&1; then UV=("$PY" -m uv)
else die "uv is needed for the resolution: pip install uv"; fi

TARGET_FLAGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none)
for p in "${PLATFORMS[@]}" any; do TARGET_FLAGS+=(--platform "$p"); done

echo "resolving ${PACKAGES[*]} for $ABI, x86_64 glibc $GLIBC" >&2
printf '%s\n' "${PACKAGES[@]}" > "$WORK/requirements.in"
SOURCE_FLAGS=(); for b in "${BUILDS[@]}"; do SOURCE_FLAGS+=(--no-binary "$b"); done
UV_PYTHON_DOWNLOADS=never "${UV[@]}" pip compile --quiet --no-header --no-annotate --only-binary :all: "${SOURCE_FLAGS[@]}" \
    --python-version "$PYVER" --python-platform "x86_64-manylinux_2_${GLIBC#2.}" \
    --override "$WORK/overrides.txt" -o "$WORK/resolved.txt" "$WORK/requirements.in"

# name==version of every resolved project the host lacks (not in --have, not skipped).
"$PY" - "$WORK/resolved.txt" "$WORK/overrides.txt" "${SKIPS[@]}" > "$WORK/needed.txt" <<'EOF'
import re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
resolved, overrides, skips = sys.argv[1], sys.argv[2], {norm(s) for s in sys.argv[3:]}
have = {norm(line.split("==")[0]) for line in open(overrides) if "==" in line}
for line in open(resolved):
    line = line.split(";")[0].strip()
    if "==" in line and norm(line.split("==")[0].split("[")[0]) not in have | skips:
        print(line)
EOF
echo "fetching $(wc -l < "$WORK/needed.txt") wheels the host lacks" >&2
# Source-only projects (--build) are built into wheels here; they must come out pure Python (py3-none-any).
"$PY" - "$WORK/needed.txt" "$WORK/binary.txt" "$WORK/source.txt" "${BUILDS[@]}" <<'EOF'
import re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
needed, binary, source, builds = sys.argv[1], sys.argv[2], sys.argv[3], {norm(b) for b in sys.argv[4:]}
with open(binary, "w") as b, open(source, "w") as s:
    for line in filter(None, (line.strip() for line in open(needed))):
        (s if norm(line.split("==")[0].split("[")[0]) in builds else b).write(line + "\n")
EOF
if [ -s "$WORK/binary.txt" ]; then
    "$PY" -m pip download --quiet --no-deps -d "$OUT" "${TARGET_FLAGS[@]}" -r "$WORK/binary.txt"
fi
if [ -s "$WORK/source.txt" ]; then
    "$PY" -m pip wheel --quiet --no-deps -w "$WORK/built" -r "$WORK/source.txt"
    for wheel in "$WORK"/built/*.whl; do
        case "$wheel" in *-py3-none-any.whl|*-py2.py3-none-any.whl) mv "$wheel" "$OUT/" ;;
            *) die "$(basename "$wheel") is not pure Python: --build is for source-only pure-Python projects" ;; esac
    done
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
