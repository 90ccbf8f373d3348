"""The run runtime both trainers share: Horovod setup, the run skeleton, checkpoints,
elastic commits, stop signals, the progress watchdog, settings, rank agreement,
the non-finite guard, the output-directory lock, the run log and exact metrics."""
