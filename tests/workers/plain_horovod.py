"""A plain Horovod script (`import horovod.torch as hvd; hvd.init()`, nothing of this project's),
run under `horovodrun --mpi` or `--gloo`: what the installed build set for it. One JSON line per rank:

- "yields": Open MPI's own flag (libopen-pal's opal_progress_yield_when_idle): a rank waiting
  in a collective yields its core instead of spinning (patch 0024);
- "kept_mb": of 160 MB of 4 MB blocks malloc'ed, written and freed after hvd.init(), how much
  the process still holds (patch 0025: up to 1 GB kept for the next step; glibc's own
  thresholds give most of it back at once);
- "cycle_ms": the HOROVOD_CYCLE_TIME hvd.init() ran with (patch 0026: 10 under Gloo on a node
  without GPUs; None: Horovod's own 1 ms).
"""
import ctypes
import json
import os
import sys

import horovod.torch as hvd

BLOCK, BLOCKS = 4 << 20, 40

hvd.init()
yields = bool(ctypes.c_bool.in_dll(ctypes.CDLL("libopen-pal.so.40"), "opal_progress_yield_when_idle").value)

libc = ctypes.CDLL(None)
libc.malloc.argtypes, libc.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
libc.free.argtypes, libc.free.restype = (ctypes.c_void_p,), None


def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


before = resident_mb()
blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
for block in blocks:
    ctypes.memset(block, 1, BLOCK)  # resident: every page touched
for block in reversed(blocks):
    libc.free(block)
said = json.dumps({"rank": hvd.rank(), "yields": yields, "kept_mb": round(resident_mb() - before, 1),
                   "cycle_ms": os.environ.get("HOROVOD_CYCLE_TIME")})
# One write: unbuffered (PYTHONUNBUFFERED=1), print() writes the line and its newline apart, and
# mpirun's output tags each read, so under load the tag landed between them (the line unparseable)
sys.stdout.write(said + "\n")
sys.stdout.flush()
