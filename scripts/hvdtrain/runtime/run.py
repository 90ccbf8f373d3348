"""The run skeleton both trainers share.

    checkpointer = Checkpointer(ctx, settings.output_dir, shared={..., "train_state": state}, per_rank=...)
    run = Run(ctx, settings, state, checkpointer, total_steps, stop_request)
    run.launch(train)                 # restore (or start over), open the log, train(), close the log

    def train():                      # called again after every --elastic reset
        while ...:
            train one step
            reason = run.step_done(samples)   # counters, watchdog, stop checks
            run.checkpoints.after_step(..., stopping=bool(reason))  # checkpoint, commit when due
            if reason: return run.stop(reason, results)

What it owns, once for both: the train state (position and counters), the
restore with the resume contract, the checkpoint manager (cadence.py: the
cadence of checkpoints and --elastic commits), the world after an elastic
reset, stop requests (which signal reached which rank), the run log and
throughput.
"""
import atexit
import os
import resource
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import horovod.torch as hvd

from hvdtrain import cli, durations, testhooks
from hvdtrain.liveness import failures
from hvdtrain.runtime import collectives, elastic, nonfinite, settings as settings_module, stragglers
from hvdtrain.runtime import checkpoint
from hvdtrain.runtime.cadence import CheckpointManager
from hvdtrain.errors import UsageError
from hvdtrain.runtime.checkpoint import clear_run_outputs
from hvdtrain.runtime.metrics import Throughput, total_throughput
from hvdtrain.runtime.outdir_lock import OutputDirLock
from hvdtrain.runtime.runlog import RunLog


@dataclass
class TrainState:
    """Where training stands; a checkpoint component. Trainers add their counters."""
    step: int = 0  # optimizer steps in all
    epoch: int = 0  # the epoch in progress
    step_in_epoch: int = 0  # its steps already trained
    last_row: dict = field(default_factory=dict)  # the latest metrics.jsonl row
    skipped_steps: int = 0  # steps skipped on every rank for a non-finite loss (see nonfinite)

    def state_dict(self):
        return asdict(self)

    def load_state_dict(self, state):
        state = {"skipped_steps": 0, **state}  # checkpoints from before skipped steps were counted
        for item in fields(self):
            setattr(self, item.name, state[item.name])

    def next_epoch(self):
        self.epoch, self.step_in_epoch = self.epoch + 1, 0


