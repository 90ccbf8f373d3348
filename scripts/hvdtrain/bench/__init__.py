"""scripts/benchmark.py's parts: the backends (Horovod, DDP, one process), the
workloads (the trainers' own steps on synthetic data), allreduce timing and records."""
