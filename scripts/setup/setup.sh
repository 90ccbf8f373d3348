#!/usr/bin/env bash
# `make setup`: everything the scripts need, idempotent.
#   1. system packages the scripts need (Open MPI with headers, cmake, g++) --
#      only the missing ones, only as root, and MPI never when an `mpicc` is
#      already on PATH (a cluster's environment modules). What only the test
#      suite needs (Slurm, munge, sshd) is scripts/setup/test-deps.sh (`make test-deps`);
#   2. the virtual environment .venv with requirements.txt, torch chosen by
#      TORCH_VARIANT / TORCH_INDEX_URL, or the torch already installed
#      (USE_SYSTEM_TORCH=1, never replaced);
#   3. Horovod 0.28.1 built once with the project's patch series (scripts/setup/horovod/,
#      docs/horovod.md), its version labelled 0.28.1+hvdtrain.HASH, into a wheel cache keyed
#      by torch, Python, CUDA and the series, then installed from it.
#      A CUDA torch builds Horovod with NCCL, against CUDA_HOME, the toolkit around
#      `nvcc` on PATH, or else the CUDA compiler wheels of requirements-cuda-build.txt;
#   4. `horovodrun --check-build` must show PyTorch, MPI and Gloo (and NCCL for CUDA), and
#      the installed Horovod the series' version.
# Without MPI (MPI=none, or no `mpicc` and no root to install Open MPI) Horovod is built
# with Gloo alone: `horovodrun --gloo` and elastic jobs work, mpirun does not; mpi4py is
# left out. Said in one line here and by `horovodrun --check-build`.
# With no network: `make wheelhouse WHEELHOUSE=DIR` (setup.sh --make-wheelhouse) gathers every
# package into DIR where there is network; `make setup WHEELHOUSE=DIR` then installs from DIR
# alone, no index and no apt (scripts/setup/wheelhouse.sh).
# `setup.sh --dry-run` prints what it would install and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VARIANT=${TORCH_VARIANT:-auto}      # auto | cpu | cuda
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}      # where pip gets torch (default: see torch_pip_args)
USE_SYSTEM_TORCH=${USE_SYSTEM_TORCH:-0}   # 1: use the torch that $PYTHON already has
MPI=${MPI:-auto}                          # auto: an MPI if there is or can be one; none: Gloo only
WHEELHOUSE=${WHEELHOUSE:-}                # a folder from `make wheelhouse`: install from it alone
CUDA_BUILD_REQUIREMENTS=requirements-cuda-build.txt
WHEEL_CACHE=${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-training-scripts/wheels}
HOROVOD_VERSION=$(sed -n 's/^horovod==\([0-9.]*\).*/\1/p' requirements.txt)
TORCH_REQUIREMENT=$(grep -E '^torch[=<>~ ]' requirements.txt)
NUMPY_REQUIREMENT=$(grep -E '^numpy[=<>~ ]' requirements.txt)
DRY_RUN=0
MAKE_WHEELHOUSE=0

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

have() { command -v "$1" >/dev/null 2>&1; }

for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        --make-wheelhouse) MAKE_WHEELHOUSE=1 ;;
        *) die "unknown argument '$arg' (the options are --dry-run and --make-wheelhouse; the rest are environment variables, see docs/setup.md)" ;;
    esac
done
case $TORCH_VARIANT in
    auto|cpu|cuda) ;;
    *) die "TORCH_VARIANT=$TORCH_VARIANT: use auto (pip's default torch), cpu or cuda" ;;
esac
case $MPI in
    auto|none) ;;
    *) die "MPI=$MPI: use auto (the MPI on PATH, or Open MPI installed as root) or none (Horovod with Gloo only)" ;;
esac
case $USE_SYSTEM_TORCH in
    0|1) ;;
    *) die "USE_SYSTEM_TORCH=$USE_SYSTEM_TORCH: use 1 (the torch $PYTHON already has) or 0" ;;
