#!/usr/bin/env bash
# The GPU check, one command, for a machine with a CUDA GPU, a CUDA PyTorch and no network
# (the lent H100/H200: Python 3.12, torch 2.11+cu130, nvcc 13.0, the NCCL wheel, no MPI).
#
#   WHEELHOUSE=DIR bash tools/gpu_check.sh [LOG_DIR]
#   DRY_RUN=1 bash tools/gpu_check.sh [LOG_DIR]     # here, on a CPU, after `make setup`
#
# DIR holds what that machine lacks: horovod-0.28.1.tar.gz (the sdist) and python-hostlist's
# sdist (both from `pip download --no-deps --no-binary :all: horovod==0.28.1 python-hostlist==2.3.0`),
# and the cffi and pycparser wheels for that Python (`pip download --only-binary :all: --python-version 3.12
# --platform manylinux2014_x86_64 cffi pycparser`).
# Stages, each timed: what travels (the working tree and DIR, at most 64 MiB); the machine; Horovod
# built with the project's patch series into the running Python (Gloo as the controller, no MPI; NCCL for
# the GPU collectives; CUDA kernels for the GPUs present only); `horovodrun --check-build`; the
# `gpu` tests (tests/test_gpu.py); then the figures: BERT-large's optimizer step alone, LAMB
# multi-tensor and compiled (training/lamb_fused.py) against torch's fused AdamW
# (tools/measure_optimizer_step.py; first, so that the BERT runs find the compiled LAMB in
# Inductor's cache); benchmark.py train (the trainers' own steps on synthetic data, warm-up and
# compilation left out) for ResNet-50 at 224 px with AMP and BERT-large phase 1 (sequence 128,
# bf16; LAMB compiled, the default on CUDA), each with and without --compile; BERT-large phase 1
# again with the multi-tensor LAMB (HVDTRAIN_LAMB_FUSED=0), the end-to-end comparison; two ranks
# sharing the one GPU. The summary ends with each figure against NVIDIA's A100 and the two LAMBs'
# BERT-large figures side by side.
# GPU_TESTS=0 leaves the gpu tests out and COMPILE_FIGURES=0 the --compile runs: the LAMB figures
# alone fit a short lease (expected 7-8 minutes with the build; not yet run on a GPU):
#   GPU_TESTS=0 COMPILE_FIGURES=0 BUILD_TIMEOUT=200 MEASURE_TIMEOUT=200 WHEELHOUSE=.gpu bash tools/gpu_check.sh $OUT
# LOG_DIR (default: $OUT, else /tmp/gpu-check) receives at most 8 files (what a device call returns):
# machine.log, build.log, gpu-tests.log, measure.log, figures.json, optimizer-step.json, summary.txt.
# DRY_RUN=1 runs every stage it can on a CPU: no build (the installed Horovod), the gpu tests
# deselected, the figures with the smallest models and one timed step, no --compile, and no
# second LAMB (on a CPU the default is the multi-tensor one; the compiled one is tests/test_lamb.py's).
# Ran on a lent NVIDIA H200 on 2026-11-27 (Python 3.12.3, torch 2.11.0+cu130, nvcc 13.0, GCC 13.3,
# CMake 4.4): build 116 s, the 9 gpu tests passed in 135 s; again the same day with the figures:
# 508 s in all (the optimizer stage came after that run). Results in docs/performance.md ("The GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# shellcheck source=scripts/setup/cuda_build.sh
source scripts/setup/cuda_build.sh
DRY_RUN=${DRY_RUN:-0}
LOGS=${1:-${OUT:-/tmp/gpu-check}}
CARRY_LIMIT_MIB=64
mkdir -p "$LOGS"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# pip puts horovodrun beside the interpreter: on PATH for the tests and their launches.
PATH="$($PYTHON -c 'import os, sys; print(os.path.join(sys.prefix, "bin"))'):$PATH"
export PYTHONPATH="$PWD/scripts:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"  # as make setup's .pth
STARTED=$SECONDS
say() { printf '[gpu-check] %s\n' "$*" | tee -a "$LOGS/summary.txt"; }
step() {  # step NAME LOG COMMAND...: run, append to LOGS/LOG, say how it went and how long it took
    local name=$1 log=$LOGS/$2 start=$SECONDS status
    shift 2
    printf '\n=== %s: %s\n' "$name" "$*" >> "$log"
    "$@" >> "$log" 2>&1
    status=$?
    say "$name: exit $status in $((SECONDS - start)) s"
    [ $status -eq 0 ] || tail -25 "$log"
    return $status
}
: > "$LOGS/summary.txt"

