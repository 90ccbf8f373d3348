"""benchmark.py timeline: where the time went in a Horovod timeline (--horovod-timeline).

Totals per activity (negotiation, allreduce, fusion-buffer copies), the number
of tensors and of the collectives the ranks really ran.
"""
import json
from pathlib import Path

from hvdtrain.bench.record import write_json
from hvdtrain.errors import UsageError



def run(args):
    try:
        events = read_timeline(args.file)
    except (OSError, ValueError) as error:
        raise UsageError(f"{args.file}: not a readable Horovod timeline ({error})") from None
    summary = summarize_timeline(events)
    print(f"{args.file}: {summary['span_seconds']:.2f} s, {summary['tensors']} tensors; "
          f"collectives: {', '.join(f'{n} {name}' for name, n in summary['collectives'].items()) or 'none'}",
          flush=True)
    print(f"{'activity':>28} {'total s':>9} {'count':>7} {'mean us':>10}", flush=True)
    for row in summary["activities"]:
        print(f"{row['activity']:>28} {row['seconds']:>9.3f} {row['count']:>7} {row['mean_us']:>10.1f}", flush=True)
    write_json(summary, args.output)


def read_timeline(path):
    """A Horovod timeline's events. Horovod writes a JSON array that it closes only at
    shutdown, with a comma after each event: a run still going (or killed) is read too."""
    text = Path(path).read_text().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def summarize_timeline(events):
    """Time per activity (B/E pairs, nested per tensor), tensors and distinct collectives.

    A fused collective shows once per tensor in it, with the same start: counting
    distinct (activity, start) pairs gives the collectives the ranks really ran.
    """
    open_spans, seconds, counts, collectives = {}, {}, {}, {}
    tensors = set()
    for event in events:
        phase, lane = event.get("ph"), event.get("pid")
        if phase == "M" and event.get("name") == "process_name" and "name" in event.get("args", {}):
            tensors.add(lane)  # one lane per tensor name
        elif phase == "B":
            open_spans.setdefault(lane, []).append((event["name"], event["ts"]))
            if event["name"].startswith(("MPI_", "GLOO_", "NCCL_")):
                collectives.setdefault(event["name"], set()).add(event["ts"])
        elif phase == "E" and open_spans.get(lane):
            name, started = open_spans[lane].pop()
            seconds[name] = seconds.get(name, 0) + (event["ts"] - started) / 1e6
            counts[name] = counts.get(name, 0) + 1
    stamps = [event["ts"] for event in events if "ts" in event]
    activities = [{"activity": name, "seconds": total, "count": counts[name], "mean_us": total / counts[name] * 1e6}
                  for name, total in sorted(seconds.items(), key=lambda item: -item[1])]
    return {"span_seconds": (max(stamps) - min(stamps)) / 1e6 if stamps else 0.0, "tensors": len(tensors),
            "collectives": {name: len(starts) for name, starts in sorted(collectives.items())},
            "activities": activities}
