# The wheelhouse: every package `make setup` installs, in one folder, for a machine with
# no network (a compute node, an air-gapped cluster, the GPU machine). Sourced by setup.sh.
#
#   make wheelhouse WHEELHOUSE=DIR        (here, with network: PYTHON, TORCH_VARIANT,
#                                          TORCH_INDEX_URL, USE_SYSTEM_TORCH, MPI as for setup)
#   make setup WHEELHOUSE=DIR             (there: no index, no apt; one line if something is missing)
#
# DIR holds: the wheels of requirements.txt and their dependencies for this PYTHON (its
# version and platform: run it with the target's Python version), torch as TORCH_VARIANT
# chooses it (none with USE_SYSTEM_TORCH=1: the target's own torch is used), the sdists that
# setup compiles there (Horovod, with the project's patch series beside it; mpi4py, against the
# target's MPI; python-hostlist), everything their builds need (setuptools, wheel, cffi and
# each sdist's build-system requirements, dynamic ones included), and wheelhouse.txt saying
# what it was made for.

WHEELHOUSE_MANIFEST=wheelhouse.txt

wheelhouse_python_tag() {
    # "cp311-x86_64": what the wheels were chosen for.
    "$1" -c 'import platform, sys; print("cp%d%d-%s" % (sys.version_info[:2] + (platform.machine(),)))'
}

make_wheelhouse() {
    local dir=$1 work sdists
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    work=$(mktemp -d)
    trap 'rm -rf "$work"; trap - RETURN' RETURN
    # A scratch venv of the target's Python: its pip chooses wheels for that version.
    "$PYTHON" -m venv "$work/venv"
    scratch_pip() { "$work/venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }
    say "wheelhouse $dir for $(wheelhouse_python_tag "$PYTHON") (PYTHON=$PYTHON)"
    if [ "$USE_SYSTEM_TORCH" = 1 ]; then
        say "USE_SYSTEM_TORCH=1: no torch in it (the target's own is used)"
        scratch_pip download -d "$dir" setuptools wheel "$NUMPY_REQUIREMENT"
    else
        # shellcheck disable=SC2046  # torch_pip_args is a list of words
        scratch_pip download -d "$dir" setuptools wheel "$NUMPY_REQUIREMENT" $(torch_pip_args)
        # A CUDA torch (its nvidia-* wheels came along): the compiler wheels that build Horovod
        # where the target has no CUDA toolkit.
        if compgen -G "$dir/nvidia_*.whl" >/dev/null; then
            scratch_pip download --no-deps -d "$dir" -r "$CUDA_BUILD_REQUIREMENTS"
        fi
    fi
    # The rest of requirements.txt (mpi4py as an sdist: it is compiled against the target's MPI).
    grep -vE '^(torch|horovod)[=<>~ ]' requirements.txt > "$work/requirements.txt"
    [ "$MPI" != none ] || sed -i -E '/^(--no-binary )?mpi4py/d' "$work/requirements.txt"
    scratch_pip download -d "$dir" -r "$work/requirements.txt"
    scratch_pip download -d "$dir" --no-deps --no-binary horovod "horovod==$HOROVOD_VERSION"
    # The series too (setup applies the repository's own; this copy says what the wheelhouse was for).
    mkdir -p "$dir/horovod-series"
    cp "$HOROVOD_SERIES_DIR/series" "$HOROVOD_SERIES_DIR"/*.patch "$dir/horovod-series/"
    # What building the sdists there needs: each one's build-system requirements, static and
    # those its backend asks for (mpi4py: Cython), found with the `build` package here.
    sdists=$(find "$dir" -maxdepth 1 -name '*.tar.gz' ! -name "horovod-*")
    if [ -n "$sdists" ]; then
        scratch_pip install build
        # shellcheck disable=SC2086  # one path per word
        "$work/venv/bin/python" - "$work/build-requirements.txt" $sdists <<'EOF' || die "could not read the build requirements of $sdists"
import sys, tarfile, tempfile
from pathlib import Path
from build import ProjectBuilder
from build.env import DefaultIsolatedEnv
from pyproject_hooks import quiet_subprocess_runner
needed = set()
for sdist in sys.argv[2:]:
    with tempfile.TemporaryDirectory() as unpacked:
        with tarfile.open(sdist) as archive:
            archive.extractall(unpacked, filter="data")
            top = archive.getnames()[0].split("/")[0]
        with DefaultIsolatedEnv() as env:
            builder = ProjectBuilder.from_isolated_env(env, f"{unpacked}/{top}", runner=quiet_subprocess_runner)
            env.install(builder.build_system_requires)
            needed |= builder.build_system_requires | builder.get_requires_for_build("wheel")
Path(sys.argv[1]).write_text("".join(f"{line}\n" for line in sorted(needed)))
EOF
        scratch_pip download -d "$dir" --only-binary :all: -r "$work/build-requirements.txt"
    fi
    {
        echo "python $(wheelhouse_python_tag "$PYTHON")"
        echo "torch $([ "$USE_SYSTEM_TORCH" = 1 ] && echo "the target's own (USE_SYSTEM_TORCH=1)" \
                      || basename "$(compgen -G "$dir/torch-*.whl" | head -1)")"
        echo "mpi $([ "$MPI" = none ] && echo "none (no mpi4py)" || echo "mpi4py compiled at setup")"
        echo "horovod $HOROVOD_BUILD_VERSION (the series in horovod-series/)"
        echo "made $(date -u +%Y-%m-%dT%H:%MZ) by make wheelhouse"
    } > "$dir/$WHEELHOUSE_MANIFEST"
    say "wheelhouse $dir: $(find "$dir" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(find "$dir" -maxdepth 1 -name '*.tar.gz' | wc -l) sdists, $(du -sh "$dir" | cut -f1); install with: make setup WHEELHOUSE=$dir"
}

use_wheelhouse() {
    # Every pip of this setup installs from the wheelhouse alone (the environment outranks any
    # pip.conf: no index, no other find-links).
    [ -f "$WHEELHOUSE/$WHEELHOUSE_MANIFEST" ] \
        || die "WHEELHOUSE=$WHEELHOUSE is not a wheelhouse (no $WHEELHOUSE_MANIFEST): make one with 'make wheelhouse WHEELHOUSE=DIR' on a machine with network"
    WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
    local made_for here
    made_for=$(sed -n 's/^python //p' "$WHEELHOUSE/$WHEELHOUSE_MANIFEST")
    here=$(wheelhouse_python_tag "$PYTHON")
    [ "$made_for" = "$here" ] \
        || die "WHEELHOUSE=$WHEELHOUSE was made for $made_for, this PYTHON is $here: make it with PYTHON set to a $here interpreter"
    export PIP_NO_INDEX=1 PIP_FIND_LINKS=$WHEELHOUSE
    say "installing from WHEELHOUSE=$WHEELHOUSE alone (no index, no apt)"
}

wheelhouse_lacks() {
    # pip's "No matching distribution found for X==1.2" in file $1, as one line.
    local missing
    missing=$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' "$1" | head -1)
    [ -n "$missing" ] || return 1
    die "WHEELHOUSE=$WHEELHOUSE has nothing that installs '$missing' on $(wheelhouse_python_tag "$PYTHON"): remake it with 'make wheelhouse' (the same PYTHON, TORCH_VARIANT, USE_SYSTEM_TORCH, MPI) on a machine with network"
}