# What a device call carries: git's tracked and untracked-not-ignored files, and DIR.
carried_mib() {
    { git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1
      [ -n "${WHEELHOUSE:-}" ] && du -sb "$WHEELHOUSE" | cut -f1; } | awk '{s += $1} END {printf "%.1f", s / 2^20}'
}
CARRIED=$(carried_mib)
say "carried: $CARRIED MiB of at most $CARRY_LIMIT_MIB (the working tree and ${WHEELHOUSE:-no wheelhouse})"
awk -v c="$CARRIED" -v l=$CARRY_LIMIT_MIB 'BEGIN {exit !(c <= l)}' || { say "more than $CARRY_LIMIT_MIB MiB would travel"; exit 1; }

if [ "$DRY_RUN" = 1 ]; then
    step machine machine.log bash -c "uname -m; nproc; $PYTHON -c 'import torch; print(torch.__version__, \"cuda\", torch.cuda.is_available())'"
    say "build: skipped in a dry run (the installed Horovod)"
else
    WHEELHOUSE=${WHEELHOUSE:?set WHEELHOUSE to the folder with the Horovod and python-hostlist sdists}
    step machine machine.log bash -c "nvidia-smi -L; nvcc --version | tail -2; cmake --version | head -1; gcc --version | head -1; $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'"
    cat "$LOGS/machine.log"
    # sm_90 for an H100/H200: the capabilities of the GPUs present, nothing else (minutes, not half an hour).
    CC_LIST=$(gpu_architectures "$PYTHON")
    # NCCL from the wheel torch came with, laid out as Horovod's build expects (cuda_build.sh).
    NCCL=$(nccl_from_wheels "$PYTHON" "$WORK") || { say "no NCCL headers and library in the NCCL wheel"; exit 1; }
    say "NCCL: $NCCL ($(readlink "$NCCL/include"), $(readlink "$NCCL/lib/libnccl.so.2"))"
    CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    # cffi (Horovod's setup.py requires it for the PyTorch extension) and pycparser come as wheels.
    step wheelhouse build.log $PYTHON -m pip install --no-index --no-deps --no-build-isolation "$WHEELHOUSE"/*.whl \
        "$WHEELHOUSE"/python_hostlist-*.tar.gz || exit 1
    tar xzf "$WHEELHOUSE"/horovod-0.28.1.tar.gz -C "$WORK"
    step patch build.log bash scripts/setup/horovod/apply.sh "$WORK/horovod-0.28.1" || exit 1
    # CMake 4 refuses 0.28.1's cmake_minimum_required (below 3.5) without the policy floor. GCC 13
    # dropped transitive standard includes: the series adds the two 0.28.1 lacks (<string>,
    # <stdexcept>); the forced includes also cover any header the build stopped before reaching.
    step build build.log timeout "${BUILD_TIMEOUT:-1800}" env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        CXXFLAGS="-include stdexcept -include string -include cstdint" HOROVOD_GPU_OPERATIONS=NCCL \
        HOROVOD_NCCL_HOME="$NCCL" HOROVOD_CUDA_HOME="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT" \
        HOROVOD_BUILD_CUDA_CC_LIST="$CC_LIST" MAKEFLAGS="-j$(nproc)" \
        $PYTHON -m pip install -v --no-index --no-deps --no-build-isolation "$WORK/horovod-0.28.1" || exit 1
fi
step check-build build.log horovodrun --check-build && sed -n '/check-build/,$p' "$LOGS/build.log" | tail -16

# The tests as CI runs them (a missing component fails), on the GPUs here. Without a GPU all are
# deselected: pytest's status 5 (nothing ran) is then the expected one.
[ "$DRY_RUN" = 1 ] && : "${TEST_WORKERS:=0}"  # nothing to run side by side
if [ "${GPU_TESTS:-1}" = 0 ]; then
    say "gpu-tests: left out (GPU_TESTS=0)"
    tests=0
else
    CI=true step gpu-tests gpu-tests.log timeout "${TESTS_TIMEOUT:-1800}" $PYTHON -m pytest -m gpu -v \
        -p no:cacheprovider -o addopts= -n "${TEST_WORKERS:-3}" --durations=15 tests/test_gpu.py
    tests=$?
    [ "$DRY_RUN" = 1 ] && [ $tests -eq 5 ] && tests=0
    grep -E "PASSED|FAILED|ERROR|passed|failed|deselected" "$LOGS/gpu-tests.log" | tail -20
fi

# The figures: one rank on the GPU, the trainers' steps (benchmark.py train), warm-up left out.
if [ "$DRY_RUN" = 1 ]; then
    CNN=(--model resnet20 --batch-size 4) BERT=(--model bert-mini --batch-size 2 --seq-length 32 --vocab-size 1000)
    TIMING=(--warmup-steps 1 --windows 1 --window-steps 1) COMPILE=() SHARED=(--model resnet20 --batch-size 4)
    OPTIMIZER=(--model bert-mini --vocab-size 1000 --warmup-steps 1 --steps 1)
else
    CNN=(--model resnet50 --image-size 224 --amp --channels-last --batch-size 256)
    BERT=(--model bert-large --precision bf16 --seq-length 128 --vocab-size 30522 --batch-size 64)
    TIMING=(--warmup-steps 10 --windows 3 --window-steps 10) COMPILE=(--compile) SHARED=("${CNN[@]}")
    OPTIMIZER=(--model bert-large --steps 20)
    [ "${COMPILE_FIGURES:-1}" = 0 ] && COMPILE=()
fi
measure() {  # measure NAME NP ARGS...: one benchmark.py train run into LOGS/NAME.json (gathered below)
    local name=$1 np=$2
    shift 2
    step "$name" measure.log timeout "${MEASURE_TIMEOUT:-300}" horovodrun -np "$np" --gloo \
        $PYTHON scripts/benchmark.py train "$@" "${TIMING[@]}" --output "$WORK/$name.json"
}
# The optimizer step alone against torch's fused AdamW (the memory-bound pass every Adam-family
# step makes): LAMB multi-tensor and compiled (both on CUDA), BERT-large's 398 tensors, no forward
# or backward pass. First: the BERT runs below then load the compiled LAMB from Inductor's cache.
step optimizer-step measure.log timeout "${MEASURE_TIMEOUT:-300}" $PYTHON tools/measure_optimizer_step.py \
    "${OPTIMIZER[@]}" --output "$LOGS/optimizer-step.json" \
    && tail -n 8 "$LOGS/measure.log" | grep -E "^(bert-|lamb|adamw)" | tee -a "$LOGS/summary.txt"
measure resnet50-amp 1 "${CNN[@]}"
measure bert-large-phase1 1 "${BERT[@]}"  # LAMB compiled: the default on CUDA
if [ "$DRY_RUN" != 1 ]; then  # the same with the multi-tensor LAMB: the end-to-end comparison
    HVDTRAIN_LAMB_FUSED=0 measure bert-large-phase1-lamb-multi-tensor 1 "${BERT[@]}"
fi
if [ ${#COMPILE[@]} -gt 0 ]; then
    measure resnet50-amp-compile 1 "${CNN[@]}" "${COMPILE[@]}"
    measure bert-large-phase1-compile 1 "${BERT[@]}" "${COMPILE[@]}"
fi
# Two ranks on one GPU: dist.init refuses them with one line (exit 2) before NCCL would; said here.
measure two-ranks-one-gpu 2 "${SHARED[@]}" || say "two ranks on one GPU: $(grep -m1 -iE 'error|duplicate' "$LOGS/measure.log" | cut -c1-200)"
$PYTHON - "$WORK" "$LOGS/figures.json" "$DRY_RUN" <<'PY' | tee -a "$LOGS/summary.txt"
import json, sys
from pathlib import Path
work, out, dry = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
# NVIDIA's published single-GPU A100 figures for the same models (the issue's reference).
A100 = {"resnet50-amp": 2470, "bert-large-phase1": 580}
figures = {}
for path in sorted(work.glob("*.json")):
    result = json.loads(path.read_text())
    figures[path.stem] = {"median": result["total"]["median"], "unit": result["unit"],
                          "per_worker": result["per_worker"]["median"], "environment": result.get("environment")}
for name, figure in figures.items():
    reference = A100.get(name.replace("-compile", "").replace("-lamb-multi-tensor", ""))
    against = f", {figure['median'] / reference:.2f} x NVIDIA's A100 figure ({reference})" if reference and not dry else ""
    print(f"[gpu-check] {name}: {figure['median']:.1f} {figure['unit']}{against}")
compiled, multi = figures.get("bert-large-phase1"), figures.get("bert-large-phase1-lamb-multi-tensor")
if compiled and multi:
    print(f"[gpu-check] BERT-large phase 1, LAMB compiled against multi-tensor: {compiled['median']:.1f} against "
          f"{multi['median']:.1f} {compiled['unit']} ({compiled['median'] / multi['median']:.2f} x)")
out.write_text(json.dumps({"dry_run": dry, "figures": figures, "a100_reference": A100}, indent=1))
PY
say "total: $((SECONDS - STARTED)) s; gpu tests exit $tests"
exit $tests
