"""Run under `horovodrun -np 2 --gloo`: when the Gloo controller negotiates.

`idle SECONDS` (with a timeline that marks cycles, --timeline-mark-cycles): both ranks
sleep with no collective in flight; the test counts rank 0's cycles in the timeline.
Stock Horovod negotiates every cycle time whatever is queued (about 200 rounds a second
at the scripts' 5 ms); the setup's patch skips cycles while a rank has nothing in flight.

`wait N` (with a long --cycle-time-ms): N synchronous allreduces; rank 0 prints
"allreduces=N seconds=S". Stock Horovod starts each at the next cycle, a cycle time
later; with the patch a rank blocked on a handle cycles at once.
"""
import sys
import time

import torch
import horovod.torch as hvd

hvd.init()
torch.set_num_threads(1)
hvd.allreduce(torch.zeros(1), name="warm")  # both ranks are up
if sys.argv[1] == "idle":
    time.sleep(float(sys.argv[2]))
else:
    count = int(sys.argv[2])
    started = time.monotonic()
    for i in range(count):
        hvd.allreduce(torch.ones(4), name=f"x{i}")
    if hvd.rank() == 0:
        print(f"allreduces={count} seconds={time.monotonic() - started:.2f}", flush=True)
hvd.allreduce(torch.zeros(1), name="done")  # neither rank leaves while the other negotiates
