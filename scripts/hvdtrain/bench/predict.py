"""benchmark.py predict: step time and efficiency on 2 to 512 nodes, from one
worker's compute time, the gradient bytes and a link (a model; nothing runs).

The model, one worker per node, all of them in one ring:
  ring allreduce of B bytes on n workers   2(n-1) a + 2(n-1)/n B / busbw
      (a: latency per ring step; busbw: nccl-tests' bus bandwidth, what each
      link carries; a sweep's algbw is B / time, busbw = algbw x 2(n-1)/n)
  fusion: the gradient tensors, in the order backward makes them ready, in the
      trainers' fixed buckets of 25 MiB, each packed into buffers of at most
      HOROVOD_FUSION_THRESHOLD bytes (0: one allreduce per tensor); every buffer
      pays the latency terms
  overlap: communication hides behind `overlap` x the backward pass, which is
      `backward_share` of the compute C; what is left shows:
      step = C + casts + max(0, comm - overlap x backward_share x C)
      (overlap 1 with backward_share 1 is the bound max(C, comm); overlap 0 is C + comm)
  fp16 compression: half the bytes, plus a cast of every gradient to fp16 and
      back per step at the cast throughput, on the compute (not hidden).
"""
import json
import statistics
import time
from pathlib import Path

import torch

from hvdtrain import cli
from hvdtrain.bench.options import BERT_MODELS, CNN_MODELS
from hvdtrain.runtime.horovod_profile import BUCKET_BYTES, packed

MIB = 2**20


def ring_allreduce_seconds(nbytes, nodes, busbw, latency):
    """One ring allreduce (reduce-scatter then allgather) of ``nbytes`` on ``nodes`` workers."""
    if nodes < 2:
        return 0.0
    return 2 * (nodes - 1) * latency + 2 * (nodes - 1) / nodes * nbytes / busbw


def bus_bandwidth(algbw, nodes):
    """nccl-tests' busbw of an allreduce from its algbw (bytes / time); equal at 2 ranks."""
    return algbw * 2 * (nodes - 1) / nodes


def fusion_buffers(tensor_bytes, threshold, bucket=BUCKET_BYTES):
    """Horovod's tensor fusion of the trainers' gradients: byte sizes of the allreduces a step runs.

    Tensors go in order into fixed buckets of at most ``bucket`` bytes
    (dist.fixed_gradient_buckets), and each bucket's into buffers of at most
    ``threshold`` bytes; a tensor larger than the limit, or any tensor with
    threshold 0, goes alone.
    """
    buffers = []
    for bucket in packed(tensor_bytes, bucket):
        sizes = [tensor_bytes[i] for i in bucket]
        buffers += [sum(sizes[i] for i in buffer) for buffer in packed(sizes, threshold)]
    return buffers


def communication_seconds(tensor_bytes, threshold, nodes, busbw, latency):
    return sum(ring_allreduce_seconds(size, nodes, busbw, latency)
               for size in fusion_buffers(tensor_bytes, threshold))


def step_seconds(compute, comm, backward_share, overlap, casts=0.0):
    """One step: compute, casts, and the communication backward did not hide."""
    return compute + casts + max(0.0, comm - overlap * backward_share * compute)


def cast_seconds(fp32_bytes, cast_bandwidth):
    """fp16 compression: every fp32 gradient to fp16 before the allreduce, and back after."""
    return 2 * fp32_bytes / cast_bandwidth


def gradient_tensors(model, vocab_size=30522):
    """Element counts of a model's gradients (hvdtrain.models, as benchmark.py trains them),
    last layer first: the order backward makes them ready. Built on the meta device."""
    from hvdtrain.models import bert, resnet
    with torch.device("meta"):
        if model in CNN_MODELS:
            built = resnet.build(model, CNN_MODELS[model][1])
        else:
            built = bert.build_model(bert.preset_config(BERT_MODELS[model], vocab_size))
    return [p.numel() for p in built.parameters() if p.requires_grad][::-1]


