#!/usr/bin/env python
"""Where the ranks of a stopped job diverged: every rank's flight-recorder dump, merged.

    python scripts/flight_dumps.py runs/cnn/flight-recorder     # the run's --output-dir/flight-recorder

Each rank of a trainer writes its recent collectives there when the job ends by the
watchdog, a failure or a stop signal (hvdtrain/liveness/recorder.py). This prints, in
a few lines: the first collective at which the ranks' records differ (by sequence
number: which rank made which collective, from which script line), what each rank
was waiting in or doing when it wrote its dump, and the ranks without a dump (killed
before they could write one). Exit status 0 whether or not the ranks diverged; 2 for
a directory without dumps.
"""
import argparse
from pathlib import Path

from hvdtrain import cli
from hvdtrain.errors import UsageError
from hvdtrain.liveness import recorder
from hvdtrain.liveness.peers import rank_list


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the run's flight-recorder/ folder (in its --output-dir)")
    parser.add_argument("--ranks", type=cli.positive_int, help="the job's size, to name ranks without a dump")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    dumps = recorder.read_dumps(args.directory)
    if not dumps:
        raise UsageError(f"no flight-recorder dumps (rank-*.json) in {args.directory}")
    for line in findings(dumps, args.ranks):
        print(line)


def findings(dumps, ranks=None):
    """The merged dumps' lines: the first difference, each rank's state, the missing ranks."""
    lines = []
    steps = sorted({dump.get("step") for dump in dumps.values()}, key=lambda s: -1 if s is None else s)
    lines.append(f"{len(dumps)} dump(s) in all, written after step {', '.join(map(str, steps))} ("
                 + "; ".join(sorted({f"{dump['reason']}" for dump in dumps.values()})) + ")")
    first = recorder.first_difference(dumps)
    if first is None:
        lines.append("the ranks' recorded collectives agree as far as each rank's record goes")
    else:
        seq, at = first
        made = {}
        for rank, record in at.items():
            text = (f"made {record['op']} {record['name']} {record['detail']} at {record['where']}"
                    if record else "made none")
            made.setdefault(text, []).append(rank)
        lines.append(f"first difference at collective #{seq}: "
                     + "; ".join(f"{rank_list(ranks_)} {text}" for text, ranks_ in made.items()))
    statuses = {rank: dump["status"] for rank, dump in dumps.items()}
    state = recorder.divergence(statuses, rank_list)
    lines.append(f"as the dumps were written: {state}" if state else
                 "as the dumps were written, every rank was in the same place: "
                 + recorder.describe(next(iter(statuses.values()))))
    if ranks:
        missing = sorted(set(range(ranks)) - set(dumps))
        if missing:
            lines.append(f"no dump from {rank_list(missing)}: killed before it could write one, or never started")
    return lines


if __name__ == "__main__":
    cli.run_main(main)
