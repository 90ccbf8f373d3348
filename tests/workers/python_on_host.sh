#!/bin/sh
# PYTHON for the two-node Slurm tests (slurm/common.sh runs "$PYTHON" SCRIPT ...):
# a process that a launcher started as a rank says which host it runs on, then
# becomes the interpreter. (The batch shell's own python commands say nothing.)
rank=${OMPI_COMM_WORLD_RANK:-${HOROVOD_RANK:-${PMIX_RANK:-}}}
[ -n "$rank" ] && echo "rank $rank starts on host $(hostname)" >&2
exec python "$@"
