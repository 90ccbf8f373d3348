"""One process (hvd.init alone, size 1): hvdtrain's elastic Commits and the host updates
Horovod's driver sends to rank 0, around a reset.

    host_update_in_reset.py

A worker is lost (``restore``), the world re-forms (Horovod's ``reset``), then
``on_reset``. An update that arrives before the loss is part of that reset; one
that arrives while the world re-forms (a host's blacklist cooldown ending) must
reach the next commit's check. Prints one line per case: what the check did. And the
line a loss is said in, where the driver said beforehand which worker it is ending (one
that answered nothing): the driver's words, through Horovod's notification manager.
"""
from types import SimpleNamespace

import horovod.torch as hvd
from horovod.common.elastic import notification_manager
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult

from hvdtrain.runtime.checkpoint_writer import BackgroundWriter
from hvdtrain.runtime.elastic import Commits
from hvdtrain.runtime.run import TrainState
from hvdtrain.liveness.watchdog import Watchdog


def commits():
    """Commits of one component, built from its parts: a checkpointer and a context."""
    ctx = SimpleNamespace(print0=print, is_main=True, watchdog=Watchdog(0, watch=False))  # one process: rank 0
    checkpointer = SimpleNamespace(shared={"train_state": TrainState()}, per_rank={}, writer=BackgroundWriter())
    return Commits(checkpointer, ctx, 1)


def next_commit_check(commits):
    try:
        commits.check_host_updates()
    except HostsUpdatedInterrupt:
        return f"hosts updated (timestamp {commits._last_updated_timestamp})"
    return "no update"


def lost_worker_then(commits, before, during):
    for timestamp in before:
        commits.on_hosts_updated(timestamp, HostUpdateResult.added)
    commits.restore()  # a worker was lost
    for timestamp in during:  # the world re-forms
        commits.on_hosts_updated(timestamp, HostUpdateResult.added)
    commits.on_reset()
    return next_commit_check(commits)


def lost_after_the_drivers_word(commits, text):
    notification_manager.register_listener(commits)
    said = notification_manager.handle_worker_ended(text)  # what the driver's request does
    commits.restore()
    return f"{commits.lost_line} (said by rank 0: {said})"


hvd.init()
print("update during the reset:", lost_worker_then(commits(), before=[100], during=[200]))
print("update before the loss only:", lost_worker_then(commits(), before=[100], during=[]))
print("the driver ended a worker:", lost_after_the_drivers_word(commits(), "the worker of node2[1] answered nothing"))
