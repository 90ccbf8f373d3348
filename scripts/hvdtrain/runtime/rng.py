"""Random number generators: seeded alike on every rank, and each rank's state as a checkpoint component.

    rng.seed_everything(seed)          # Python, NumPy and torch
    per_rank={"rng": rng.RngState(seed)}   # saved and restored with every checkpoint
"""
import random

import numpy as np
import torch


def seed_everything(seed):
    """Seed Python, NumPy and torch the same way on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_state():
    """This rank's random-number-generator states, as tensors and plain values.

    Plain types only, so that checkpoints load with ``weights_only=True``.
    """
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": _python_rng_to_plain(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_state(state):
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"], numpy_state["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _python_rng_to_plain(python_state):
    version, internal, gauss = python_state
    return [version, list(internal), gauss]


class RngState:
    """This rank's Python, NumPy, torch (and CUDA) generators as a component."""

    def __init__(self, seed):
        self.seed = seed  # the run's --seed: a resize derives the new ranks' generators from it

    def load_resized(self, entries, rank, step):
        """A resumed run on another number of ranks: no old rank's generator is this rank's, so it
        is derived from (seed, step, rank), the same for any relaunch of this resize."""
        self._derive(step, rank)

    def at_commit(self, step, rank):
        """--elastic, at a commit: the generators derived afresh from (seed, step, rank). A worker
        lost after it takes its generators with it, and a reset may give a survivor another rank
        (rank 0 stays on a live worker); derived from the rank, what each rank draws after the
        commit is what the run without the reset draws (dropout, masks)."""
        self._derive(step, rank)

    def _derive(self, step, rank):
        seed_everything(int(np.random.SeedSequence([self.seed, step, rank]).generate_state(1)[0]))

    def state_dict(self):
        return get_state()

    def load_state_dict(self, state):
        set_state(state)
