"""A training run's life around the trainer's own loop: its start, each step's bookkeeping, its end.

    run = Run(ctx, settings, state, checkpointer, commits, timer)

    def train(commits, run, task):       # hvd.elastic.run calls it again after every reset (--elastic)
        if run.begin() == "fresh":       # this world; once per job, the newest checkpoint restored
            broadcast rank 0's initial weights         # (nothing was restored)
        if run.nothing_to_train(finished): return
        run.retarget(total_steps)        # the schedule's steps at this world size
        while ...:
            train one step
            reason = run.step_done()                      # counters, watchdog, stragglers, stop vote
            run.save(..., stopping=reason is not None)    # checkpoints and commits at their cadence
            if reason: return run.stop(reason, results)
        run.finish(results)

What it owns, once for both trainers: the train state's counters, the restore
with the resume contract, the checkpoint cadence (cadence.py: checkpoints and
--elastic commits), stop requests (which signal reached which rank), the
straggler watch (and --balance's new shares) and the run log. The trainer owns
its model, step, data, position and throughput.
"""
import atexit
import os
import resource
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from hvdtrain import cli, durations
from hvdtrain.errors import UsageError
from hvdtrain.liveness import recorder as flight
from hvdtrain.runtime import checkpoint_files, collectives, settings as settings_module, signals, stragglers
from hvdtrain.runtime.cadence import CheckpointManager
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
    """Restore, each step's bookkeeping, checkpoints, stop requests and the log around a trainer's loop."""

    def __init__(self, ctx, settings, state, checkpointer, commits, timer, shares=None):
        """``ctx``: this rank's dist.Context (its stop request: dist.after_init); ``state``: the TrainState
        among ``checkpointer``'s shared components; ``commits``: the run's elastic.Commits
        (hvd.elastic.run's state under --elastic); ``timer``: the durations.SectionTimer the trainer
        times its steps with; ``shares``: --balance's balance.Shares. The schedule's steps come with
        ``retarget``, in every world."""
        self.ctx = ctx
        self.settings = settings
        self.state = state
        self.checkpointer = checkpointer  # restored from by begin()
        self.commits = commits
        self.total_steps = self.last_step = None  # the schedule's, and this launch's (retarget)
        self.stop_request = ctx.stop_request or signals.StopRequest()  # SIGTERM/SIGUSR1: a checkpoint, exit 0
        self.timer = timer
        self.checkpoints = CheckpointManager(checkpointer, settings, state, commits if commits.enabled else None)
        self.log = None
        stragglers.check_settings(settings, os.environ)
        self.stragglers = stragglers.StragglerWatch(settings, ctx.rank, ctx.size, timer, gather_placement=ctx.placement)
        self.shares = shares
        self.straggler_exit = None  # --straggler-action checkpoint-exit: raised after the checkpoint

    def begin(self):
        """Enter this world, at the top of every ``train()`` (called again after every --elastic reset).

        This worker's rank and size; the first time in the job, --output-dir locked and its
        newest checkpoint restored (or cleared: --no-resume), the log opened; after a reset the
        log follows rank 0. Returns "fresh" (nothing restored: the trainer then broadcasts rank
        0's initial weights), "resumed" (every rank loaded the checkpoint's) or "reset" (a new
        --elastic world: the sync gave every rank rank 0's state). Collective.
        """
        self.ctx.follow_world()
        self.stragglers.new_world(self.ctx.rank, self.ctx.size)
        flight.dump_into(Path(self.settings.output_dir) / flight.DUMP_DIR)  # a hang's record lands beside the run's
        if self.commits.started:
            self._log_follows_rank_0()
            begun = "reset"
        else:
            begun = "resumed" if self._start() else "fresh"
            self.commits.started = True
            self.commits.commit_step(self.state.step)  # --elastic: a reset before the first commit goes back here
        return begun

    def _start(self):
        """Lock --output-dir, restore from it (or clear it), then open the log; collective. True: restored."""
        collectives.agree_on_errors(self._lock_output_dir)
        if not self.settings.resume and self.ctx.is_main:
            checkpoint_files.clear_run_outputs(self.settings.output_dir)
        adjusted, resized_from = [], []

        def check(saved):
            adjusted.extend(settings_module.check_resume(saved["settings"], self.settings,
                                                         self.settings.output_dir))
            old_size = settings_module.resized_from(saved["settings"], self.settings)
            refusal = old_size and self.settings.resize_refusal(saved["train_state"])
            if refusal:
                raise UsageError(settings_module.resize_refusal_line(
                    old_size, self.ctx.size, self.settings.output_dir, refusal))
            resized_from.append(old_size)

        started = time.perf_counter()
        restored = self.checkpointer.restore(check=check) is not None
        if restored:
            settings_module.announce(adjusted, self.ctx.print0)
            if resized_from[0]:
                self.ctx.print0(settings_module.resize_line(resized_from[0], self.settings,
                                                            self.settings.output_dir))
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
            self.ctx.print0(f"restored step {self.state.step} from {self.settings.output_dir} in "
                            f"{time.perf_counter() - started:.1f} s (rank 0 peak RSS so far {peak:.2f} GiB)")
        self.log = self._open_log()
        return restored

    def _log_follows_rank_0(self):
        """After an --elastic reset: a new rank 0 (or a worker that joined) writes the log from the
        committed step on; rows of steps after the commit are written again when they are redone."""
        if self.log is None or self.log.enabled != self.ctx.is_main:
            if self.log is not None:
                self.log.close()
            self.log = self._open_log()
        elif self.ctx.is_main:
            self.log.drop_rows_after(self.state.step, self.state.epoch)

    def _open_log(self):
        """The log, written on from the restored state: its rows of later steps are dropped. Closed
        as the process exits, however the launch ends (its TensorBoard files, its progress bar)."""
        log = RunLog(self.ctx, self.settings.output_dir, self.total_steps, resumed_from=self.state)
        atexit.register(log.close)
        return log

    def _lock_output_dir(self):
        """Rank 0 holds --output-dir's lock until it exits (see outdir_lock)."""
        if self.ctx.is_main:
            lock = OutputDirLock(self.settings.output_dir).acquire(self.settings.take_over_lock)
            atexit.register(lock.release)

    def nothing_to_train(self, finished):
        """True, and said in the log, when this launch must not train: the run is ``finished`` (a
        relaunch of a finished run changes nothing), or an earlier launch reached --stop-after
        (e.g. a requeue of a Slurm job that had already stopped there)."""
        if finished:
            self.log.info(finished_line(self.settings.output_dir, self.state.step))
            return True
        stop_after = self.settings.stop_after
        if not stop_after or self.state.step < stop_after:
            return False
        self.log.info(f"{self.settings.output_dir} is at step {self.state.step}, already past --stop-after "
                      f"{stop_after}: nothing to do (drop --stop-after or raise it to train on)")
        return True

    def retarget(self, total_steps):
        """The schedule's steps at this world size (a step's samples may differ from the last world's):
        the stop and the log's progress follow."""
        self.total_steps = total_steps
        self.last_step = min(self.settings.stop_after or total_steps, total_steps)
        self.log.retarget(total_steps)

    def step_done(self):
        """Count a finished step; returns why this launch must stop now, or None.

        Collective on some steps, the same on every rank: every --straggler-interval steps
        the timings' allgather (stragglers.StragglerWatch; the placement allgather once per
        world), every --stop-check-every steps the stop vote, an allreduce
        (signals.StopRequest.poll).
        """
        state = self.state
        state.step, state.step_in_epoch = state.step + 1, state.step_in_epoch + 1
        self.log.progress(state.step)
        self.ctx.watchdog.step(state.step)  # progress, how long steps take (the stall limit), "after step N"
        straggler = self._watch_stragglers()
        if straggler is not None:
            return f"--straggler-action checkpoint-exit (rank {straggler.rank} on {straggler.host})"
        if self.last_step <= state.step < self.total_steps:
            return f"--stop-after {self.last_step}"
        if state.step % self.settings.stop_check_every == 0:
            return self.stop_request.poll()  # Horovod: the stop vote, an allreduce (an allgather if one was signalled)
        return None

    def _watch_stragglers(self):
        """Every --straggler-interval steps: the per-rank table, the straggler line, --balance's new
        shares; a Straggler to stop for (--straggler-action checkpoint-exit), else None. Collective
        at those steps."""
        step = self.state.step
        straggler = self.stragglers.check(step)
        if not self.stragglers.latest_at(step):
            return None
        self.log.record_ranks(self.stragglers.latest)
        if self.shares is not None and self.shares.rebalance(self.stragglers.latest):
            self.log.info(self.shares.change_line(step))
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

    def save(self, epoch_end=False, is_best=False, last=False, stopping=False):
        """What the cadence asks for after the step just trained: checkpoints and --elastic commits
        (cadence.CheckpointManager.after_step lists their collectives)."""
        self.checkpoints.after_step(epoch_end=epoch_end, is_best=is_best, last=last, stopping=stopping)

    def stop(self, reason, results):
        """A stop before the end, after its checkpoint (``save(stopping=True)``): the results so far,
        and how to go on."""
        self._write_results({**results, "completed": False})
        flight.dump(f"stopped by {reason} at step {self.state.step}")
        # The command to print resumes: no --no-resume (it deletes the checkpoint), no --stop-after.
        self.log.info(f"stopped by {reason} at step {self.state.step}: checkpoint written to "
                      f"{self.settings.output_dir}; to continue, relaunch with the same launcher: "
                      f"python {cli.resume_command()}")
        if self.straggler_exit is not None:
            self._exit_for_straggler(self.straggler_exit)

    def finish(self, results):
        """The schedule's end: results.json (completed); returns its path (rank 0; None elsewhere)."""
        return self._write_results({**results, "completed": True})

    def _exit_for_straggler(self, straggler):
        """After the checkpoint: name the host to leave out (HVDTRAIN_STRAGGLER_FILE too), exit 5 everywhere."""
        path = os.environ.get(stragglers.STRAGGLER_FILE_VAR)
        if path and self.ctx.is_main:
            stragglers.write_host(path, straggler.host)
        raise stragglers.StragglerExit(
            f"{straggler.line()}; checkpoint written to {self.settings.output_dir} at step {self.state.step}: "
            f"relaunch without {straggler.host} to continue")

    def _write_results(self, results):
        ranks = self.stragglers.summary()  # the latest interval's per-rank timings
        placement = self.ctx.gathered_placement  # every rank's host, local rank and size, threads
        return self.log.results({**results, "skipped_steps": self.state.skipped_steps,
                                 "durations": durations.summary(),  # rank 0's collective moments
                                 **({"ranks": ranks} if ranks else {}),
                                 **({"placement": placement} if placement else {})})


