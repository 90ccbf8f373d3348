#!/usr/bin/env bash
# The GPU check, one command, for a machine with a CUDA GPU, a CUDA PyTorch and no network
# (the lent H100/H200: Python 3.12, torch 2.11+cu130, nvcc 13.0, the NCCL wheel, no MPI).
#
#   WHEELHOUSE=DIR bash tools/gpu_check.sh [LOG_DIR]
#
# DIR holds what that machine lacks: horovod-0.28.1.tar.gz (the sdist) and python-hostlist's
# sdist (both from `pip download --no-deps --no-binary :all: horovod==0.28.1 python-hostlist==2.3.0`),
# and the cffi and pycparser wheels for that Python (`pip download --only-binary :all: --python-version 3.12
# --platform manylinux2014_x86_64 cffi pycparser`).
# It builds Horovod with the project's patch into the running Python: Gloo as the controller
# (no MPI), NCCL for the GPU collectives, CUDA kernels for the GPUs present only; then runs
# `horovodrun --check-build` and the `gpu` tests (tests/test_gpu.py). Each step's output goes
# to LOG_DIR (default: $OUT, else /tmp/gpu-check); the last lines say what passed.
# Status: ran on a lent NVIDIA H200 on 2026-11-27 (Python 3.12.3, torch 2.11.0+cu130, nvcc 13.0,
# GCC 13.3, CMake 4.4): build 116 s, the 9 gpu tests passed in 135 s; figures and what the first
# runs found in docs/performance.md ("GPU check"). A whole check takes about 5 minutes of device
# time once the machine is up: run it as one call (see the device notes in docs/testing.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:?set WHEELHOUSE to the folder with the Horovod and python-hostlist sdists}
LOGS=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$LOGS"
WORK=$(mktemp -d)
# pip puts horovodrun beside the interpreter: on PATH for the tests and their launches.
PATH="$($PYTHON -c 'import os, sys; print(os.path.join(sys.prefix, "bin"))'):$PATH"
say() { printf '[gpu-check] %s\n' "$*"; }
step() {  # step NAME COMMAND...: run, log to LOGS/NAME.log, say how it went and how long it took
    local name=$1 start=$SECONDS status
    shift
    "$@" > "$LOGS/$name.log" 2>&1
    status=$?
    say "$name: exit $status in $((SECONDS - start)) s"
    [ $status -eq 0 ] || tail -25 "$LOGS/$name.log"
    return $status
}

step machine bash -c "nvidia-smi -L; nvcc --version | tail -2; cmake --version | head -1; $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'"
cat "$LOGS/machine.log"
# sm_90 for an H100/H200: the capabilities of the GPUs present, nothing else (minutes, not half an hour).
CC_LIST=$($PYTHON -c 'import torch; print(",".join(sorted({"%d%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))')
# NCCL from the wheel torch came with (nvidia-nccl-cu12 or -cu13: the layout differs), found by
# its files: a folder with nccl.h and libnccl.so.2 laid out as Horovod's build expects.
read -r NCCL_H NCCL_SO < <($PYTHON - <<'PY'
import glob, os, site
roots = site.getsitepackages()
def find(name):
    hits = [h for r in roots for h in glob.glob(os.path.join(r, "nvidia", "**", name), recursive=True)]
    return hits[0] if hits else "-"
print(find("nccl.h"), find("libnccl.so.2"))
PY
)
say "NCCL: $NCCL_H $NCCL_SO"
[ "$NCCL_H" != - ] && [ "$NCCL_SO" != - ] || { say "no NCCL headers and library in the NCCL wheel"; exit 1; }
mkdir -p "$WORK/nccl/lib"
ln -s "$(dirname "$NCCL_H")" "$WORK/nccl/include"
ln -s "$NCCL_SO" "$WORK/nccl/lib/libnccl.so"  # the wheel ships only the .so.2
ln -s "$NCCL_SO" "$WORK/nccl/lib/libnccl.so.2"
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")

# cffi (Horovod's setup.py requires it for the PyTorch extension) and pycparser come as wheels.
step wheelhouse $PYTHON -m pip install --no-index --no-deps --no-build-isolation "$WHEELHOUSE"/*.whl \
    "$WHEELHOUSE"/python_hostlist-*.tar.gz || exit 1
tar xzf "$WHEELHOUSE"/horovod-0.28.1.tar.gz -C "$WORK"
step patch patch -d "$WORK/horovod-0.28.1" -p1 -i "$PWD/scripts/setup/horovod-0.28.1-torch-cxx17.patch" || exit 1
# CMake 4 refuses 0.28.1's cmake_minimum_required (below 3.5) without the policy floor. GCC 13
# dropped transitive standard includes: the patch adds the two 0.28.1 lacks (<string>,
# <stdexcept>); the forced includes also cover any header the build stopped before reaching.
step build timeout "${BUILD_TIMEOUT:-1800}" env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 CXXFLAGS="-include stdexcept -include string -include cstdint" HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$WORK/nccl" \
    HOROVOD_CUDA_HOME="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT" HOROVOD_BUILD_CUDA_CC_LIST="$CC_LIST" \
    MAKEFLAGS="-j$(nproc)" $PYTHON -m pip install -v --no-index --no-deps --no-build-isolation "$WORK/horovod-0.28.1" \
    || exit 1
step check-build horovodrun --check-build && cat "$LOGS/check-build.log"
# The tests as CI runs them (a missing component fails), on the GPUs here; PYTHONPATH as make setup's .pth.
PYTHONPATH="$PWD/scripts:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" CI=true \
    step gpu-tests timeout "${TESTS_TIMEOUT:-1800}" $PYTHON -m pytest -m gpu -v -p no:cacheprovider -o addopts= \
    -n "${TEST_WORKERS:-3}" --durations=15 tests/test_gpu.py
status=$?
grep -E "PASSED|FAILED|ERROR|passed|failed" "$LOGS/gpu-tests.log" | tail -20
rm -rf "$WORK"
exit $status
