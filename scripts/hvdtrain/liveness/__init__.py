"""Liveness: a job never hangs, and one line names what ended it.

The progress watchdog (watchdog.py) ends a rank that makes no progress; the
heartbeat (peers.py) knows which ranks and nodes are still alive, so that line
names a frozen, dead or cut-off node; teardown.py ends a launcher that cannot
end the job; failures.py turns a rank's failure into that one line. dist.setup
builds them once per process; nothing here imports the run's machinery (runtime/).
"""