def finished_line(output_dir, step, results_name="results.json"):
    return (f"{output_dir} holds a finished run (step {step}); its results are in "
            f"{Path(output_dir) / results_name}. Nothing to do: extend the schedule to train on, "
            "or use --no-resume to start over")


def finished_before_start(ctx, settings, results_name="results.json"):
    """True (and said on rank 0) when --output-dir holds this very run, finished: its newest
    checkpoint has every step and the same settings. Asked before a model is built, so that
    relaunching a finished run (a requeue, a rerun script) builds none: for BERT, no
    transformers import (seconds on every rank). Anything else (no checkpoint, a damaged
    one, changed settings) is False: Run.begin then restores, or says what is wrong. Collective.
    """
    if settings.elastic or not settings.resume:
        return False  # an elastic worker makes no collective before its sync
    step = None
    if ctx.is_main:
        try:
            newest = checkpoint_files.checkpoint_paths(settings.output_dir)[:1]
            saved, problem = checkpoint_files.read(newest[0]) if newest else (None, "none")
            if (not problem and checkpoint_files.is_current_format(saved) and saved["train_state"]["step"] >= settings.steps
                    and not settings_module.check_resume(saved["settings"], settings, settings.output_dir)):
                step = saved["train_state"]["step"]
        except Exception:  # noqa: BLE001 - the restore in Run.begin says what it is
            step = None
    # Horovod: rank 0's answer, the finished step or None, to every rank
    step = collectives.broadcast_object(step, root_rank=0, name="run.finished_before_start")
    if step is not None:
        ctx.print0(finished_line(settings.output_dir, step, results_name))
    return step is not None
