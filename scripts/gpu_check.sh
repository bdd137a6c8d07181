#!/usr/bin/env bash
# One command for a GPU machine: find a python with CUDA torch, install the wheels carried in
# .whl/ (make gpu-wheels), check every import the package needs, run the CUDA tests, then the
# GPU benchmark. Everything it prints also goes to $OUT/gpu_check.log (OUT defaults to
# gpu_check_out), and the benchmark's figures to $OUT/gpu_bench.json.
#
# Environment:
#   PYTHON           the python to use (default: the first of /opt/torch/.venv/bin/python3 and
#                    python3 whose torch is a CUDA build, else the first with torch at all)
#   OUT              output folder (default gpu_check_out)
#   WHEELS_DIR       wheels to install first (default .whl; skipped when it holds none)
#   GPU_CHECK_SITE   where they are installed (default /tmp/site, put first on PYTHONPATH)
#   TEST_TIMEOUT     seconds for the CUDA tests (default 200)
#   BENCH_TIMEOUT    seconds for the benchmark (default 200)
#   BENCH_TOKENS     tokens per store/retrieve in the benchmark (default 8192)
#
# Exit status: 0 all passed; 1 the CUDA tests or the benchmark failed; 2 no usable python,
# the wheels did not install, or an import is missing; 3 no CUDA device.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
WHEELS_DIR=${WHEELS_DIR:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
TEST_TIMEOUT=${TEST_TIMEOUT:-200}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
BENCH_TOKENS=${BENCH_TOKENS:-8192}

say() { printf 'gpu_check: %s\n' "$*" | tee -a "$LOG"; }
fail() {
    local status=$1
    shift
    say "FAILED: $*"
    exit "$status"
}
# Run a command with its output shown and logged; returns the command's own exit status.
logged() {
    set +e
    "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    set -e
    return "$status"
}

say "started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) in $REPO"

# -- a python with torch ----------------------------------------------------------------------
pick_python() {
    if [[ -n ${PYTHON:-} ]]; then
        printf '%s\n' "$PYTHON"
        return
    fi
    local cand first=""
    for cand in /opt/torch/.venv/bin/python3 python3; do
        command -v "$cand" >/dev/null 2>&1 || continue
        if "$cand" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' \
            >/dev/null 2>&1; then
            printf '%s\n' "$cand"
            return
        fi
        if [[ -z $first ]] && "$cand" -c 'import torch' >/dev/null 2>&1; then
            first=$cand
        fi
    done
    printf '%s\n' "$first"
}

PY=$(pick_python)
if [[ -z $PY ]]; then
    fail 2 "no python with torch found (tried /opt/torch/.venv/bin/python3 and python3; set PYTHON)"
fi
command -v "$PY" >/dev/null 2>&1 || fail 2 "PYTHON=$PY is not an executable"
say "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1))"

# -- wheels carried with the tree -------------------------------------------------------------
shopt -s nullglob
wheels=("$WHEELS_DIR"/*.whl)
shopt -u nullglob
if ((${#wheels[@]})); then
    say "installing ${#wheels[@]} wheels from $WHEELS_DIR into $SITE"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        install=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
            --upgrade --target "$SITE")
    else
        # No pip: these wheels are plain zips of importable trees, so unpacking them will do.
        say "no pip in $PY: unpacking the wheels instead"
        install=("$PY" -c 'import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])' "$SITE")
    fi
    if ! logged "${install[@]}" "${wheels[@]}"; then
        fail 2 "the wheels in $WHEELS_DIR did not install with $PY (make gpu-wheels builds them" \
            "for CPython 3.12, manylinux x86_64)"
    fi
    export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
    say "no wheels in $WHEELS_DIR: using what $PY has"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

# -- every import the package and its tests need ----------------------------------------------
check_imports() {
    "$PY" - <<'EOF'
import importlib
import re
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
# Distribution name -> the module it provides, where they differ.
modules = {"pyyaml": "yaml", "pyzmq": "zmq", "lz4": "lz4.frame"}
wanted = {}
for requirement in [*project["dependencies"], "pytest", "hypothesis"]:
    dist = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()
    wanted[dist] = modules.get(dist, dist.replace("-", "_"))
missing = []
for dist, module in wanted.items():
    try:
        importlib.import_module(module)
    except Exception as exc:
        missing.append(f"{dist} (import {module}: {type(exc).__name__}: {exc})")
if missing:
    print("missing imports: " + "; ".join(missing))
    sys.exit(1)
try:
    import lmcache_async.bench.gpu
    import lmcache_async.cli
    import lmcache_async.engine  # noqa: F401
except Exception as exc:
    print(f"lmcache_async does not import: {type(exc).__name__}: {exc}")
    sys.exit(1)
print("imports ok: " + ", ".join(sorted(wanted)) + ", lmcache_async")
EOF
}
if ! logged check_imports; then
    fail 2 "imports are missing (see above): carry them as wheels (make gpu-wheels puts them in" \
        ".whl/) or set PYTHON to a python that has them"
fi

# -- a CUDA device ----------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    logged nvidia-smi -L || true
fi
cuda_probe='import sys, torch
ok = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if ok else "none"
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, device {name}")
sys.exit(0 if ok else 1)'
if ! probe=$("$PY" -c "$cuda_probe" 2>&1); then
    fail 3 "no CUDA device: $probe"
fi
say "$probe"

# -- the CUDA tests ---------------------------------------------------------------------------
mapfile -t test_files < <(grep -rl --include='*.py' 'pytest.mark.cuda' tests | sort)
tests_status=0
if ((${#test_files[@]} == 0)); then
    say "no test file has a pytest.mark.cuda test"
    tests_status=5
else
    say "CUDA tests (timeout ${TEST_TIMEOUT}s): ${test_files[*]}"
    # The repository's addopts are dropped (its plugins may be missing here); -m cuda selects.
    logged timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -m cuda -o addopts= \
        -p no:cacheprovider --import-mode=importlib -q -rfEs "${test_files[@]}" ||
        tests_status=$?
fi

# -- the benchmark ----------------------------------------------------------------------------
say "GPU bench (timeout ${BENCH_TIMEOUT}s, $BENCH_TOKENS tokens)"
bench_status=0
logged timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m lmcache_async.cli bench --gpu --device cuda \
    --layers 32 --kv-heads 8 --head-size 128 --dtype bfloat16 --block-size 16 \
    --tokens "$BENCH_TOKENS" --repeat 5 --json "$OUT/gpu_bench.json" || bench_status=$?

describe() { case $1 in 0) echo passed ;; 124 | 137) echo "timed out ($1)" ;; *) echo "failed ($1)" ;; esac; }
say "CUDA tests: $(describe "$tests_status"); bench: $(describe "$bench_status");" \
    "${SECONDS}s in all; log $LOG, figures $OUT/gpu_bench.json"
if ((tests_status != 0 || bench_status != 0)); then
    exit 1
fi
