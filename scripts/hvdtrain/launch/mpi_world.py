"""MPI for data preparation: mpi4py under mpirun/srun, a single process otherwise.

Data preparation needs no Horovod (no gradients to reduce), only rank, size,
a barrier and a few small messages; mpi4py gives those under any MPI launcher.
mpi4py is imported only when a launcher started several ranks, so a plain
``python scripts/prepare_...py`` never initialises MPI.
"""
import os

from hvdtrain.errors import Agreement, UsageError

# Set by Open MPI's mpirun, MPICH/Intel MPI (PMI) and srun with PMI/PMIx.
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


def launched_size():
    """How many ranks the launcher says it started (1 without a launcher)."""
    for name in _SIZE_VARS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


class World:
    """rank/size and the few collectives data preparation needs."""

    def __init__(self):
        self.comm = None
        self.rank, self.size = 0, 1
        if launched_size() > 1:
            try:
                from mpi4py import MPI
            except ImportError:
                raise UsageError(f"launched as {launched_size()} ranks but mpi4py is not installed "
                                 "(run `make setup`, or launch a single process)", on_every_rank=True) from None
            self.comm = MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # A check run on every rank: a UsageError on one is the same one line on all (errors.Agreement).
        self.agree_on_errors = Agreement(self.allgather)

    @property
    def is_main(self):
        return self.rank == 0

    def print0(self, *args):
        if self.is_main:
            print(*args, flush=True)

    def local_size(self):
        """Ranks on this node (1 without a launcher)."""
        if self.comm is None:
            return 1
        from mpi4py import MPI
        return self.comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()

    def barrier(self):
        if self.comm is not None:
            self.comm.Barrier()

    def broadcast(self, obj):
        return obj if self.comm is None else self.comm.bcast(obj, root=0)

    def allgather(self, obj):
        return [obj] if self.comm is None else self.comm.allgather(obj)
