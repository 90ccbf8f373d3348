#!/usr/bin/env python
"""Scaling across a shaped link, on two or four simulated hosts (docs/performance.md).

    .venv/bin/python tools/link_study.py --output-dir runs/link-study     # as root
    .venv/bin/python tools/link_study.py --hosts 4 --fusion-mb 128 --output-dir runs/link-study-4

Builds hvd-a, hvd-b (hvd-c, hvd-d) (tests/support/hosts.py: network namespaces on a
bridge, each with sshd), limits each host's link with tc's token-bucket filter in
both directions, and runs ``scripts/benchmark.py train`` with one rank per host
under ``horovodrun --mpi`` (or ``--gloo``) for each link rate, model, gradient compression and
fusion threshold, plus per model one single-rank run (the efficiency base) and
one plain loop per host all at once (the compute at the study's placement,
the bound's compute: benchmark.py predict --validate).
Before each rate, a 64 MiB allreduce checks what the link really carries.
Writes study.json, study.md (the table) and study.png.

All "hosts" share this machine's cores, one thread per rank. netem is not in
every kernel (not in this machine's): then only the rate is shaped and the
round-trip time is the veth pairs' and the bridge's own (tens of microseconds).
"""
import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from support.launch import SCRIPTS, launch
from support.hosts import INTERFACE, Hosts, require_hosts, sh

BENCH = SCRIPTS / "benchmark.py"
# Sizes that take seconds per step on one CPU core.
MODEL_ARGS = {
    "resnet50": ["--model", "resnet50", "--image-size", "64", "--batch-size", "16"],
    "bert-base": ["--model", "bert-base", "--seq-length", "128", "--batch-size", "4"],
    "resnet20": ["--model", "resnet20", "--batch-size", "32"],
    "bert-mini": ["--model", "bert-mini", "--seq-length", "128", "--batch-size", "8"],
}
TIMING = ["--warmup-steps", "1", "--window-steps", "2", "--windows", "3", "--threads", "1"]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/link-study"), help="results")
    parser.add_argument("--hosts", type=int, choices=[2, 4], default=2, help="simulated hosts, one rank each")
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"], help="tc rates ('none': unshaped)")
    parser.add_argument("--models", nargs="+", choices=list(MODEL_ARGS), default=["resnet50", "bert-base"],
                        help="what to train")
    parser.add_argument("--fusion-mb", nargs="+", type=int, default=[128, 0],
                        help="HOROVOD_FUSION_THRESHOLD values in MiB (0: no fusion)")
    parser.add_argument("--controller", choices=["mpi", "gloo"], default="mpi",
                        help="horovodrun --mpi (the collection's default) or --gloo")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every cell, interleaved (round 2 after all of round 1 at that rate); "
                             "a cell's total is the median, its spread the rounds' range")
    parser.add_argument("--summarize-only", action="store_true",
                        help="no launches: study.json, .md and .png again from --output-dir's result files")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    return parser.parse_args()


def shape(hosts, rate):
    """The same rate limit on both ends of the link (egress of each host's interface)."""
    for namespace in hosts.namespaces.values():
        subprocess_tc = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
        if rate == "none":
            launch([*subprocess_tc, "del", "dev", INTERFACE, "root"], timeout=20)
            continue
        bits = parse_rate(rate)
        burst = max(64 * 1024, bits // 8 // 100)  # 10 ms worth: the rate holds at high speeds
        sh([*subprocess_tc, "replace", "dev", INTERFACE, "root", "tbf", "rate", rate, "burst", str(burst),
            "latency", "50ms"])


def parse_rate(rate):
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[:-len(unit)]) * factor)
    raise SystemExit(f"link_study.py: error: rate {rate!r}: use e.g. 1gbit, 500mbit, none")


def on_hosts(hosts, np, arguments, args):
    # One rank stays on hvd-a (horovodrun's local host); more use one slot on each host.
    slots = ",".join(f"{name}:1" for name in hosts.names[:np])
    hosts_args = [] if np == 1 else ["-H", slots, "--network-interface", INTERFACE]
    command = ["horovodrun", "-np", str(np), *hosts_args, f"--{args.controller}", sys.executable, BENCH, *arguments]
    return checked(launch(hosts.on_first(command), timeout=args.timeout, env=hosts.env()))