esac
if [ "$USE_SYSTEM_TORCH" = 1 ] && { [ "$TORCH_VARIANT" != auto ] || [ -n "$TORCH_INDEX_URL" ]; }; then
    die "USE_SYSTEM_TORCH=1 keeps the installed torch: do not combine it with TORCH_VARIANT or TORCH_INDEX_URL"
fi

# shellcheck source=scripts/setup/wheelhouse.sh
source scripts/setup/wheelhouse.sh
# shellcheck source=scripts/setup/cuda_build.sh
source scripts/setup/cuda_build.sh
# shellcheck source=scripts/setup/horovod/apply.sh
source scripts/setup/horovod/apply.sh
HOROVOD_BUILD_VERSION=$HOROVOD_VERSION+$(horovod_series_label)

installing_from_wheelhouse() { [ -n "$WHEELHOUSE" ] && [ "$MAKE_WHEELHOUSE" = 0 ]; }

resolve_mpi() {
    # auto becomes none where no mpicc is on PATH and none can be installed (not root).
    if [ "$MPI" = auto ] && ! have mpicc && installing_from_wheelhouse; then
        MPI=none
        say "no MPI: no mpicc on PATH, and a WHEELHOUSE setup installs no system packages; Horovod is built with Gloo only (horovodrun --gloo and elastic jobs work, mpirun does not; load an MPI module and rerun for mpirun, or set MPI=none to say so)"
    elif [ "$MPI" = auto ] && ! have mpicc && [ "$EUID" -ne 0 ]; then
        MPI=none
        say "no MPI: no mpicc on PATH and not root to install Open MPI; Horovod is built with Gloo only (horovodrun --gloo and elastic jobs work, mpirun does not; load an MPI module and rerun for mpirun, or set MPI=none to say so)"
    elif [ "$MPI" = none ]; then
        say "MPI=none: Horovod is built with Gloo only (horovodrun --gloo and elastic jobs work, mpirun does not)"
    fi
}

