"""Every rank must train the same job: the same settings, the same data.

A rank launched with another --lr, or reading another copy of the data (a
node whose copy is older, a path that differs on one node), would otherwise
train along: the gradients still average, silently wrong, or the ranks step
through different numbers of batches and wait for each other forever at an
epoch's end. So before anything is built, every rank sends its resolved
settings and a few facts about its data (sizes, vocabulary and file digests),
as one 32-byte digest, to every other (one allgather); each compares them with
rank 0's, and when one differs, rank 0's and that rank's settings go to every
rank (two broadcasts) and all stop with the same line, exit status 2:

    rank 1 differs from rank 0: lr 0.2 vs 0.1
"""
import hashlib
import json

import torch

from hvdtrain import durations
from hvdtrain.errors import UsageError
from hvdtrain.runtime import collectives

# Paths that may differ between ranks (node-local copies of the same files):
# what they hold is compared through the data facts instead. --threads may be
# set per node for unequal machines; it changes speed, not results.
PER_RANK = {"data", "init_checkpoint", "config", "threads"}


def check_ranks_agree(settings, facts):
    """Collective: a UsageError on every rank when some rank's settings or data facts differ."""
    mine = fingerprint(settings, facts)
    with durations.timed("checking that the ranks agree"):
        # Horovod: 32 bytes from each rank. Every rank's whole settings to every rank
        # (hvd.allgather_object) would be a few KB x N per rank: 1.5 MB at 512 ranks.
        digests = collectives.allgather(torch.frombuffer(bytearray(fingerprint_digest(mine)), dtype=torch.uint8),
                                name="rank_fingerprint_digests").view(-1, 32)
        differing = [rank for rank, same in enumerate((digests == digests[0]).all(dim=1).tolist()) if not same]
        if not differing:
            return
        # Horovod: only now the settings themselves, rank 0's and the first differing rank's.
        reference = collectives.broadcast_object(mine, root_rank=0, name="rank_fingerprint.reference")
        other = collectives.broadcast_object(mine, root_rank=differing[0], name="rank_fingerprint.differing")
    raise UsageError(_described(differing, other, reference), on_every_rank=True)


def fingerprint(settings, facts):
    """The settings (less PER_RANK) and the data facts, as one plain dict."""
    values = {name: settings[name] for name in settings.keys() if name not in PER_RANK}
    return {**values, **facts}


def fingerprint_digest(values):
    """sha256 of the fingerprint's canonical JSON (sorted names; paths and the like as text)."""
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).digest()


def disagreement(fingerprints):
    """None, or "rank R differs from rank 0: NAME R's value vs rank 0's, ..." for the first such rank."""
    reference = fingerprints[0]
    differing = [rank for rank, other in enumerate(fingerprints) if other != reference]
    if not differing:
        return None
    return _described(differing, fingerprints[differing[0]], reference)


def _described(differing, other, reference):
    """The one line for ``differing`` ranks, the first of which holds ``other``."""
    first = differing[0]
    names = sorted(name for name in set(reference) | set(other) if reference.get(name) != other.get(name))
    listed = ", ".join(f"{name} {_shown(name, other.get(name))} vs {_shown(name, reference.get(name))}"
                       for name in names)
    more = f" (and {len(differing) - 1} more rank{'s' if len(differing) > 2 else ''})" if len(differing) > 1 else ""
    return f"rank {first} differs from rank 0: {listed}{more}; launch every rank with the same arguments and data"


def _shown(name, value):
    if name.endswith("sha256") and isinstance(value, str):
        return value[:12]  # enough to tell two digests apart
    return repr(value) if isinstance(value, str) else str(value)


def digest(items):
    """sha256 of the items' text, one per line: a file list or a checksum list in 64 characters."""
    hashed = hashlib.sha256()
    for item in items:
        hashed.update(f"{item}\n".encode())
    return hashed.hexdigest()
