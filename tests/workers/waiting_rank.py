"""Run under `horovodrun -np 2`: how much CPU a rank uses while it waits for a late peer.

Rank 1 sleeps before an allreduce that rank 0 has already entered; rank 0
prints "waiting main=F process=G": the CPU seconds per second of that wait
used by its main thread (the one in hvd.synchronize) and by the whole process
(Horovod's background thread and MPI progress too). Horovod 0.28.1's
hvd.synchronize spins on std::this_thread::yield() (main about 1.0: a whole
core taken from the ranks being waited for); the project's patch blocks on a
condition variable (main close to 0).
"""
import resource
import sys
import time

import torch
import horovod.torch as hvd

SLEEP_SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


hvd.init()
torch.set_num_threads(1)
hvd.allreduce(torch.zeros(1), name="warm")  # both ranks are up
started_cpu, started_main, started = cpu_seconds(), time.thread_time(), time.monotonic()
if hvd.rank() == 1:
    time.sleep(SLEEP_SECONDS)
hvd.allreduce(torch.zeros(1000), name="late")  # rank 0 waits here for rank 1
if hvd.rank() == 0:
    seconds = time.monotonic() - started
    print(f"waiting main={(time.thread_time() - started_main) / seconds:.3f} "
          f"process={(cpu_seconds() - started_cpu) / seconds:.3f}", flush=True)