install_system_packages() {
    local missing=()
    [ "$MPI" = none ] || have mpicc || missing+=(openmpi-bin libopenmpi-dev)
    have cmake || missing+=(cmake)
    have g++ || missing+=(g++)
    have make || missing+=(make)
    have patch || missing+=(patch)
    "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
    if [ "$DRY_RUN" = 1 ]; then
        say "dry run: apt-get install ${missing[*]:-(nothing missing)}"
        return 0
    fi
    [ ${#missing[@]} -eq 0 ] && return 0
    ! installing_from_wheelhouse || die "missing ${missing[*]}: a WHEELHOUSE setup installs no system packages; install them from your site's mirror, or load your cluster's modules so cmake, g++ (and mpicc) are on PATH, then rerun make setup"
    [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}: install them (apt-get install ${missing[*]}), or load your cluster's MPI/compiler modules so mpicc, cmake and g++ are on PATH, then rerun make setup"
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
}

torch_pip_args() {
    # The pip arguments that install torch for TORCH_VARIANT. PyPI's Linux x86_64
    # torch is the CUDA build; the CPU build lives on PyTorch's own index.
    local index=$TORCH_INDEX_URL
    installing_from_wheelhouse && { echo "$TORCH_REQUIREMENT"; return 0; }  # the wheelhouse's torch
    [ "$TORCH_VARIANT" = cpu ] && [ -z "$index" ] && index=https://download.pytorch.org/whl/cpu
    echo "$TORCH_REQUIREMENT${index:+ --index-url $index}"
}

dry_run_report() {
    if [ "$USE_SYSTEM_TORCH" = 1 ]; then
        say "dry run: venv $VENV with --system-site-packages; torch: the one $PYTHON has (kept, never reinstalled)"
    else
        say "dry run: venv $VENV from $PYTHON; torch: pip install $(torch_pip_args) (TORCH_VARIANT=$TORCH_VARIANT)"
    fi
    say "dry run: Horovod $HOROVOD_BUILD_VERSION ($(horovod_series_patches | wc -l) patches, docs/horovod.md), wheel cache $WHEEL_CACHE"
    [ -z "$WHEELHOUSE" ] || say "dry run: every package from WHEELHOUSE=$WHEELHOUSE (no index, no apt)"
    if [ "$MPI" = none ]; then
        say "dry run: Horovod with Gloo only (HOROVOD_WITHOUT_MPI=1), no mpi4py"
    else
        say "dry run: Horovod with MPI and Gloo, mpi4py against $(command -v mpicc || echo 'the Open MPI installed above')"
    fi
}

python_site_dirs() {
    # Every site-packages directory of the given interpreter (a venv's, conda's, the system's).
    "$1" -c 'import site, sys; print("\n".join(site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])))'
}

create_venv() {
    if [ "$USE_SYSTEM_TORCH" = 1 ]; then
        local torch_file
        torch_file=$("$PYTHON" -c 'import torch; print(torch.__file__)' 2>/dev/null) \
            || die "USE_SYSTEM_TORCH=1 but $PYTHON cannot import torch: point PYTHON at the interpreter that has it (conda, a module, the container's python)"
        [ -x "$VENV/bin/python" ] || { say "creating $VENV on top of $PYTHON's packages"; "$PYTHON" -m venv --system-site-packages "$VENV"; }
        # --system-site-packages exposes the base interpreter's packages only; when
        # $PYTHON is itself a venv, a .pth file adds its site-packages after ours.
        if [ "$("$VENV/bin/python" -c 'import torch; print(torch.__file__)' 2>/dev/null)" != "$torch_file" ]; then
            python_site_dirs "$PYTHON" > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/system-torch.pth"
        fi
        [ "$("$VENV/bin/python" -c 'import torch; print(torch.__file__)' 2>/dev/null)" = "$torch_file" ] \
            || die "$VENV does not use $PYTHON's torch ($torch_file): it has its own; remove $VENV or choose another VENV"
        return 0
    fi
    [ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
}

add_repository_paths() {
    # A .pth file puts scripts/ (the hvdtrain package) and tests/ (its helpers,
    # tests/support) on the venv's path, so that the programs the tests launch
    # (tests/workers/) and the measurement tools (tools/) import them by name.
    local site pth
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    pth="$site/hvd-training-scripts.pth"
    printf '%s\n' "$PWD/scripts" "$PWD/tests" > "$pth.new.$$" && mv -f "$pth.new.$$" "$pth"
}

pip_quiet() {
    # pip, its warnings kept but this machine's pip.conf's absent local folders ("is ignored");
    # from a wheelhouse, a missing package is one line (wheelhouse_lacks), not pip's page.
    local errors status=0
    errors=$(mktemp)
    "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>"$errors" || status=$?
    if [ "$status" -ne 0 ] && installing_from_wheelhouse; then
        wheelhouse_lacks "$errors" || true
    fi
    grep -v "is ignored" "$errors" >&2 || true
    rm -f "$errors"
    return "$status"
}

torch_cuda() {
    # torch's CUDA version ("13.0"), empty for a CPU build.
    "$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "")'
}

install_torch() {
    # torch (with numpy) first: the Horovod build imports it; setuptools/wheel build it.
    local cuda
    if [ "$TORCH_VARIANT" != auto ] && "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        # A torch of the other variant from an earlier run: pip would call it satisfied.
        cuda=$(torch_cuda)
        if { [ "$TORCH_VARIANT" = cpu ] && [ -n "$cuda" ]; } || { [ "$TORCH_VARIANT" = cuda ] && [ -z "$cuda" ]; }; then
            say "TORCH_VARIANT=$TORCH_VARIANT: replacing the torch in $VENV"
            pip_quiet uninstall -y torch
        fi
    fi
    # shellcheck disable=SC2046  # torch_pip_args is a list of words
    pip_quiet install setuptools wheel "$NUMPY_REQUIREMENT" $(torch_pip_args)
    cuda=$(torch_cuda)
    [ "$TORCH_VARIANT" != cpu ] || [ -z "$cuda" ] || die "TORCH_VARIANT=cpu but pip installed a CUDA $cuda torch: set TORCH_INDEX_URL to a CPU index"
    [ "$TORCH_VARIANT" != cuda ] || [ -n "$cuda" ] \
        || die "TORCH_VARIANT=cuda but pip installed a CPU torch ($("$VENV/bin/python" -c 'import torch; print(torch.__version__)')), likely from a local wheel folder in pip.conf: set TORCH_INDEX_URL=https://pypi.org/simple or PIP_CONFIG_FILE=/dev/null"
}

toolkit_complete() {
    # Horovod's CMake (FindCUDAToolkit) needs nvcc, cuda_runtime.h and libcudart.so.
    [ -x "$1/bin/nvcc" ] && { [ -e "$1/include/cuda_runtime.h" ] || compgen -G "$1/targets/*/include/cuda_runtime.h" >/dev/null; } \
        && { compgen -G "$1/lib*/libcudart.so" >/dev/null || compgen -G "$1/targets/*/lib/libcudart.so" >/dev/null; }
}

pypi_cuda_toolkit() {
    # The CUDA compiler and runtime from PyPI wheels, installed into $1 (the build's
    # scratch folder, not the venv): no system toolkit, no GPU needed to build.
    local cuda=$2 want root
    want=$(sed -n 's/^# CUDA \([0-9.]*\):.*/\1/p' "$CUDA_BUILD_REQUIREMENTS")
    [ "$cuda" = "$want" ] || die "torch is a CUDA $cuda build and no CUDA toolkit is here (nvcc and libcudart.so under CUDA_HOME, or around nvcc on PATH), and $CUDA_BUILD_REQUIREMENTS pins CUDA $want: load a CUDA $cuda module or set CUDA_HOME"
    say "no CUDA toolkit on PATH or in CUDA_HOME: installing the CUDA $cuda compiler wheels of $CUDA_BUILD_REQUIREMENTS for the build" >&2
    # (|| die: errexit does not reach inside the $(...) this runs in)
    pip_quiet install --no-deps --target "$1/cuda-wheels" -r "$CUDA_BUILD_REQUIREMENTS" >&2 \
        || die "could not install the CUDA compiler wheels of $CUDA_BUILD_REQUIREMENTS (pip's message above)"
    root=$(dirname "$(dirname "$(compgen -G "$1/cuda-wheels/nvidia/*/bin/nvcc" | head -1)")")
    # The wheels ship libcudart.so.13 only; CMake looks for libcudart.so (and lib64).
    ln -s "$(basename "$(compgen -G "$root/lib/libcudart.so.*" | head -1)")" "$root/lib/libcudart.so"
    ln -s lib "$root/lib64"
    toolkit_complete "$root" || die "the wheels of $CUDA_BUILD_REQUIREMENTS gave no complete toolkit under $root"
    echo "$root"
}

cuda_toolkit() {
    # The toolkit to build against: CUDA_HOME, the one around nvcc on PATH, or PyPI's.
    local cuda=$2 home
    if [ -n "${CUDA_HOME:-}" ]; then
        toolkit_complete "$CUDA_HOME" || die "CUDA_HOME=$CUDA_HOME is not a complete CUDA toolkit (need bin/nvcc, include/cuda_runtime.h and lib64/libcudart.so)"
        echo "$CUDA_HOME"; return 0
    fi
    if have nvcc; then
        # Ask nvcc where its toolkit is: the nvcc on PATH may be a wrapper script
        # (this machine's /usr/local/bin/nvcc execs /usr/local/cuda-13.0/bin/nvcc).
        home=$(nvcc -v --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
        home=$(readlink -f "${home:-$(dirname "$(readlink -f "$(command -v nvcc)")")/..}")
        toolkit_complete "$home" && { echo "$home"; return 0; }
        say "nvcc on PATH but $home has no cuda_runtime.h or libcudart.so: not using it" >&2
    fi
    pypi_cuda_toolkit "$1" "$cuda"
}

nccl_home() {
    # NCCL for HOROVOD_GPU_OPERATIONS=NCCL: HOROVOD_NCCL_HOME, a system install,
    # or the nvidia-nccl wheel that CUDA builds of torch bring along (cuda_build.sh).
    if [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ -e /usr/include/nccl.h ]; then
        echo "${HOROVOD_NCCL_HOME:-}"; return 0
    fi
    nccl_from_wheels "$VENV/bin/python" "$1" \
        || die "CUDA build needs NCCL: set HOROVOD_NCCL_HOME or load an NCCL module (no nccl.h and libnccl.so.2 in an nvidia wheel either)"
}

cuda_architectures() {
    # The GPUs present (cuda_build.sh); HOROVOD_BUILD_CUDA_CC_LIST wins.
    [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ] || { echo "$HOROVOD_BUILD_CUDA_CC_LIST"; return 0; }
    gpu_architectures "$VENV/bin/python"
}

build_horovod_wheel() {
    local torch_version python_version cuda tag cache_dir work src
    # The cache key keeps a custom build's local label (NGC's 2.6.0a0+ecf3bae) but
    # not +cpu/+cu130, which the cpu/cuXY tag already says.
    torch_version=$("$VENV/bin/python" -c 'import re, torch; print(re.sub(r"\+(cpu|cu\d+)$", "", torch.__version__).replace("+", "_"))')
    python_version=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    cuda=$(torch_cuda)
    tag=${cuda:+cu$cuda}
    tag=${tag:-cpu}
    [ "$MPI" = none ] && tag=$tag-gloo
    # The series' label too: a changed series must never reuse a wheel built without it.
    cache_dir="$WHEEL_CACHE/horovod-$HOROVOD_BUILD_VERSION-torch-$torch_version-py$python_version-$tag"
    if ls "$cache_dir"/horovod-*.whl >/dev/null 2>&1; then
        say "reusing cached Horovod wheel in $cache_dir"
        FIND_LINKS=$cache_dir
        return 0
    fi

    say "building Horovod $HOROVOD_BUILD_VERSION for torch $torch_version, Python $python_version, $tag (minutes: see docs/setup-proof.md)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"; trap - RETURN' RETURN
    if installing_from_wheelhouse; then
        [ -f "$WHEELHOUSE/horovod-$HOROVOD_VERSION.tar.gz" ] \
            || die "WHEELHOUSE=$WHEELHOUSE has no horovod-$HOROVOD_VERSION.tar.gz: remake it with 'make wheelhouse' on a machine with network"
        cp "$WHEELHOUSE/horovod-$HOROVOD_VERSION.tar.gz" "$work/"
    else
        pip_quiet download --no-deps --no-binary horovod "horovod==$HOROVOD_VERSION" -d "$work"
    fi
    tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    horovod_series_apply "$src" || die "the Horovod patch series does not apply (scripts/setup/horovod/series)"

    local with_mpi=HOROVOD_WITH_MPI=1
    [ "$MPI" = none ] && with_mpi=HOROVOD_WITHOUT_MPI=1
    local -a build_env=(HOROVOD_WITH_PYTORCH=1 "$with_mpi" HOROVOD_WITH_GLOO=1
                        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
                        # CMake 4 refuses 0.28.1's cmake_minimum_required below 3.5 without this floor.
                        CMAKE_POLICY_VERSION_MINIMUM=3.5
                        MAKEFLAGS="-j$(nproc)")
    if [ -n "$cuda" ]; then
        # Horovod's CMake compiles CUDA kernels whenever torch is a CUDA build.
        local toolkit nccl
        toolkit=$(cuda_toolkit "$work" "$cuda")
        nccl=$(nccl_home "$work")
        local architectures
        architectures=$(cuda_architectures)
        say "CUDA build: HOROVOD_GPU_OPERATIONS=NCCL, CUDA toolkit $toolkit${nccl:+, NCCL from $nccl}, architectures ${architectures:-all (no GPU visible)}"
        # nvcc first on PATH and HOROVOD_CUDA_HOME: both are where Horovod's CMake
        # and its build_utils.get_nvcc_bin look.
        build_env+=(HOROVOD_GPU_OPERATIONS=NCCL ${nccl:+HOROVOD_NCCL_HOME=$nccl}
                    CUDA_HOME="$toolkit" HOROVOD_CUDA_HOME="$toolkit" CUDAToolkit_ROOT="$toolkit"
                    PATH="$toolkit/bin:$PATH" ${architectures:+HOROVOD_BUILD_CUDA_CC_LIST=$architectures})
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
    local stamp="$VENV/.setup-stamp" want reqs constraints
    want="$(sha256sum < requirements.txt | cut -d' ' -f1) $HOROVOD_BUILD_VERSION"
    want="$want $TORCH_VARIANT $TORCH_INDEX_URL $USE_SYSTEM_TORCH MPI=$MPI"
    # An environment's own torch may change under us (a module or container update).
    [ "$USE_SYSTEM_TORCH" = 0 ] || want="$want $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c 'import horovod.torch' 2>/dev/null; then
        say "requirements already installed"
        return 0
    fi
    if [ "$USE_SYSTEM_TORCH" = 1 ]; then
        say "using torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__, "from", torch.__file__)')"
        pip_quiet install setuptools wheel
    else
        install_torch
    fi
    # Horovod's setup.py asks for cffi (setup_requires), which setuptools would fetch from an index.
    pip_quiet install "$(grep -E '^cffi[=<>~ ]' requirements.txt)"
    build_horovod_wheel

    # The rest, with torch pinned to the one now installed: requirements.txt
    # without its torch line, and a constraint so no dependency can pull another torch.
    reqs="$VENV/requirements-without-torch.txt"
    constraints="$VENV/constraints-torch.txt"
    grep -vE '^torch[=<>~ ]' requirements.txt > "$reqs"
    # Gloo only: mpi4py would need an MPI to compile against.
    [ "$MPI" != none ] || sed -i -E '/^(--no-binary )?mpi4py/d' "$reqs"
    "$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__)' > "$constraints"
    # Horovod from our wheel into this venv, even where an outer environment has one
    # (--ignore-installed); the venv's own earlier build first goes (else pip list shows both).
    if compgen -G "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/horovod-*.dist-info" >/dev/null; then
        pip_quiet uninstall -y horovod
    fi
    pip_quiet install --no-deps --ignore-installed --find-links "$FIND_LINKS" "horovod==$HOROVOD_BUILD_VERSION"
    pip_quiet install --find-links "$FIND_LINKS" -r "$reqs" -c "$constraints"
    "$VENV/bin/python" -c 'import horovod.torch' || die "horovod.torch does not import after install"
    echo "$want" > "$stamp"
}

check_horovod_build() {
    local report installed features=(PyTorch MPI Gloo)
    installed=$("$VENV/bin/python" -c 'import horovod; print(horovod.__version__)')
    [ "$installed" = "$HOROVOD_BUILD_VERSION" ] \
        || die "the installed Horovod is $installed, not this series' $HOROVOD_BUILD_VERSION: rerun make setup (or remove $VENV)"
    [ "$MPI" = none ] && features=(PyTorch Gloo)
    [ -z "$(torch_cuda)" ] || features+=(NCCL)
    report=$("$VENV/bin/horovodrun" --check-build)
    for feature in "${features[@]}"; do
        grep -q "\[X\] $feature" <<<"$report" || { echo "$report" >&2; die "Horovod was built without $feature"; }
    done
    # "PyTorch, MPI and Gloo available" (", NCCL" before the "and" for CUDA)
    local list
    list=$(IFS=,; echo "${features[*]:0:${#features[@]}-1}")
    local only=""
    [ "$MPI" = none ] && only=" (no MPI: Gloo only)"
    say "horovodrun --check-build: Horovod $installed ($(horovod_series_patches | wc -l) patches over 0.28.1: docs/horovod.md); ${list//,/, } and ${features[-1]} available$only"
}

if [ "$MAKE_WHEELHOUSE" = 1 ]; then
    make_wheelhouse "${WHEELHOUSE:-wheelhouse}"
    exit 0
fi
installing_from_wheelhouse && use_wheelhouse
resolve_mpi
install_system_packages
if [ "$DRY_RUN" = 1 ]; then
    dry_run_report
    exit 0
fi
create_venv
add_repository_paths
install_requirements
check_horovod_build
say "done: activate with 'source $VENV/bin/activate'"
