"""scripts/benchmark.py's modes, one module each (train, allreduce, scaling with
compare, timeline), and what they share: the backends (Horovod, DDP, one process),
the workloads (the trainers' own steps on synthetic data) and the record
(statistics, environment, the JSON result file)."""
