#!/usr/bin/env python
"""prepare_bert_data.py as a whole process against its tokenizer alone, on the same text, interleaved.

    python tools/make_bench_corpus.py --megabytes 50 --files 4 --output /tmp/bench50
    python tools/measure_prepare_rate.py --input /tmp/bench50 --vocab VOCAB --ranks 1 3 --rounds 5

Each round runs, for each --ranks N, a pair: (a) the tokenizer alone, a process that reads
the input's lines (untimed) and times ``encode_batch_fast`` over them in batches of --batch
lines with the tokenizer's own threads on every CPU; then at once (b) the whole preparation
as a user runs it, ``python scripts/prepare_bert_data.py --input ... --vocab VOCAB
--output-dir OUT`` (under ``mpirun --oversubscribe -np N`` for N > 1), timed from its launch
to its exit: interpreter start-up, imports, every pass, the collectives between them, the
metadata and the exit. Rates are input bytes per second; a pair's fraction is (a)'s time
over (b)'s, and the medians of the pairs are reported (the pairs of a round take turns going
first). Other options are passed to the preparation (default: the script's own, e.g.
--dupe-factor 5). The process of (a) then times (c), the preparation's own tokenizer calls alone
over the same documents (sentences joined 32 to an input, plain text to the tokenizer's twin:
bert_prepare.Batch), untimed set-up, the ids neither cut apart nor stored: (c)/(b) is how close
the whole process comes to the tokenizing it cannot avoid.

On a shared machine: before each pair the tool waits (up to PATIENCE s) until the rest of the
machine has used under QUIET of a core for SETTLED s, and a pair is quiet when it stayed so
during both (a) and (b) (CPU-seconds from /proc/stat, less the pair's own). Rounds go on until
each run has --rounds quiet pairs (at most 3 x --rounds rounds); the medians are given over
every pair and over the quiet ones.

Also per pair: CPU-seconds of (b)'s process tree (from the children's rusage), and the
preparation's own stage times (the stages its last line names, rank 0's wall clock;
"launch and exit" is the rest of (b): the launcher, the interpreter's start and exit).
Every run's shards must be byte for byte those of the first (metadata sha256): checked.
--compare times other copies of the script (e.g. an earlier checkout's) beside this one:
(b) runs for each in each round.
"""
import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hvdtrain.data import bert_corpus as corpus
from hvdtrain.data import bert_prepare as prepare

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "prepare_bert_data.py"
STAGE = re.compile(r"([a-z][a-z0-9 -]*?) (\d+(?:\.\d+)?) s\b")


def repeated_corpus(directory, megabytes, files):
    """The embedded corpus written again and again into ``files`` text files until ``megabytes``."""
    text = "\n\n".join("\n".join(d) for d in corpus.default_corpus_documents()) + "\n\n"
    copies = max(1, round(megabytes * 1e6 / len(text.encode())))
    paths = []
    for index in range(files):
        paths.append(Path(directory) / f"part-{index:03d}.txt")
        share = copies // files + (index < copies % files)
        paths[-1].write_text(text * share, encoding="utf-8")
    return paths


def make_vocabulary(directory, vocab_size):
    """The script's own trainer over the embedded corpus, saved as a tokenizer directory."""
    sentences = (s for d in corpus.default_corpus_documents() for s in d)
    tokenizer = corpus.WordPieceTokenizer.from_vocab(corpus.train_wordpiece(sentences, vocab_size, True), True)
    corpus.save_tokenizer(tokenizer, Path(directory) / "tokenizer")
    return Path(directory) / "tokenizer"


def tokenizer_alone(vocab, paths, batch):
    """(a), run in its own process: seconds and CPU-seconds of encode_batch_fast over every line;
    then (c): seconds of the preparation's own tokenizer calls over the same documents (its joined
    sentences and plain-text twin, bert_prepare.Batch), the ids neither cut apart nor stored."""
    tokenizer = corpus.WordPieceTokenizer.load(vocab, True)
    documents = [d for path in paths for d in corpus.read_documents(path)]
    lines = [s for d in documents for s in d]
    backend, seconds, cpu = tokenizer.backend_tokenizer, 0.0, 0.0
    for first in range(0, len(lines), batch):
        start, start_cpu = time.perf_counter(), time.process_time()
        backend.encode_batch_fast(lines[first:first + batch], add_special_tokens=False)
        seconds += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
    tokenizer.plain_backend  # made before the clock starts, as the preparation makes it before its passes
    batches = [prepare.Batch(group, tokenizer) for group in prepare.batches(iter(documents), batch)]
    start = time.perf_counter()
    for made in batches:
        made.encoded()
    own = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "cpu": cpu, "lines": len(lines), "own_seconds": own}))


