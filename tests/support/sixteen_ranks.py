"""Sixteen ranks, four per host on support/hosts.py's node1-node4 (and the smallest form of a
node-level test, two of those hosts with two ranks each): the runs and checks that
tests/test_four_nodes.py (mpirun, horovodrun) and tests/test_slurm_four_nodes.py
(sbatch --nodes=4 with each LAUNCHER) share.

One thread per rank, small workloads: what is proven is the mechanism at N ranks
on N/4 nodes (the same one thousands of ranks use), not speed.
"""
import json
import sys
from typing import NamedTuple

from .bert_data import make_small_static_data
from .checks import ok
from .commands import CNN, PRETRAIN
from .launch import launch
from .weights import EXACT, assert_same_weights, checkpoint_at

RANKS, SLOTS = 16, 4
HOSTS = [f"node{i}" for i in range(1, 5)]


class Shape(NamedTuple):
    """Which of the four hosts a job uses and its ranks per host."""
    hosts: list
    slots: int

    @property
    def ranks(self):
        return len(self.hosts) * self.slots

    @property
    def last(self):
        """The host whose loss the fault tests stage (ranks ``self.ranks - slots`` on)."""
        return self.hosts[-1]

    def last_ranks(self):
        """How the job's one line names the last host's ranks: "ranks 12-15 (all 4 on node4)"."""
        return f"ranks {self.ranks - self.slots}-{self.ranks - 1} (all {self.slots} on {self.last})"

    def __str__(self):
        return f"{len(self.hosts)}x{self.slots}"


# A node-level mechanism at its smallest real scale (make test): two hosts of two ranks,
# so that a node's ranks are several and named as one; and at 16 ranks (make test-scale).
TWO_BY_2 = Shape(HOSTS[:2], 2)
FOUR_BY_4 = Shape(HOSTS, SLOTS)
SMALL = ["--model", "convnet", "--image-size", "8", "--threads", "1"]

# BERT: --balance, whose epoch is one global order of the instances that does not depend on
# the world size, each step's instances split among the ranks (without it, rank r trains the
# r-th slice of the epoch: every instance once, in another order; docs/bert.md), here with
# equal shares throughout (no rebalancing within --straggler-interval); static masking and no
# dropout (whose masks are drawn per rank), so that 16 ranks x 1 sequence compute what 1 rank
# x 16 does. Each loss is its share of the step's global mean (one allreduce of the counts).
BERT_CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
               "max_position_embeddings": 512, "type_vocab_size": 2,
               "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
# 81 instances: steps of 16; the epoch's 5th takes the 17th instance too at 2 ranks or more
# (a last step smaller than one sequence per rank joins the one before: sampling.global_steps),
# where one worker trains it alone as a 6th step. So the weights are compared at steps 2 and 4.
BERT_STEPS = 4
BERT_COMPARED_STEPS = (2, BERT_STEPS)


def sixteen_by_4(checkpoint_every, ranks=RANKS):
    """16 ranks x batch 4 (``ranks`` x 64 / ``ranks``). --lr is per --batch-size samples and
    scaled to the global batch: 0.1 for 64 samples, as in one_by_64."""
    return [*SMALL, *EXACT, "--batch-size", str(64 // ranks), "--lr", str(0.1 / ranks), "--checkpoint-every",
            checkpoint_every, "--straggler-interval", "5"]


def one_by_64(checkpoint_every):
    return [*SMALL, *EXACT, "--batch-size", "64", "--lr", "0.1", "--checkpoint-every", checkpoint_every]


def trained(run, out):
    """``out`` of a launch that finished cleanly."""
    ok(run)
    return out


def one_worker(out, steps, checkpoint_every, timeout):
    """The reference: one process, batch 64, on this machine (no launcher)."""
    return trained(launch([sys.executable, CNN, *one_by_64(checkpoint_every), "--max-steps", steps,
                           "--output-dir", out], timeout=timeout), out)


def bert_reference(root, timeout):
    """The data, the model's config and the reference: one process, 16 sequences a step.
    Returns (the arguments every run shares, the reference's output directory); a
    16-rank run adds ``--batch-size 1``."""
    data = make_small_static_data(root)
    (root / "config.json").write_text(json.dumps(BERT_CONFIG))
    common = ["--data", data, "--config", root / "config.json", *EXACT, "--steps", BERT_STEPS, "--lr", "1e-3",
              "--threads", "1", "--checkpoint-every", 2, "--balance", "--straggler-interval", 1000]
    trained(launch([sys.executable, PRETRAIN, *common, "--batch-size", 16, "--output-dir", root / "one"],
                   timeout=timeout), root / "one")
    return common, root / "one"


def assert_same_weights_as(out, reference, steps):
    """Equal to the reference's weights at each checkpoint in ``steps``, to float32 summation order."""
    for step in steps:
        assert_same_weights(checkpoint_at(out, step), checkpoint_at(reference, step), f"step {step}")


def assert_placed_four_per_host(out, ranks=RANKS, slots=SLOTS):
    """Every rank's own view of its node: its host, local rank and size, one thread."""
    placement = json.loads((out / "results.json").read_text())["placement"]
    assert [(p["rank"], p["host"], p["local_rank"], p["local_size"], p["threads"]) for p in placement] == [
        (rank, HOSTS[rank // slots], rank % slots, slots, 1) for rank in range(ranks)], placement
