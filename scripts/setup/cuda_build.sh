# What a CUDA build of Horovod needs to know of this machine, for setup.sh's CUDA path and
# tools/gpu_check.sh: the NCCL that CUDA builds of torch bring along, and the GPUs present.
# Functions only; sourced.

nccl_from_wheels() {
    # PYTHON DIR: DIR/nccl laid out as Horovod's build expects (include/, lib/libnccl.so), from the
    # nvidia-nccl wheel of PYTHON's torch, found by its files (nvidia-nccl-cu12 and -cu13 lay them
    # out differently: the GPU check, 2026-11-27); prints DIR/nccl, or fails when there is none.
    local header library
    read -r header library < <("$1" - <<'PY'
import glob, os, site, sys
roots = site.getsitepackages() + [path for path in sys.path if path.endswith("-packages")]  # .pth-added too
def find(name):
    hits = [h for r in roots for h in glob.glob(os.path.join(r, "nvidia", "**", name), recursive=True)]
    return hits[0] if hits else "-"
print(find("nccl.h"), find("libnccl.so.2"))
PY
)
    [ "$header" != - ] && [ "$library" != - ] || return 1
    mkdir -p "$2/nccl/lib"
    ln -sfn "$(dirname "$header")" "$2/nccl/include"
    ln -sf "$library" "$2/nccl/lib/libnccl.so"  # the wheel ships only libnccl.so.2; CMake looks for .so
    ln -sf "$library" "$2/nccl/lib/libnccl.so.2"
    echo "$2/nccl"
}

gpu_architectures() {
    # PYTHON: the compute capabilities of the GPUs its torch sees ("90"), empty without one: Horovod's
    # kernels for those only (minutes on 16 cores instead of every architecture).
    "$1" -c 'import torch; print(",".join(sorted({"%d%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))' 2>/dev/null || true
}
