#!/usr/bin/env bash
# One command for a GPU machine: find a python with CUDA torch, install the wheels carried in
# .whl/ (make gpu-wheels), print every dependency's version and check it and its import
# against pyproject.toml, run the CUDA tests, then the GPU benchmark, and end with a short
# table of the benchmark's figures against their same-run baselines and the tests' counts
# (scripts/gpu_summary.py). Everything lands in $OUT: gpu_check.log (all it printed),
# gpu_tests.xml (the tests' junit summary) and gpu_bench.json (the benchmark's figures). Every
# python step runs unbuffered and with faulthandler, so a step killed at its limit keeps its
# output and a hang dumps its stacks.
# With the defaults it ends within about 7 minutes (mostly far sooner).
#
# Environment:
#   PYTHON            the python to use (default: the first of /opt/torch/.venv/bin/python3 and
#                     python3 whose torch is a CUDA build, else the first with torch at all)
#   OUT               output folder, relative to the caller's directory (default gpu_check_out
#                     in the repository)
#   WHEELS_DIR        wheels to install first (default .whl; skipped when it holds none)
#   GPU_CHECK_SITE    where they are installed (default /tmp/site, put first on PYTHONPATH)
#   TEST_TIMEOUT      seconds for the CUDA tests in all (default 170)
#   PER_TEST_TIMEOUT  seconds for one test before it fails with its stacks dumped (default 60)
#   BENCH_TIMEOUT     seconds for the benchmark (default 150)
#   BENCH_TOKENS      tokens per store/retrieve in the benchmark (default 8192)
#   BENCH_DEVICE      the benchmark's device (default cuda; cuda:N for another one)
#
# Exit status: 0 all passed; 1 the CUDA tests or the benchmark failed, or no CUDA test ran
# (every one skipped, or none collected); 2 no usable python, bad settings, the wheels did not
# install, or an import is missing or older than pyproject.toml asks; 3 no CUDA device.
set -euo pipefail

# OUT is taken relative to the caller's directory, before the cd into the repository.
OUT=$(realpath -m -- "${OUT:-$(dirname -- "${BASH_SOURCE[0]}")/../gpu_check_out}")
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."
REPO=$PWD
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
TESTS_XML=$OUT/gpu_tests.xml
BENCH_JSON=$OUT/gpu_bench.json
: >"$LOG"
rm -f "$TESTS_XML" "$BENCH_JSON"
WHEELS_DIR=${WHEELS_DIR:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
TEST_TIMEOUT=${TEST_TIMEOUT:-170}
PER_TEST_TIMEOUT=${PER_TEST_TIMEOUT:-60}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
BENCH_TOKENS=${BENCH_TOKENS:-8192}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}
# Seconds a step may take past its limit to stop on its own before it is killed.
GRACE=15

# Every python runs unbuffered and with faulthandler: the flags on each call, the variables
# for the processes it starts (the tests' subprocesses).
PY_FLAGS=(-u -X faulthandler)
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1

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

say "started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) in $REPO; output in $OUT"
for name in TEST_TIMEOUT PER_TEST_TIMEOUT BENCH_TIMEOUT BENCH_TOKENS; do
    [[ ${!name} =~ ^[1-9][0-9]*$ ]] || fail 2 "$name=${!name} is not a positive whole number"
done
# Half the budget at most: a hung test fails with its stacks and the others still run.
if ((2 * PER_TEST_TIMEOUT > TEST_TIMEOUT)); then
    fail 2 "PER_TEST_TIMEOUT=$PER_TEST_TIMEOUT must be at most half of TEST_TIMEOUT=$TEST_TIMEOUT"
fi