def checked(ran):
    if ran.returncode != 0 or ran.timed_out:
        raise SystemExit(f"link_study.py: error: a launch failed:\n{ran.describe()}")
    return ran


def placed_compute(hosts, model, directory, args):
    """One plain loop (`--baseline none`, no communication) on every host at once: each
    rank's throughput where the study's ranks compute, sharing what they share (here
    the machine's cores). The bound's compute comes from these, not from one rank alone."""
    outputs = [directory / f"{model}-placed-{name}.json" for name in hosts.names]
    runs = [["train", *MODEL_ARGS[model], *TIMING, "--baseline", "none", "--output", output] for output in outputs]
    launched = [None] * len(runs)

    def run(index):
        command = hosts.on(hosts.names[index], [sys.executable, BENCH, *runs[index]])
        launched[index] = launch(command, timeout=args.timeout, env=hosts.env())

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for ran in launched:
        checked(ran)
    rates = [json.loads(output.read_text())["total"]["median"] for output in outputs]
    print(f"  {model}: {len(rates)} plain loops at once, per loop " + " ".join(f"{rate:.3f}" for rate in rates),
          flush=True)


def link_check(hosts, rate, directory, args):
    output = directory / f"allreduce-{rate}.json"
    on_hosts(hosts, args.hosts, ["allreduce", "--min-bytes", "64M", "--max-bytes", "64M", "--dtypes", "float32",
                                 "--libraries", "horovod", "--seconds", "2", "--threads", "1", "--output", output],
             args)
    (row,) = json.loads(output.read_text())["rows"]
    return row["algbw_gbps"]


def train(hosts, np, model, extra, output, args):
    started = time.monotonic()
    on_hosts(hosts, np, ["train", *MODEL_ARGS[model], *TIMING, *extra, "--output", output], args)
    result = json.loads(output.read_text())
    print(f"  {output.name}: {result['total']['median']:.2f} {result['unit']} "
          f"({time.monotonic() - started:.0f} s)", flush=True)
    return result


def study(args, hosts):
    """Every launch, each writing its result file in the output directory; then the summary."""
    directory = args.output_dir
    directory.mkdir(parents=True, exist_ok=True)
    shape(hosts, "none")
    for model in args.models:
        train(hosts, 1, model, [], directory / f"{model}-np1.json", args)
        placed_compute(hosts, model, directory, args)
    for rate in args.rates:
        shape(hosts, rate)
        measured = link_check(hosts, rate, directory, args)
        print(f"link {rate}: a 64 MiB allreduce moves {measured:.3f} GB/s (algbw)", flush=True)
        for round_index in range(args.rounds):  # interleaved: each cell's rounds see the machine at other times
            for model, fusion, fp16 in cells(args):
                extra = ["--fusion-threshold-mb", str(fusion)] + (["--fp16-allreduce"] if fp16 else [])
                train(hosts, args.hosts, model, extra, directory / cell_file(rate, model, fusion, fp16, round_index, args),
                      args)
    shape(hosts, "none")
    summarize(args)


def cells(args):
    return [(model, fusion, fp16) for model in args.models for fusion in args.fusion_mb for fp16 in (False, True)]


def cell_file(rate, model, fusion, fp16, round_index, args):
    suffix = f"-round{round_index}" if args.rounds > 1 else ""
    return f"{model}-{rate}-fusion{fusion}{'-fp16' if fp16 else ''}{suffix}.json"