def measure_cast_bandwidth(megabytes=64, repeats=5):
    """fp32 bytes per second cast to fp16 and back, halved (one cast), on this machine."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensor = torch.randn(megabytes * MIB // 4, device=device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        tensor.half().float()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 2 * tensor.numel() * 4 / statistics.median(times)


def link_from_sweep(path, library):
    """(busbw fp32, busbw fp16 or None, latency) from a `benchmark.py allreduce` JSON: the
    largest message's busbw, and the smallest message's time over its 2(n-1) ring steps."""
    data = json.loads(Path(path).read_text())
    ranks = data["environment"]["world_size"]
    rows = [row for row in data["rows"] if row["library"] == library]
    float32 = sorted((row for row in rows if row["dtype"] == "float32"), key=lambda row: row["bytes"])
    float16 = sorted((row for row in rows if row["dtype"] == "float16"), key=lambda row: row["bytes"])
    if not float32 or ranks < 2:
        cli.fail(f"--sweep {path}: no float32 rows of {library} on 2 or more ranks")
    latency = float32[0]["seconds"] / (2 * (ranks - 1))
    return float32[-1]["busbw_gbps"] * 1e9, float16[-1]["busbw_gbps"] * 1e9 if float16 else None, latency


def compute_from_result(path):
    """Seconds per step of one worker from a `benchmark.py train` JSON (its per-worker median)."""
    data = json.loads(Path(path).read_text())
    knobs = data["environment"]["knobs"]
    return knobs["batch_size"] * knobs["accumulation_steps"] / data["per_worker"]["median"]



def cast_bandwidth(args):
    """(fp16 cast bytes/s, how it was found): --cast-gbps, else measured here."""
    cast = args.cast_gbps * 1e9 if args.cast_gbps else measure_cast_bandwidth()
    return cast, f"{cast / 1e9:.2f} GB/s ({'given' if args.cast_gbps else 'measured here'})"


def run(args):
    """The prediction table (--validate is bench/bounds.py's, dispatched by benchmark.py)."""
    cast, cast_said = cast_bandwidth(args)
    if not (args.model or args.gradient_bytes) or not (args.compute_ms or args.compute_from):
        cli.fail("give --model or --gradient-bytes, and --compute-ms or --compute-from (or --validate FILE)")
    if args.model:
        elements = gradient_tensors(args.model, args.vocab_size)
        tensors = [4 * count for count in elements]
        name = f"{args.model}: {sum(elements) / 1e6:.1f} M parameters in {len(elements)} tensors"
    else:
        tensors = [args.gradient_bytes / args.tensors] * args.tensors
        name = f"{len(tensors)} tensors"
    compute = args.compute_ms / 1e3 if args.compute_ms else compute_from_result(args.compute_from)
    busbw16 = latency = None
    if args.sweep:
        busbw, busbw16, latency = link_from_sweep(args.sweep, args.library)
    else:
        busbw = args.link_gbit * 1e9 / 8 if args.link_gbit else (args.busbw_gbps or 12.5) * 1e9  # 100 Gbit/s
    latency = args.latency_us / 1e6 if args.latency_us else (latency if latency is not None else 10e-6)
    threshold = args.fusion_mb * MIB
    fp32_bytes = sum(tensors)
    half = [size / 2 for size in tensors]
    print(f"{name}, {fp32_bytes / 1e6:.1f} MB of fp32 gradients ({fp32_bytes / 2e6:.1f} MB as fp16)")
    print(f"compute {compute * 1e3:.1f} ms per step; busbw {busbw / 1e9:.2f} GB/s"
          f"{f' (fp16 {busbw16 / 1e9:.2f})' if busbw16 else ''}, latency {latency * 1e6:.1f} us per ring step; "
          f"fusion {args.fusion_mb:g} MiB: {len(fusion_buffers(tensors, threshold))} allreduce(s) per step "
          f"({len(fusion_buffers(half, threshold))} as fp16)")
    print(f"overlap {args.overlap:g} of the backward pass ({args.backward_share:.2f} of compute); "
          f"fp16 casts {cast_said}, {cast_seconds(fp32_bytes, cast) * 1e3:.1f} ms per step")
    print("| nodes | allreduce ms | step ms | efficiency | fp16: allreduce ms | step ms | efficiency |")
    print("|---|---|---|---|---|---|---|")
    pays = []
    for nodes in args.nodes:
        comm = communication_seconds(tensors, threshold, nodes, busbw, latency)
        comm16 = communication_seconds(half, threshold, nodes, busbw16 or busbw, latency)
        step = step_seconds(compute, comm, args.backward_share, args.overlap)
        step16 = step_seconds(compute, comm16, args.backward_share, args.overlap, cast_seconds(fp32_bytes, cast))
        pays.append(step16 < step)
        print(f"| {nodes} | {comm * 1e3:.1f} | {step * 1e3:.1f} | {compute / step:.3f} | "
              f"{comm16 * 1e3:.1f} | {step16 * 1e3:.1f} | {compute / step16:.3f} |")
    print(fp16_verdict(args.nodes, pays))


def fp16_verdict(nodes, pays):
    if not any(pays):
        return f"fp16 compression does not pay at {nodes[0]}-{nodes[-1]} nodes: its casts cost more than it saves"
    first = nodes[pays.index(True)]
    if all(pays[pays.index(True):]):
        return f"fp16 compression pays from {first} nodes on"
    return f"fp16 compression pays at {', '.join(str(n) for n, p in zip(nodes, pays) if p)} nodes"

