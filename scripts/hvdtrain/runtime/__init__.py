"""The run runtime both trainers share: Horovod setup, the run skeleton, checkpoints,
elastic commits, stop signals, settings, rank agreement, the non-finite guard,
stragglers, the output-directory lock, the run log and exact metrics. A job's
liveness (watchdog, heartbeat, failure lines) is below it, in liveness/."""
