"""--balance: a fixed global batch split among the ranks by their measured speed.

Heterogeneous workers (mixed node generations, a partly shared node) make the
fast ranks wait for the slow one at every allreduce. With --balance each
rank's share of the global batch follows its speed: every --straggler-interval
steps the per-rank timings (runtime/stragglers.py, the same numbers on every
rank) give each rank's seconds per sample, and the shares become inversely
proportional to them. The gradient stays exactly the mean over the global
batch: each rank's loss is its sum over its samples divided by the global
batch, and Horovod sums (not averages) the ranks' gradients. The data sampler
cuts each step's samples at the new shares (data/sampling.BalancedSampler), so
every sample of an epoch is still trained once; the shares are saved in the
checkpoint, so a resume goes on with the same split.
"""
MIN_GAIN = 0.02  # a new split must shorten the predicted step by 2 %: timing noise moves nothing


class Shares:
    """Samples per rank and step (a checkpoint component); equal to start with."""

    def __init__(self, size, step_batch, minimum, unit="samples"):
        self.shares = [step_batch] * size
        self.minimum = minimum  # one sample per backward pass
        self.unit = unit  # what a share counts, for the log: samples, instances
        self.changes = 0

    def state_dict(self):
        return {"shares": list(self.shares), "changes": self.changes}

    def load_state_dict(self, state):
        if len(state["shares"]) == len(self.shares) and sum(state["shares"]) == sum(self.shares):
            self.shares[:] = state["shares"]  # in place: the sampler holds this list
            self.changes = state["changes"]

    def rebalance(self, interval):
        """New shares from an interval's per-rank table (stragglers.scores); True when they changed."""
        seconds = [row["compute_s"] + row["data_s"] for row in interval["ranks"]]
        per_sample = [max(s, 1e-9) / share for s, share in zip(seconds, self.shares)]
        proposed = split(sum(self.shares), [1 / t for t in per_sample], self.minimum)
        now = max(t * share for t, share in zip(per_sample, self.shares))
        then = max(t * share for t, share in zip(per_sample, proposed))
        if proposed == self.shares or then > (1 - MIN_GAIN) * now:
            return False
        self.shares[:] = proposed
        self.changes += 1
        return True


    def change_line(self, step):
        """The log's line for new shares."""
        return f"--balance: {self.unit} per rank now {self.shares} (step {step})"


def split(total, weights, minimum):
    """``total`` in integer parts proportional to ``weights``, each at least ``minimum``
    (largest remainders get the samples left over)."""
    spare = total - minimum * len(weights)
    exact = [spare * w / sum(weights) for w in weights]
    parts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in by_remainder[:spare - sum(parts)]:
        parts[i] += 1
    return [minimum + part for part in parts]
