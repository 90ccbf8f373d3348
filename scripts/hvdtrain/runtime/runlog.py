"""Rank-0 output of a run: log lines and progress, metrics.jsonl, TensorBoard, results.json."""
import json
import os
import sys
import time
from pathlib import Path

from hvdtrain.errors import UsageError

try:
    from tqdm import tqdm
except ImportError:  # tqdm is in requirements.txt; plain lines without it
    tqdm = None


class RunLog:
    """Everything a run writes for people. A no-op on ranks other than 0."""

    def __init__(self, ctx, output_dir, total_steps=None, tensorboard=True, resumed_from=None):
        """``total_steps``: the schedule's (None until ``retarget`` says); ``resumed_from``: the restored
        training state (its step and epoch), None for a new run."""
        self.enabled = ctx.is_main
        resumed_step = resumed_from.step if resumed_from is not None else 0
        self.output_dir = Path(output_dir)
        self.bar = None
        self.report = None
        self.writer = None
        # Read on every rank, so a bad value stops every rank alike.
        interval = progress_interval(os.environ)
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.ranks_path = self.output_dir / "stragglers.jsonl"  # timings: they differ from run to run
        if resumed_step:
            self.drop_rows_after(resumed_step, resumed_from.epoch)
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        else:
            # Under a launcher stdout is a pipe: no bar, a line now and then instead.
            self.report = ProgressReport(total_steps, resumed_step, interval)
        if tensorboard:
            self.writer = _tensorboard_writer(self.output_dir / "tensorboard", resumed_step)

    def info(self, message):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def progress(self, step, **values):
        """Advance the progress bar to ``step`` (terminal), or print a periodic progress line."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)
        elif self.report is not None:
            line = self.report.line(step)
            if line:
                self.info(line)

    def retarget(self, total_steps):
        """A new estimate of the total steps (--elastic: a step's size follows the world size)."""
        if self.bar is not None:
            self.bar.total = total_steps
        if self.report is not None:
            self.report.total = total_steps

    def record(self, row, step):
        """Append one JSON object to metrics.jsonl and the scalars to TensorBoard."""
        if not self.enabled:
            return
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def drop_rows_after(self, step, epoch):
        """Rows written after the state at ``step`` in ``epoch`` (a resume, an --elastic reset):
        they are written again."""
        drop_rows_after(self.metrics_path, step, epoch)
        drop_rows_after(self.ranks_path, step, epoch)

    def record_ranks(self, interval):
        """Append an interval's per-rank timing table to stragglers.jsonl, its extremes to TensorBoard."""
        if not self.enabled:
            return
        with open(self.ranks_path, "a") as handle:
            handle.write(json.dumps(interval) + "\n")
        if self.writer is not None:
            ranks, step = interval["ranks"], interval["step"]
            for name in ("busy", "compute", "data"):
                self.writer.add_scalar(f"ranks/min_relative_{name}", min(r["relative"][name] for r in ranks), step)
            self.writer.add_scalar("ranks/min_individual", min(r["individual"] for r in ranks), step)
            self.writer.add_scalar("ranks/max_waiting", max(r["waiting"] for r in ranks), step)
            self.writer.add_scalar("ranks/slowest_rank", min(ranks, key=lambda r: r["relative"]["busy"])["rank"],
                                   step)
            self.writer.flush()

    def results(self, results):
        """Write results.json atomically; returns the path (rank 0)."""
        if not self.enabled:
            return None
        path = self.output_dir / "results.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return path

    def close(self):
        """Once or more: the progress bar and TensorBoard's files."""
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        self.bar = self.writer = None


PROGRESS_SECONDS_VAR = "HVDTRAIN_PROGRESS_SECONDS"
DEFAULT_PROGRESS_SECONDS = 30.0


def progress_interval(env):
    """Seconds between progress lines when there is no terminal (0: none)."""
    text = env.get(PROGRESS_SECONDS_VAR, "")
    if not text:
        return DEFAULT_PROGRESS_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(f"{PROGRESS_SECONDS_VAR}={text!r}: must be a number of seconds, 0 or more",
                         on_every_rank=True)
    return value


class ProgressReport:
    """``progress: step 120/400 (30%), 2.1 steps/s, about 2 min 13 s left``, every ``interval`` s."""

    def __init__(self, total_steps, start_step, interval, clock=time.monotonic):
        self.total, self.start_step, self.interval, self.clock = total_steps, start_step, interval, clock
        self.started = self.last = clock()

    def line(self, step):
        now = self.clock()
        if not self.interval or now - self.last < self.interval or step <= self.start_step:
            return None
        self.last = now
        rate = (step - self.start_step) / max(now - self.started, 1e-9)  # this launch's steps
        return (f"progress: step {step}/{self.total} ({100 * step / self.total:.0f}%), {rate:.3g} steps/s, "
                f"about {duration(max(self.total - step, 0) / rate)} left")


def duration(seconds):
    """42 s, 3 min 05 s, 2 h 07 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def drop_rows_after(path, step, epoch):
    """Keep the rows written before the state a run resumes from: its ``step`` and ``epoch``.

    Rows written after the last checkpoint, before a crash, are computed again
    by the resumed run; keeping them would duplicate those steps. The step alone
    does not tell: an --elastic commit can fall on an epoch's last step, before
    that epoch's end writes its row (same step, one epoch more), and a reset to
    that commit ends the epoch again. Rows before the state have an epoch no
    greater than the state's (the CNN's row counts the epochs done, BERT's the
    epoch in progress); rows without one (the straggler table) go by the step.
    """
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and _before(json.loads(line), step, epoch)]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


def _before(row, step, epoch):
    return row["step"] <= step and row.get("epoch", epoch) <= epoch


def _tensorboard_writer(directory, resumed_step=0):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    # purge_step: TensorBoard hides events after the resumed step (a crash's leftovers).
    return SummaryWriter(log_dir=str(directory), purge_step=resumed_step + 1 if resumed_step else None)
