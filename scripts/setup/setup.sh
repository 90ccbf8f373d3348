#!/usr/bin/env bash
# `make setup`: everything the scripts and the test suite need, idempotent.
#   1. system packages (Open MPI with headers, cmake, g++; Slurm, munge, sshd for
#      the tests) -- only the missing ones, only as root, and MPI never when an
#      `mpicc` is already on PATH (a cluster's environment modules);
#   2. the virtual environment .venv with requirements.txt;
#   3. Horovod 0.28.1 built once, patched for today's PyTorch, into a wheel cache
#      keyed by Horovod, torch, Python and CUDA versions, then installed from it;
#   4. `horovodrun --check-build` must show PyTorch, MPI and Gloo.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PATCH=scripts/setup/horovod-0.28.1-torch-cxx17.patch
WHEEL_CACHE=${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-training-scripts/wheels}
HOROVOD_VERSION=$(sed -n 's/^horovod==\([0-9.]*\).*/\1/p' requirements.txt)
TORCH_REQUIREMENT=$(grep -E '^torch[=<>~ ]' requirements.txt)
NUMPY_REQUIREMENT=$(grep -E '^numpy[=<>~ ]' requirements.txt)

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

have() { command -v "$1" >/dev/null 2>&1; }

install_system_packages() {
    local missing=()
    have mpicc || missing+=(openmpi-bin libopenmpi-dev)
    have cmake || missing+=(cmake)
    have g++ || missing+=(g++)
    have make || missing+=(make)
    have patch || missing+=(patch)
    "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
    # Needed by the test suite only: a real Slurm, real sshd hosts.
    local test_missing=()
    have slurmctld || test_missing+=(slurm-wlm)
    have munged || [ -x /usr/sbin/munged ] || test_missing+=(munge)
    [ -x /usr/sbin/sshd ] || test_missing+=(openssh-server openssh-client)
    have ip || test_missing+=(iproute2)
    [ ${#missing[@]} -eq 0 ] && [ ${#test_missing[@]} -eq 0 ] && return 0

    if [ "$(id -u)" -ne 0 ]; then
        [ ${#missing[@]} -eq 0 ] || die "missing ${missing[*]}: install them (apt-get install ${missing[*]}), or load your cluster's MPI/compiler modules so mpicc, cmake and g++ are on PATH, then rerun make setup"
        say "not root: skipping ${test_missing[*]} (only the tests that launch Slurm or sshd hosts need them)"
        return 0
    fi
    say "apt-get install ${missing[*]} ${test_missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" "${test_missing[@]}" >/dev/null
}

create_venv() {
    [ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
}

pip_quiet() {
    # This machine's pip.conf names local wheel folders that may be absent; drop those warnings.
    "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2)
}

cuda_tag() {
    # "cpu" for a CPU torch; "cu<version>" for a CUDA torch with a toolkit to build against.
    local cuda home
    cuda=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "")')
    [ -n "$cuda" ] || { echo cpu; return 0; }
    home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")}
    # Horovod's CMake builds CUDA kernels whenever torch is a CUDA build, so a
    # partial toolkit (nvcc without the runtime library) cannot build at all.
    if ! have nvcc || ! compgen -G "$home/lib*/libcudart.so*" >/dev/null \
            && ! compgen -G "$home/targets/*/lib/libcudart.so*" >/dev/null; then
        die "torch is a CUDA $cuda build but no complete CUDA toolkit is here (need nvcc and libcudart under CUDA_HOME=$home): load your cluster's CUDA module, or install the CPU build of torch"
    fi
    echo "cu$cuda"
}

nccl_home() {
    # NCCL for HOROVOD_GPU_OPERATIONS=NCCL: HOROVOD_NCCL_HOME, a system install,
    # or the nvidia-nccl wheel that CUDA builds of torch bring along.
    if [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ -e /usr/include/nccl.h ]; then
        echo "${HOROVOD_NCCL_HOME:-}"; return 0
    fi
    local wheel_dir
    wheel_dir=$("$VENV/bin/python" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null) \
        || die "CUDA build needs NCCL: set HOROVOD_NCCL_HOME or load an NCCL module"
    # The wheel ships only libnccl.so.2; CMake looks for libnccl.so.
    mkdir -p "$1/nccl/lib"
    ln -sf "$wheel_dir/include" "$1/nccl/include"
    ln -sf "$wheel_dir/lib/libnccl.so.2" "$1/nccl/lib/libnccl.so"
    echo "$1/nccl"
}

build_horovod_wheel() {
    local torch_version python_version tag cache_dir work src
    torch_version=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
    python_version=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    tag=$(cuda_tag)
    cache_dir="$WHEEL_CACHE/horovod-$HOROVOD_VERSION-torch-$torch_version-py$python_version-$tag"
    if ls "$cache_dir"/horovod-*.whl >/dev/null 2>&1; then
        say "reusing cached Horovod wheel in $cache_dir"
        FIND_LINKS=$cache_dir
        return 0
    fi

    say "building Horovod $HOROVOD_VERSION for torch $torch_version, Python $python_version, $tag (about 4 minutes on 2 cores)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"; trap - RETURN' RETURN
    pip_quiet download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    patch -d "$src" -p1 --quiet < "$PATCH"

    local -a build_env=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
                        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
                        MAKEFLAGS="-j$(nproc)")
    if [ "$tag" != cpu ]; then
        local nccl
        nccl=$(nccl_home "$work")
        say "CUDA build: HOROVOD_GPU_OPERATIONS=NCCL${nccl:+ with NCCL from $nccl}"
        build_env+=(HOROVOD_GPU_OPERATIONS=NCCL ${nccl:+HOROVOD_NCCL_HOME=$nccl})
    fi
    # --no-build-isolation: Horovod's CMake imports the torch we just installed.
    ( export "${build_env[@]}"
      pip_quiet wheel --no-deps --no-build-isolation -w "$work/wheel" "$src" ) \
        > "$work/build.log" 2>&1 || {
            cp "$work/build.log" "$VENV/horovod-build.log"
            grep -A8 "CMake Error" "$work/build.log" | head -40 >&2 || true
            tail -15 "$work/build.log" >&2
            die "Horovod build failed; full log: $VENV/horovod-build.log"; }
    mkdir -p "$WHEEL_CACHE"
    mv "$work/wheel" "$cache_dir.tmp.$$" && mv -T "$cache_dir.tmp.$$" "$cache_dir"
    FIND_LINKS=$cache_dir
}

install_requirements() {
    local stamp="$VENV/.setup-stamp" want
    want=$(cat requirements.txt "$PATCH" | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c 'import horovod.torch' 2>/dev/null; then
        say "requirements already installed"
        return 0
    fi
    # torch (with numpy) first: the Horovod build imports it; setuptools/wheel build it.
    pip_quiet install setuptools wheel "$NUMPY_REQUIREMENT" "$TORCH_REQUIREMENT"
    build_horovod_wheel
    pip_quiet install --find-links "$FIND_LINKS" -r requirements.txt
    "$VENV/bin/python" -c 'import horovod.torch' || die "horovod.torch does not import after install"
    echo "$want" > "$stamp"
}

check_horovod_build() {
    local report
    report=$("$VENV/bin/horovodrun" --check-build)
    for feature in PyTorch MPI Gloo; do
        grep -q "\[X\] $feature" <<<"$report" || { echo "$report" >&2; die "Horovod was built without $feature"; }
    done
    say "horovodrun --check-build: PyTorch, MPI and Gloo available"
}

install_system_packages
create_venv
install_requirements
check_horovod_build
say "done: activate with 'source $VENV/bin/activate'"