# -- a python with torch ----------------------------------------------------------------------
pick_python() {
    if [[ -n ${PYTHON:-} ]]; then
        printf '%s\n' "$PYTHON"
        return
    fi
    local cand first=""
    for cand in /opt/torch/.venv/bin/python3 python3; do
        command -v "$cand" >/dev/null 2>&1 || continue
        if "$cand" "${PY_FLAGS[@]}" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' \
            >/dev/null 2>&1; then
            printf '%s\n' "$cand"
            return
        fi
        if [[ -z $first ]] && "$cand" "${PY_FLAGS[@]}" -c 'import torch' >/dev/null 2>&1; then
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
say "python: $PY ($("$PY" "${PY_FLAGS[@]}" -c 'import sys; print(sys.version.split()[0])' 2>&1))"

# -- wheels carried with the tree -------------------------------------------------------------
shopt -s nullglob
wheels=("$WHEELS_DIR"/*.whl)
shopt -u nullglob
if ((${#wheels[@]})); then
    say "installing ${#wheels[@]} wheels from $WHEELS_DIR into $SITE"
    if "$PY" "${PY_FLAGS[@]}" -m pip --version >/dev/null 2>&1; then
        install=("$PY" "${PY_FLAGS[@]}" -m pip install -q --no-index --no-deps --no-compile
            --no-cache-dir --upgrade --target "$SITE")
    else
        # No pip: these wheels are plain zips of importable trees, so unpacking them will do.
        say "no pip in $PY: unpacking the wheels instead"
        install=("$PY" "${PY_FLAGS[@]}" -c 'import sys, zipfile
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

# -- every dependency: its version against pyproject.toml, and its import ---------------------
check_imports() {
    "$PY" "${PY_FLAGS[@]}" - <<'EOF'
import importlib
import importlib.metadata
import re
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
# Distribution name -> the module it provides, where they differ.
modules = {"pyyaml": "yaml", "pyzmq": "zmq", "lz4": "lz4.frame"}
# What the package and its CUDA tests need (pytest-timeout bounds each test), then what is
# only reported (and checked when installed).
dev = {"pytest", "pytest-timeout", "hypothesis"}
optional = {"redis"}
minimums: dict[str, str | None] = {}
for requirement in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
    dist = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
    if requirement in project["dependencies"] or dist in dev | optional:
        found = re.search(r">=\s*([0-9][0-9.]*)", requirement)
        minimums[dist] = found.group(1) if found else None


def release(version: str) -> tuple[int, ...]:
    found = re.match(r"[0-9]+(?:\.[0-9]+)*", version)
    return tuple(int(part) for part in found.group().split(".")) if found else ()


def at_least(version: str, minimum: str) -> bool:
    have, need = release(version), release(minimum)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))


missing, too_old, checked = [], [], []
for dist, minimum in minimums.items():
    module = modules.get(dist, dist.replace("-", "_"))
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        imported = importlib.import_module(module)
    except Exception as exc:
        if dist in optional and version is None:
            print(f"version: {dist} not installed (optional)")
            continue
        missing.append(f"{dist} (import {module}: {type(exc).__name__}: {exc})")
        imported = None
    checked.append(dist)
    version = version or getattr(imported, "__version__", None)
    need = f">= {minimum}" if minimum else "(no minimum)"
    if version is None:
        verdict = "version unknown"
    elif minimum and not at_least(version, minimum):
        verdict = "TOO OLD"
        too_old.append(f"{dist} {version} (pyproject.toml asks {need})")
    else:
        verdict = "ok"
    extra = ""
    if dist == "torch" and imported is not None:
        cudnn = imported.backends.cudnn.version() if imported.backends.cudnn.is_available() else None
        extra = f" (CUDA build {imported.version.cuda}, cuDNN {cudnn})"
    print(f"version: {dist} {version or '?'} {need} {verdict}{extra}")
failed = False
if missing:
    print("missing imports: " + "; ".join(missing))
    failed = True
if too_old:
    print("too old: " + "; ".join(too_old))
    failed = True
if failed:
    sys.exit(1)
try:
    import lmcache_async.bench.gpu
    import lmcache_async.cli
    import lmcache_async.engine  # noqa: F401
except Exception as exc:
    print(f"lmcache_async does not import: {type(exc).__name__}: {exc}")
    sys.exit(1)
print("imports ok: " + ", ".join(sorted(checked)) + ", lmcache_async")
EOF
}
if ! logged check_imports; then
    fail 2 "imports are missing or older than pyproject.toml asks (see above): carry them as" \
        "wheels (make gpu-wheels puts them in .whl/) or set PYTHON to a python that has them"
fi

# -- a CUDA device ----------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    logged nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader ||
        true
fi
cuda_probe='import sys, torch
ok = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if ok else "none"
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, device {name}")
sys.exit(0 if ok else 1)'
if ! probe=$("$PY" "${PY_FLAGS[@]}" -c "$cuda_probe" 2>&1); then
    fail 3 "no CUDA device: $probe"
fi
say "$probe"

# -- the CUDA tests ---------------------------------------------------------------------------
# Each test has PER_TEST_TIMEOUT seconds: pytest-timeout's signal method fails a hung test
# with its stacks and goes on, and faulthandler dumps every thread's stack a little earlier
# (a hang inside a C call never sees the signal). No test starts once too little of the
# budget is left for it to finish; at the budget pytest gets SIGINT, which still writes the
# summary and the junit file, and is killed GRACE seconds later.
mapfile -t test_files < <(grep -rl --include='*.py' 'pytest.mark.cuda' tests | sort)
# CUDA tests that ran (not skipped), by the junit summary.
tests_run() {
    "$PY" "${PY_FLAGS[@]}" -c 'import sys, xml.etree.ElementTree as ET
suites = ET.parse(sys.argv[1]).getroot().iter("testsuite")
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))' "$TESTS_XML"
}
tests_status=0
if ((${#test_files[@]} == 0)); then
    say "no CUDA test ran: no test file has a pytest.mark.cuda test"
    tests_status=5
else
    say "CUDA tests (${TEST_TIMEOUT}s in all, ${PER_TEST_TIMEOUT}s each): ${test_files[*]}"
    # The repository's addopts are dropped (its plugins may be missing here); -m cuda selects.
    logged timeout -s INT -k "$GRACE" "$TEST_TIMEOUT" "$PY" "${PY_FLAGS[@]}" -m pytest -m cuda \
        -o addopts= -p no:cacheprovider --import-mode=importlib -v -rA \
        --timeout="$PER_TEST_TIMEOUT" --timeout-method=signal \
        --session-timeout=$((TEST_TIMEOUT - PER_TEST_TIMEOUT - GRACE)) \
        -o faulthandler_timeout=$((PER_TEST_TIMEOUT - 5)) \
        --junitxml="$TESTS_XML" "${test_files[@]}" ||
        tests_status=$?
    # pytest passes a run whose every test skipped (torch sees no device, an extension is
    # missing): that checks nothing, so it counts as pytest's own "no tests ran" (5).
    if ((tests_status == 0)); then
        ran=$(tests_run 2>/dev/null) || ran=""
        if [[ ! $ran =~ ^[0-9]+$ ]]; then
            say "no CUDA test ran: no readable junit summary in $TESTS_XML"
            tests_status=5
        elif ((ran == 0)); then
            say "no CUDA test ran: every one was skipped (the reasons are above)"
            tests_status=5
        fi
    elif ((tests_status == 5)); then
        say "no CUDA test ran: pytest collected none"
    fi
fi

# -- the benchmark ----------------------------------------------------------------------------
# Each part's figures are logged (gpu_bench_part_done) as soon as it ends, and a part that
# fails is recorded in the JSON while the other still runs. At the limit SIGABRT makes
# faulthandler dump every thread's stack.
say "GPU bench (${BENCH_TIMEOUT}s, $BENCH_TOKENS tokens on $BENCH_DEVICE)"
bench_status=0
logged timeout -s ABRT -k "$GRACE" "$BENCH_TIMEOUT" "$PY" "${PY_FLAGS[@]}" -m lmcache_async.cli \
    --log-level INFO bench --gpu --device "$BENCH_DEVICE" --layers 32 --kv-heads 8 --head-size 128 \
    --dtype bfloat16 --block-size 16 --tokens "$BENCH_TOKENS" --repeat 5 --json "$BENCH_JSON" ||
    bench_status=$?

# -- the summary ------------------------------------------------------------------------------
# D2H and H2D against their baselines, the plain memcpy, the share of a layerwise retrieve
# hidden and the tests' counts, read back from the two files; it never changes the outcome.
say "summary of ${BENCH_JSON##*/} and ${TESTS_XML##*/}:"
logged "$PY" "${PY_FLAGS[@]}" scripts/gpu_summary.py "$BENCH_JSON" "$TESTS_XML" ||
    say "no summary: scripts/gpu_summary.py failed (see above)"

describe() {
    case $1 in
        0) echo passed ;;
        124 | 137) echo "timed out ($1)" ;;
        *) echo "failed ($1)" ;;
    esac
}
written=""
for file in "$LOG" "$TESTS_XML" "$BENCH_JSON"; do
    [[ -f $file ]] && written+=" ${file##*/}"
done
tests_said=$(describe "$tests_status")
((tests_status != 5)) || tests_said="no CUDA test ran"
say "CUDA tests: $tests_said; bench: $(describe "$bench_status");" \
    "${SECONDS}s in all; in $OUT:$written"
if ((tests_status != 0 || bench_status != 0)); then
    exit 1
fi
