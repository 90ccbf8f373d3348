#!/usr/bin/env bash
# The Horovod patch series: `apply.sh SRC` applies it, in the order of the file `series`, to an
# unpacked horovod-0.28.1 source tree and labels the version it builds 0.28.1+hvdtrain.HASH
# (HASH: the series' names and contents), which pip list, horovod.__version__ and
# `horovodrun --version` then show. Sourced (make setup, tools/gpu_check.sh), it defines the
# functions below. What each patch changes: its header, and docs/horovod.md.
HOROVOD_SERIES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

horovod_series_patches() {
    # The patch files, in order (the series file without comments and blank lines).
    sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$HOROVOD_SERIES_DIR/series"
}

horovod_series_label() {
    # "hvdtrain.1a2b3c4d": the local version label of a build of this series.
    local hash
    hash=$(cd "$HOROVOD_SERIES_DIR" && { horovod_series_patches; horovod_series_patches | xargs cat; } | sha256sum | cut -c1-8)
    echo "hvdtrain.$hash"
}

horovod_series_apply() {
    # Applies the series to the source tree $1 and labels its version; one line if a patch fails.
    local src=$1 patch version
    [ -f "$src/horovod/__init__.py" ] || { echo "apply.sh: $src is not a Horovod source tree" >&2; return 2; }
    for patch in $(horovod_series_patches); do
        patch -d "$src" -p1 --forward --quiet < "$HOROVOD_SERIES_DIR/$patch" >/dev/null \
            || { echo "apply.sh: $patch does not apply to $src (is it a clean horovod-0.28.1?)" >&2; return 1; }
    done
    version=$(sed -n "s/^__version__ = '\([^'+]*\).*'/\1/p" "$src/horovod/__init__.py")
    sed -i "s/^__version__ = .*/__version__ = '$version+$(horovod_series_label)'/" "$src/horovod/__init__.py"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    [ $# -eq 1 ] || { echo "usage: $0 HOROVOD_SOURCE_DIR" >&2; exit 2; }
    horovod_series_apply "$1"
fi