def summarize(args):
    """study.json, study.md and study.png from the run's result files (--summarize-only: again,
    from a finished run's directory, with the same options)."""
    directory = args.output_dir
    read = lambda name: json.loads((directory / name).read_text())  # noqa: E731
    names = host_names(args.hosts)
    base = {model: read(f"{model}-np1.json")["total"]["median"] for model in args.models}
    placed = {model: [read(f"{model}-placed-{name}.json") for name in names] for model in args.models}
    rows = []
    for rate in args.rates:
        (link,) = read(f"allreduce-{rate}.json")["rows"]
        for model, fusion, fp16 in cells(args):
            results = [read(cell_file(rate, model, fusion, fp16, index, args)) for index in range(args.rounds)]
            rounds = sorted(result["total"]["median"] for result in results)
            total = statistics.median(rounds)
            spread = ([results[0]["total"]["min"], results[0]["total"]["max"]] if len(results) == 1
                      else [rounds[0], rounds[-1]])
            rows.append({"rate": rate, "link_algbw_gbps": link["algbw_gbps"], "model": model, "fusion_mb": fusion,
                         "fp16_allreduce": fp16, "total": total, "unit": results[0]["unit"],
                         "spread": spread, "rounds": [result["total"]["median"] for result in results],
                         "cpu_cores_per_rank": statistics.mean(result["cpu_cores_per_rank"] for result in results),
                         "efficiency": total / (args.hosts * base[model])})
    summary = {"controller": args.controller, "hosts": args.hosts, "machine_cores": read(
                   f"{args.models[0]}-np1.json")["environment"]["cpu_count"], "base_one_rank": base,
               # per-rank throughput and CPU with a plain loop on every host at once: the bound's compute
               "base_placed": {model: statistics.mean(r["total"]["median"] for r in runs) for model, runs in placed.items()},
               "placed_cpu_cores_per_rank": {model: statistics.mean(r["cpu_cores_per_rank"] for r in runs)
                                             for model, runs in placed.items()},
               "placed_loops": {model: [r["total"]["median"] for r in runs] for model, runs in placed.items()},
               "rows": rows, "timing": TIMING,
               "models": {m: MODEL_ARGS[m] for m in args.models}, "command": " ".join(sys.argv)}
    if args.summarize_only and (directory / "study.json").is_file():  # the command that measured
        summary = {**summary, "command": read("study.json")["command"], "summarized_by": " ".join(sys.argv)}
    (directory / "study.json").write_text(json.dumps(summary, indent=1) + "\n")
    (directory / "study.md").write_text(table(summary))
    plot(summary, directory / "study.png")
    print(table(summary), flush=True)


def host_names(count):
    return [f"hvd-{letter}" for letter in "abcd"[:count]]


def table(summary):
    lines = ["| link (measured algbw) | model | fusion | fp16 | total | efficiency |", "|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        lines.append(f"| {row['rate']} ({row['link_algbw_gbps']:.3f} GB/s) | {row['model']} | "
                     f"{row['fusion_mb']} MiB | {'yes' if row['fp16_allreduce'] else 'no'} | "
                     f"{row['total']:.2f} {row['unit']} | {row['efficiency']:.2f} |")
    bases = ", ".join(f"{model} {value:.2f}" for model, value in summary["base_one_rank"].items())
    placed = ", ".join(f"{model} {value:.2f}" for model, value in summary["base_placed"].items())
    return "\n".join(lines) + (f"\n\nOne rank, unshaped: {bases} (per second). One plain loop on each of the "
                               f"{summary['hosts']} hosts at once, per loop: {placed}.\n")


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(summary["base_one_rank"])
    figure, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.5), squeeze=False)
    for axis, model in zip(axes[0], models):
        rows = [row for row in summary["rows"] if row["model"] == model]
        rates = sorted({row["rate"] for row in rows}, key=parse_rate)
        for fusion in sorted({row["fusion_mb"] for row in rows}, reverse=True):
            for fp16 in (False, True):
                points = [next(r["efficiency"] for r in rows if r["rate"] == rate and r["fusion_mb"] == fusion
                               and r["fp16_allreduce"] == fp16) for rate in rates]
                axis.plot(rates, points, "o-" if fp16 else "s--",
                          label=f"fusion {fusion} MiB{', fp16' if fp16 else ''}")
        n = summary["hosts"]
        axis.set(title=f"{model}, {n} hosts", xlabel="link rate", ylabel=f"efficiency T({n}) / ({n} T(1))",
                 ylim=(0, 1.1))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    args = parse_args()
    if args.summarize_only:
        return summarize(args)
    require_hosts()
    hosts = Hosts(host_names(args.hosts), "10.77.0").start()
    try:
        study(args, hosts)
    finally:
        hosts.stop()


if __name__ == "__main__":
    main()