class Run:
    """Restore, stop requests, log and throughput around a trainer's own loop; ``checkpoints`` saves."""

    def __init__(self, ctx, settings, state, checkpointer, total_steps, stop_request):
        """``state``: the TrainState among ``checkpointer``'s shared components."""
        self.ctx = ctx
        self.settings = settings
        self.state = state
        self.checkpointer = checkpointer  # restored from by start()
        self.total_steps = total_steps  # the whole schedule
        self.last_step = min(settings.stop_after or total_steps, total_steps)  # this launch's
        self.stop_request = stop_request
        # --elastic: the in-memory commits, whose resets this run follows (adopt_new_world).
        commits = elastic.Commits(checkpointer, ctx, settings.elastic_commit_every, start=self.start,
                                  adopt_new_world=self.adopt_new_world) if settings.elastic else None
        self.checkpoints = CheckpointManager(checkpointer, settings, state, commits)
        self.throughput = Throughput()
        self.log = None
        self.resumed = False
        self.resized_from = None  # the restored checkpoint's world size where it differs from this launch's
        self._fresh_start = False  # start() restored nothing: see take_fresh_start
        # The trainers pass it to optim.finish_step; it reports through the log, open after start().
        self.nonfinite = nonfinite.NonFiniteGuard.from_settings(settings, ctx.rank, state,
                                                               say=lambda line: self.log.info(line))
        # Per-rank step timings; the trainers time their sections with self.stragglers.timer.
        stragglers.check_settings(settings, os.environ)
        self.stragglers = stragglers.StragglerWatch(settings, ctx.rank, ctx.size)
        self.straggler_exit = None  # --straggler-action checkpoint-exit: raised after the checkpoint

    def launch(self, train):
        """``start()``, then ``train()``; under --elastic inside ``hvd.elastic.run``, which calls
        ``train()`` again after every reset. The log is closed here, and only here."""
        try:
            commits = self.checkpoints.commits
            if commits is None:
                self.start()
                return train()
            # Horovod: hvd.elastic.run restores the last commit, re-forms the world and calls train() again.
            return commits.elastic_run(train)
        finally:
            if self.log is not None:
                self.log.close()

    def adopt_new_world(self, started):
        """--elastic, after a reset: this worker's rank and size in the new world; the log follows rank 0.

        ``started``: the run has restored its checkpoint (a log is open somewhere).
        """
        ctx = self.ctx
        ctx.rank, ctx.size, ctx.local_rank, ctx.local_size = hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()
        ctx.watchdog.rank = ctx.rank
        self.stragglers.new_world(ctx.rank, ctx.size)
        if not started:
            return
        if self.log is None or self.log.enabled != ctx.is_main:
            if self.log is not None:
                self.log.close()
            # A new rank 0 (or a worker that joined) writes the log from the committed step on.
            self.log = self._open_log()
        elif ctx.is_main:
            # Rows of steps after the commit are written again when those steps are redone.
            self.log.drop_rows_after(self.state.step, self.state.epoch)

    def start(self):
        """Lock --output-dir, restore from it (or clear it), then open the log; collective."""
        collectives.agree_on_errors(self._lock_output_dir)
        if not self.settings.resume and self.ctx.is_main:
            clear_run_outputs(self.settings.output_dir)
        adjusted = []

        def check(saved):
            adjusted.extend(settings_module.check_resume(saved["settings"], self.settings,
                                                         self.settings.output_dir))
            self.resized_from = settings_module.resized_from(saved["settings"], self.settings)
            refusal = self.resized_from and self.settings.resize_refusal(saved["train_state"])
            if refusal:
                raise UsageError(settings_module.resize_refusal_line(
                    self.resized_from, self.ctx.size, self.settings.output_dir, refusal))

        started = time.perf_counter()
        restored = self.checkpointer.restore(check=check)
        self.resumed = restored is not None
        if self.resumed:
            settings_module.announce(adjusted, self.ctx.print0)
            if self.resized_from:
                self.ctx.print0(settings_module.resize_line(self.resized_from, self.settings,
                                                            self.settings.output_dir))
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
            self.ctx.print0(f"restored step {self.state.step} from {self.settings.output_dir} in "
                            f"{time.perf_counter() - started:.1f} s (rank 0 peak RSS so far {peak:.2f} GiB)")
        self._fresh_start = not self.resumed
        self.log = self._open_log()
        return restored

    def retarget(self, total_steps):
        """The schedule's steps after a resize (a step's samples changed): the stop and the log follow."""
        self.total_steps = total_steps
        self.last_step = min(self.settings.stop_after or total_steps, total_steps)
        self.log.retarget(total_steps)

    def take_fresh_start(self):
        """True once, in the first ``train()`` of a run that restored no checkpoint: the trainer then
        broadcasts rank 0's initial weights. A restore gave every rank the checkpoint's, and after an
        --elastic reset the sync gives every rank rank 0's state."""
        fresh, self._fresh_start = self._fresh_start, False
        return fresh

    def _open_log(self):
        """The log, written on from the restored state: its rows of later steps are dropped."""
        return RunLog(self.ctx, self.settings.output_dir, self.total_steps, resumed_from=self.state)

    def _lock_output_dir(self):
        """Rank 0 holds --output-dir's lock until it exits (see outdir_lock)."""
        if self.ctx.is_main:
            lock = OutputDirLock(self.settings.output_dir).acquire(self.settings.take_over_lock)
            atexit.register(lock.release)

    def step_done(self, samples):
        """Count a finished step; returns why this launch must stop now, or None.

        Collective on some steps, the same on every rank: every --stop-check-every steps
        the stop-signal allgather (signals.StopRequest), every --straggler-interval steps
        the timings' allgather (stragglers.StragglerWatch; the placement allgather once).
        """
        state = self.state
        state.step, state.step_in_epoch = state.step + 1, state.step_in_epoch + 1
        self.ctx.watchdog.step(state.step)  # progress, and how long steps take (the stall limit)
        failures.note_step(state.step)  # a one-line failure report says "after step N"
        testhooks.step_done(self.ctx.rank, state.step)  # test-only fault injection (HVDTRAIN_FAULT)
        self.throughput.step(samples)
        self.log.progress(state.step)
        straggler = self.watch_stragglers()
        if straggler is not None:
            return f"--straggler-action checkpoint-exit (rank {straggler.rank} on {straggler.host})"
        if self.last_step <= state.step < self.total_steps:
            return f"--stop-after {self.last_step}"
        if state.step % self.settings.stop_check_every == 0:
            return self.poll_stop_request()
        return None

    def watch_stragglers(self):
        """Every --straggler-interval steps: the per-rank table, the straggler line; a Straggler to
        stop for (--straggler-action checkpoint-exit), else None. Collective at those steps."""
        straggler = self.stragglers.step_done(self.state.step)
        if self.stragglers.latest_at(self.state.step):
            self.log.record_ranks(self.stragglers.latest)
        if straggler is None:
            return None
        self.log.info(straggler.line())
        if self.settings.straggler_action == "exclude" and self.ctx.is_main:
            refused = straggler.exclusion_refused()
            if refused:
                self.log.info(f"--straggler-action exclude: {straggler.host} stays: {refused}")
            else:
                # Discovery stops listing the host; Horovod re-forms the world without it at the next commit.
                stragglers.exclude_host(os.environ[stragglers.EXCLUDED_HOSTS_VAR], straggler.host)
                self.log.info(f"--straggler-action exclude: {straggler.host} leaves the job")
        if self.settings.straggler_action != "checkpoint-exit":
            return None
        self.straggler_exit = straggler
        return straggler

    def rebalance(self, shares, unit):
        """--balance, after a straggler interval: new shares from its timings (``shares``, or None
        without --balance); True, and said in the log, when they changed."""
        if shares is None or not self.stragglers.latest_at(self.state.step):
            return False
        if not shares.rebalance(self.stragglers.latest):
            return False
        self.log.info(f"--balance: {unit} per rank now {shares.shares} (step {self.state.step})")
        return True

    def poll_stop_request(self):
        """Collective: None, or which signal reached which rank, e.g. "SIGUSR1 (rank 1)"."""
        return self.stop_request.describe() if self.stop_request.should_stop() else None

    def stop(self, reason, results):
        """A stop before the end, after its checkpoint (``checkpoints.after_step(stopping=True)``):
        the results so far, and how to go on."""
        self.write_results({**results, "completed": False})
        # The command to print resumes: no --no-resume (it deletes the checkpoint), no --stop-after.
        self.log.info(f"stopped by {reason} at step {self.state.step}: checkpoint written to "
                      f"{self.settings.output_dir}; to continue, relaunch with the same launcher: "
                      f"python {cli.resume_command()}")
        if self.straggler_exit is not None:
            self.exit_for_straggler(self.straggler_exit)

    def exit_for_straggler(self, straggler):
        """After the checkpoint: name the host to leave out (HVDTRAIN_STRAGGLER_FILE too), exit 5 everywhere."""
        path = os.environ.get(stragglers.STRAGGLER_FILE_VAR)
        if path and self.ctx.is_main:
            stragglers.write_host(path, straggler.host)
        raise stragglers.StragglerExit(
            f"{straggler.line()}; checkpoint written to {self.settings.output_dir} at step {self.state.step}: "
            f"relaunch without {straggler.host} to continue")

    def rates(self):
        """(total, per worker) samples/s of this launch; 0 where nothing was timed. Collective."""
        return total_throughput(self.throughput.launch_rate() or self.throughput.window_rate())

    def write_results(self, results):
        ranks = self.stragglers.summary()  # the latest interval's per-rank timings
        placement = self.stragglers.placement  # every rank's host, local rank and size, threads
        return self.log.results({**results, "skipped_steps": self.state.skipped_steps,
                                 "durations": durations.summary(),  # rank 0's collective moments
                                 **({"ranks": ranks} if ranks else {}),
                                 **({"placement": placement} if placement else {})})

    def stop_after_already_reached(self):
        """True when this launch must not train: --stop-after STEP was reached by an earlier
        launch (e.g. a requeue of a Slurm job that had already stopped there). Says so."""
        stop_after = self.settings.stop_after
        if not stop_after or self.state.step < stop_after:
            return False
        self.log.info(f"{self.settings.output_dir} is at step {self.state.step}, already past --stop-after "
                      f"{stop_after}: nothing to do (drop --stop-after or raise it to train on)")
        return True

    def already_finished(self, results_name="results.json"):
        """Relaunching a finished run changes nothing; says where its results are."""
        self.log.info(finished_line(self.settings.output_dir, self.state.step, results_name))