def busy_cpu_seconds():
    """CPU-seconds the machine's CPUs have spent busy since boot (/proc/stat: user, nice, system,
    irq, softirq; not idle, iowait, nor the hypervisor's steal), or None."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def timed(command, env):
    """Run ``command``; (wall seconds, CPU-seconds of its process tree, others' CPU-seconds, output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = busy_cpu_seconds()
    start = time.perf_counter()
    run = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    others = None if busy is None else max(0.0, busy_cpu_seconds() - busy - cpu)
    if run.returncode:
        sys.exit(f"failed ({run.returncode}): {' '.join(map(str, command))}\n{run.stdout}")
    return wall, cpu, others, run.stdout


def stages(output):
    """The stage times of the preparation's summary line (between its parentheses), by name."""
    line = next((line for line in output.splitlines() if line.startswith("wrote ")), "")
    found = {}
    for name, seconds in STAGE.findall(line[line.find("("):]):
        found[name.strip()] = float(seconds)
    return found


QUIET = 0.1  # cores the rest of the machine may use for a round to count as quiet
SETTLED = 5  # seconds of quiet awaited before each pair ...
PATIENCE = 900  # ... at most: then the pair runs anyway (and is not a quiet one)


def wait_for_quiet(seconds=SETTLED, patience=PATIENCE):
    """Wait (up to ``patience`` s) until the machine has been quiet for ``seconds``: a shared
    machine's bursts of load would otherwise land in one side of a pair."""
    deadline, window = time.monotonic() + patience, []
    while time.monotonic() < deadline:
        busy = busy_cpu_seconds()
        if busy is None:
            return
        window = [*window[-seconds:], busy]
        if len(window) > seconds and (window[-1] - window[0]) / seconds < QUIET:
            return
        time.sleep(1)


class Run:
    def __init__(self, seconds, cpu, others, wall, found):
        self.seconds, self.cpu, self.others, self.wall, self.stages = seconds, cpu, others, wall, found

    def others_load(self):
        """Cores the rest of the machine used meanwhile, on average."""
        return (self.others or 0.0) / self.wall


def quiet(pair):
    """Whether the rest of the machine stayed (nearly) idle during both sides of a pair."""
    return all(run.others_load() < QUIET for run in pair)


def shard_digests(directory):
    return [(s["file"], s["sha256"]) for s in json.loads((directory / "metadata.json").read_text())["shards"]]


def median(values):
    return statistics.median(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--input", nargs="+", type=Path, help="text files or directories (default: the embedded "
                                                                "corpus repeated, --megabytes)")
    parser.add_argument("--megabytes", type=float, default=12, help="size of the repeated embedded corpus")
    parser.add_argument("--files", type=int, default=1, help="files the repeated corpus is written to")
    parser.add_argument("--vocab", type=Path, help="the vocabulary (a tokenizer directory or vocab.txt; default: "
                                                   "one of --vocab-size trained on the embedded corpus)")
    parser.add_argument("--vocab-size", type=int, default=4000, help="the trained vocabulary's size (without --vocab)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1], help="(b) with these numbers of ranks "
                                                                          "(N > 1: mpirun --oversubscribe -np N)")
    parser.add_argument("--rounds", "--repeat", type=int, default=5,
                        help="quiet pairs of (a) and (b) wanted for each run (at most 3 x this many rounds)")
    parser.add_argument("--batch", type=int, default=20_000, help="lines per encode_batch_fast call in (a)")
    parser.add_argument("--compare", type=Path, nargs="+", default=[], metavar="SCRIPT",
                        help="other copies of prepare_bert_data.py (e.g. an earlier checkout's) timed in each "
                             "round too, after this checkout's")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a new one in /tmp, removed)")
    parser.add_argument("--tokenizer-alone", nargs=2, metavar=("VOCAB", "BATCH"), help=argparse.SUPPRESS)
    args, passed = parser.parse_known_args()
    if args.tokenizer_alone:
        return tokenizer_alone(args.tokenizer_alone[0], [Path(p) for p in passed], int(args.tokenizer_alone[1]))

    work = Path(args.work or tempfile.mkdtemp(prefix="prepare-rate-"))
    work.mkdir(parents=True, exist_ok=True)
    paths = corpus.input_files(args.input) if args.input else repeated_corpus(work, args.megabytes, args.files)
    size = sum(p.stat().st_size for p in paths) / 1e6
    vocab = args.vocab or make_vocabulary(work, args.vocab_size)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    alone_command = [sys.executable, __file__, "--tokenizer-alone", str(vocab), str(args.batch), *map(str, paths)]
    runs = [(script, ranks) for script in [SCRIPT, *args.compare] for ranks in args.ranks]
    lscpu = subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True).stdout
    model = re.search(r"Model name:\s*(.*)", lscpu)
    print(f"input: {size:.1f} MB in {len(paths)} file(s); vocabulary {vocab}; prepare options: "
          f"{' '.join(passed) or '(defaults)'}; {os.cpu_count()} CPUs ({model.group(1) if model else '?'}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    pairs, digests = {run: [] for run in runs}, None
    round_index = 0
    # Rounds until each run has --rounds quiet pairs (at most 3 x --rounds rounds).
    while round_index < 3 * args.rounds and min(sum(quiet(pair) for pair in done) for done in pairs.values()) \
            < args.rounds:
        for script, ranks in runs[round_index % len(runs):] + runs[:round_index % len(runs)]:  # each first in turn
            if sum(quiet(pair) for pair in pairs[(script, ranks)]) >= args.rounds:
                continue
            wait_for_quiet()
            seconds, cpu, others, output = timed(alone_command, env)
            result = json.loads(output.splitlines()[-1])
            alone = Run(result["seconds"], result["cpu"], others, seconds, {})
            alone.own_seconds = result["own_seconds"]
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            launcher = ["mpirun", "--oversubscribe", "-np", str(ranks)] if ranks > 1 else []
            command = [*launcher, sys.executable, str(script), "--input", *map(str, paths), "--vocab", str(vocab),
                       "--output-dir", str(out), *passed]
            seconds, cpu, others, output = timed(command, env)
            digests = digests or shard_digests(out)
            if shard_digests(out) != digests:
                sys.exit(f"the shards differ from the first run's: {' '.join(command)}")
            whole = Run(seconds, cpu, others, seconds, stages(output))
            pairs[(script, ranks)].append((alone, whole))
            print(f"{time.strftime('%H:%M:%S')} round {round_index + 1}, {ranks} rank(s) {script}: "
                  f"(a) {alone.seconds:.2f} s {size / alone.seconds:.2f} MB/s, others {alone.others_load():.2f} cores; "
                  f"(b) {whole.seconds:.2f} s {size / whole.seconds:.2f} MB/s, {whole.cpu:.1f} CPU-s, others "
                  f"{whole.others_load():.2f} cores; fraction {alone.seconds / whole.seconds:.3f}, "
                  f"(c) {alone.own_seconds:.2f} s, (c)/(b) {alone.own_seconds / whole.seconds:.3f}"
                  f"{' (quiet)' if quiet((alone, whole)) else ''}; "
                  f"{', '.join(f'{k} {v:g} s' for k, v in whole.stages.items())}", flush=True)
        round_index += 1

    print(f"\n(a): encode_batch_fast alone, batches of {args.batch} lines, on every CPU; (b): the whole process; "
          "(c): the preparation's own tokenizer calls alone (joined sentences, plain-text twin), on every CPU. "
          f"Quiet: the rest of the machine used under {QUIET} of a core during both (a) and (b).")
    for (script, ranks), results in pairs.items():
        print(f"{ranks} rank(s), {script}:")
        for name, chosen in (("all rounds", results), ("quiet rounds", [pair for pair in results if quiet(pair)])):
            if not chosen:
                print(f"    {name}: none")
                continue
            a, b = median([r[0].seconds for r in chosen]), median([r[1].seconds for r in chosen])
            fractions = [x.seconds / y.seconds for x, y in chosen]
            print(f"    {name} ({len(chosen)}): (a) median {size / a:.2f} MB/s, (b) median {size / b:.2f} MB/s "
                  f"({median([r[1].cpu for r in chosen]):.1f} CPU-s); fraction (a)/(b) median "
                  f"{median(fractions):.3f} (rounds: {' '.join(f'{f:.3f}' for f in fractions)}); (c) median "
                  f"{size / median([r[0].own_seconds for r in chosen]):.2f} MB/s, fraction (c)/(b) median "
                  f"{median([x.own_seconds / y.seconds for x, y in chosen]):.3f}")
            names = [n for n in dict.fromkeys(k for r in chosen for k in r[1].stages) if n != "in"]
            parts = [f"{n} {median([r[1].stages.get(n, 0.0) for r in chosen]):.2f}" for n in names]
            if all("in" in r[1].stages for r in chosen):  # the script's own total (since its process started)
                parts.append(f"launch and exit {median([r[1].seconds - r[1].stages['in'] for r in chosen]):.2f}")
            print(f"      stages of (b) (rank 0's clock), medians in s: {', '.join(parts) or 'none printed'}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
