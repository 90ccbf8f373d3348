"""benchmark.py predict --validate: every cell of a link study (tools/link_study.py's
study.json) against its bound and against the prediction.

Per cell, from the study alone and the models' own gradients:
  compute C     the batch over a rank's throughput at the study's placement: a plain
                loop on every host at once (base_placed); in older studies, one
                unshaped rank alone (base_one_rank), which shares nothing
  comm          2(n-1)/n x gradient bytes / busbw, busbw from the 64 MiB allreduce
                the study measured on that link (algbw; busbw = algbw x 2(n-1)/n)
  bound         max(C, comm): perfect overlap, no latency; no overlap is C + comm
  measured      n x batch / the cell's total throughput
The fraction of the bound is bound / measured step (1.0: the step is the bound).
Where the study recorded CPU (link_study.py since --hosts), a third table says where
the step goes on the cores the ranks share: CPU seconds per rank-step against the
plain loop's, the rest being communication's work on those same cores (TCP over the
link, MPI and Horovod's threads, which poll while they wait), and how busy the machine's cores were.
The prediction is predict's model with the options given (--overlap,
--backward-share, --latency-us, --cast-gbps); its error is predicted / measured - 1.
"""
import json

from hvdtrain.bench import predict

MIB = predict.MIB


def model_settings(arguments):
    """(model, batch size, vocabulary) from the study's benchmark.py train arguments."""
    value = {name: arguments[i + 1] for i, name in enumerate(arguments[:-1]) if name.startswith("--")}
    return value["--model"], int(value["--batch-size"]), int(value.get("--vocab-size", 30522))


def cells(study, args, cast):
    """One dict per measured cell: its bound's parts, the fraction, the prediction, the error."""
    latency = (args.latency_us or 10) / 1e6
    gradients, rows = {}, []
    for row in study["rows"]:
        model, batch, vocab = model_settings(study["models"][row["model"]])
        if model not in gradients:
            gradients[model] = predict.gradient_tensors(model, vocab)
        base = study["base_one_rank"][row["model"]]
        nodes = study.get("hosts") or round(row["total"] / (row["efficiency"] * base))  # efficiency = total / (n x base)
        compute, measured = batch / compute_base(study, row["model"]), nodes * batch / row["total"]
        width = 2 if row["fp16_allreduce"] else 4
        tensors = [width * count for count in gradients[model]]
        busbw = predict.bus_bandwidth(row["link_algbw_gbps"] * 1e9, nodes)
        comm = predict.ring_allreduce_seconds(sum(tensors), nodes, busbw, 0.0)
        casts = predict.cast_seconds(4 * sum(gradients[model]), cast) if row["fp16_allreduce"] else 0.0
        fused = predict.communication_seconds(tensors, row["fusion_mb"] * MIB, nodes, busbw, latency)
        predicted = predict.step_seconds(compute, fused, args.backward_share, args.overlap, casts)
        rows.append({**{key: row[key] for key in ("rate", "model", "fusion_mb", "fp16_allreduce")},
                     **cpu_use(study, row, nodes, compute, measured),
                     "nodes": nodes, "measured_s": measured, "compute_s": compute, "comm_s": comm,
                     "bound_s": max(compute, comm), "no_overlap_s": compute + comm,
                     "fraction_of_bound": max(compute, comm) / measured,
                     "allreduces": len(predict.fusion_buffers(tensors, row["fusion_mb"] * MIB)),
                     "predicted_s": predicted, "error": predicted / measured - 1})
    return rows


def cpu_use(study, row, nodes, compute, measured):
    """CPU seconds per rank-step of the cell and of the plain loop at its placement, and the
    share of the machine's cores the cell's ranks kept busy; {} for a study without them."""
    if "cpu_cores_per_rank" not in row or "placed_cpu_cores_per_rank" not in study:
        return {}
    cell_cpu = row["cpu_cores_per_rank"] * measured
    loop_cpu = study["placed_cpu_cores_per_rank"][row["model"]] * compute
    return {"cpu_s": cell_cpu, "loop_cpu_s": loop_cpu, "extra_cpu_s": cell_cpu - loop_cpu,
            "machine_busy": nodes * row["cpu_cores_per_rank"] / study["machine_cores"]}


def compute_base(study, model):
    """A rank's throughput for the bound's compute: at the study's placement where it measured it."""
    return study.get("base_placed", study["base_one_rank"])[model]


def validate(args):
    """benchmark.py predict --validate STUDY_JSON: the tables."""
    cast, cast_said = predict.cast_bandwidth(args)
    study = json.loads(args.validate.read_text())
    rows = cells(study, args, cast)
    rounds = len(study["rows"][0].get("rounds") or [None])
    placed = ("a plain loop on every host at once" if "base_placed" in study
              else "one rank alone (this study did not run them at its placement)")
    print(f"{args.validate}: {len(rows)} cells, {rows[0]['nodes']} ranks, {rounds} run(s) each (the median)")
    print(f"\nAgainst the bound max(compute, comm); compute: {placed}; "
          f"busbw = algbw x 2(n-1)/n = {2 * (rows[0]['nodes'] - 1) / rows[0]['nodes']:g} x algbw:\n")
    print("| link | model | fusion MiB | fp16 | measured s | compute s | comm s | bound s | no overlap s "
          "| bound / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {label(row)} | {row['measured_s']:.3f} | {row['compute_s']:.3f} | {row['comm_s']:.3f} | "
              f"{row['bound_s']:.3f} | {row['no_overlap_s']:.3f} | {row['fraction_of_bound']:.2f} |")
    print(f"\nPredicted (overlap {args.overlap:g} of a backward share {args.backward_share:.2f}, "
          f"latency {args.latency_us or 10:g} us per ring step, fp16 casts {cast_said}):\n")
    print("| link | model | fusion MiB | fp16 | allreduces | measured s | predicted s | error |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {label(row)} | {row['allreduces']} | {row['measured_s']:.3f} | {row['predicted_s']:.3f} | "
              f"{row['error'] * 100:+.0f} % |")
    if "cpu_s" in rows[0]:
        print(f"\nWhere a step goes on the {study['machine_cores']} cores the {rows[0]['nodes']} ranks share "
              "(CPU seconds per rank and step):\n")
        print("| link | model | fusion MiB | fp16 | measured s | CPU s | plain loop's CPU s | the rest: "
              "communication's CPU s, polling included | machine's cores busy |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {label(row)} | {row['measured_s']:.3f} | {row['cpu_s']:.3f} | {row['loop_cpu_s']:.3f} | "
                  f"{row['extra_cpu_s']:+.3f} | {row['machine_busy']:.2f} |")
    within = sum(abs(row["error"]) <= 0.10 for row in rows)
    mean = sum(abs(row["error"]) for row in rows) / len(rows)
    print(f"\nwithin +-10 %: {within} of {len(rows)} cells; mean |error| {mean * 100:.0f} %")
    return rows


def label(row):
    return f"{row['rate']} | {row['model']} | {row['fusion_mb']} | {'yes' if row['fp16_allreduce'] else 'no'}"