def finished_line(output_dir, step, results_name="results.json"):
    return (f"{output_dir} holds a finished run (step {step}); its results are in "
            f"{Path(output_dir) / results_name}. Nothing to do: extend the schedule to train on, "
            "or use --no-resume to start over")


def finished_before_start(ctx, settings, results_name="results.json"):
    """True (and said on rank 0) when --output-dir holds this very run, finished: its newest
    checkpoint has every step and the same settings. Asked before a model is built, so that
    relaunching a finished run (a requeue, a rerun script) builds none: for BERT, no
    transformers import (seconds on every rank). Anything else (no checkpoint, a damaged
    one, changed settings) is False: Run.start then restores, or says what is wrong. Collective.
    """
    if settings.elastic or not settings.resume:
        return False  # an elastic worker makes no collective before its sync
    step = None
    if ctx.is_main:
        try:
            newest = checkpoint.checkpoint_paths(settings.output_dir)[:1]
            saved, problem = checkpoint.read(newest[0]) if newest else (None, "none")
            if (not problem and checkpoint.is_current_format(saved) and saved["train_state"]["step"] >= settings.steps
                    and not settings_module.check_resume(saved["settings"], settings, settings.output_dir)):
                step = saved["train_state"]["step"]
        except Exception:  # noqa: BLE001 - the restore in Run.start says what it is
            step = None
    # Horovod: rank 0's answer, the finished step or None, to every rank
    step = collectives.broadcast_object(step, root_rank=0, name="run.finished_before_start")
    if step is not None:
        ctx.print0(finished_line(settings.output_dir, step, results_name))
    return step is not None
