#!/usr/bin/env bash
# Put what the image installs into the build context (docker/), on the host:
#   docker/dist/       zmqsync's own wheel (always rebuilt from this checkout)
#   docker/wheelhouse/ every dependency as a wheel, so that the image builds with no
#                      package index reachable (`--build-arg OFFLINE=1`)
#
#   docker/build-wheels.sh              # both
#   docker/build-wheels.sh --no-deps    # only docker/dist (the image then gets its
#                                       # dependencies from PyPI: OFFLINE=0, the default)
#
# PYTHON chooses the interpreter whose pip downloads (default: python3). Wheels are
# chosen for CPython $PY_VERSION (default 3.11, as in python:3.11-slim and Debian
# bookworm) on manylinux x86_64, whatever the host runs. Dependencies are pinned by the
# repository's constraints.txt (torch==2.13.0: the CPU build where a local wheel exists).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
PYTHON=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.11}
abi="cp${PY_VERSION//./}"

rm -rf "$here/dist"
mkdir -p "$here/dist" "$here/wheelhouse"
# a fixed timestamp makes the wheel byte-identical while the source is: docker's layer
# cache then skips the install step too
# The host's setuptools builds the wheel (no index needed) when it can: 68 or newer, as
# pyproject.toml asks, with bdist_wheel (built in from 70.1, before that from the `wheel`
# package). Otherwise pip builds in an isolated environment with setuptools from the index
# (a system python3 often has an older setuptools and no `wheel`).
isolation=()
if "$PYTHON" - <<'PY' 2>/dev/null; then
import importlib.util, sys
from importlib.metadata import version
v = tuple(int(x) for x in version("setuptools").split(".")[:2])
sys.exit(0 if v >= (70, 1) or (v >= (68, 0) and importlib.util.find_spec("wheel")) else 1)
PY
    isolation=(--no-build-isolation)
fi
# The wheel carries zmqsync's native copy loop, compiled for this interpreter: when the
# image's Python ($PY_VERSION) is another one, a pure-Python wheel instead (it copies from
# Python; see docs/benchmarks.md, "Round 4").
host_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
native=1
if [ "$host_version" != "$PY_VERSION" ] || [ "$(uname -m)" != x86_64 ]; then
    native=0
fi
ZMQSYNC_BUILD_NATIVE=$native SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800} \
    "$PYTHON" -m pip wheel -q --no-deps "${isolation[@]}" -w "$here/dist" "$root" 2>&1 \
    | grep -v "is ignored: it is neither" >&2 || true
wheel=$(ls "$here"/dist/zmqsync-*.whl)
echo "build-wheels: $wheel"

if [ "${1:-}" = --no-deps ]; then
    exit 0
fi

# a fresh download each time: the folder holds exactly one consistent set of wheels
rm -f "$here"/wheelhouse/*.whl
platforms=(--platform manylinux2014_x86_64 --platform linux_x86_64) # the last: our wheel
for v in 17 24 26 27 28 31 34 35 36; do
    platforms+=(--platform "manylinux_2_${v}_x86_64")
done
"$PYTHON" -m pip download -q -d "$here/wheelhouse" -c "$root/constraints.txt" \
    --only-binary=:all: --python-version "$PY_VERSION" --implementation cp --abi "$abi" \
    "${platforms[@]}" "$wheel[metrics]" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
rm -f "$here"/wheelhouse/zmqsync-*.whl
if ! ls "$here"/wheelhouse/torch-*.whl >/dev/null 2>&1; then
    echo "build-wheels: pip download failed (no torch wheel in $here/wheelhouse)" >&2
    exit 1
fi
echo "build-wheels: $(ls "$here/wheelhouse" | wc -l) wheels in $here/wheelhouse ($(du -sh "$here/wheelhouse" | cut -f1))"
