#!/usr/bin/env python
"""The image-folder pipeline against its bound: decoding the JPEGs alone, per core.

    .venv/bin/python tools/measure_image_pipeline.py --output-dir runs/images
    .venv/bin/python tools/measure_image_pipeline.py --output-dir runs/images --image-size 112 --rounds 5
    .venv/bin/python tools/measure_image_pipeline.py --data DIR --output-dir runs/images   # your own folder

On a generated folder of ImageNet-like JPEGs (sides of 300-500 px, quality 90,
smooth regions, edges and sensor-like noise; --data for a folder of your own), in
interleaved rounds:
(a) decode alone, the bound: Pillow's open + full decode + RGB, nothing else;
(b) the training transform: ImageFolder(train=True)[i], what a DataLoader worker
    runs per image (decode, random-resized crop, flip, uint8 tensor); the trainer
    normalises whole batches, measured apart;
(c) the same transform decoding every JPEG whole and at full size
    (reduced_decode=False, partial_rows=False), for what decoding only what the
    crop needs gains;
(d) the DataLoader of one rank at 1, 2 and 4 workers (--loader-workers), batches
    of --batch-size, as train_cnn.py builds it (forkserver workers);
(e) train_cnn.py on one rank, --dataset imagefolder against --dataset synthetic,
    same model, size and batch (--trainer-model; --no-trainer skips it).
(a)-(c) run in this process, one image at a time: images per CPU-second is the rate
per core. Prints the medians over rounds with the spread and each rate's fraction
of (a); writes image_pipeline.json with the exact command and the environment.
PYTHONPATH=OLD/scripts measures another checkout's pipeline (and its train_cnn.py)
with this tool, for a before and after in one sitting.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from support.image_data import make_photo_folder



def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True, help="image_pipeline.json (and the folder made)")
    parser.add_argument("--data", type=Path, help="an image folder (train/<class>/*) instead of a generated one")
    parser.add_argument("--images", type=int, default=800, help="training images to generate (10 classes)")
    parser.add_argument("--image-size", type=int, default=224, help="the training resolution")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of (a)-(c)")
    parser.add_argument("--per-round", type=int, default=200, help="images decoded by (a)-(c) per round")
    parser.add_argument("--loader-workers", type=int, nargs="*", default=[1, 2, 4],
                        help="DataLoader workers for (d); none skips it")
    parser.add_argument("--batch-size", type=int, default=32, help="per step, for (d) and (e)")
    parser.add_argument("--trainer", action=argparse.BooleanOptionalAction, default=True, help="(e)")
    parser.add_argument("--trainer-model", default="resnet18", help="train_cnn.py --model for (e)")
    parser.add_argument("--trainer-steps", type=int, default=24,
                        help="steps of each (e) run, all in its first epoch (the workers start once)")
    return parser.parse_args(argv)


# ---- the folder ----

def folder_facts(paths):
    sizes = [Image.open(p).size for p in paths]
    pixels = sum(w * h for w, h in sizes)
    return {"images": len(paths), "mean_width": statistics.mean(w for w, _ in sizes),
            "mean_height": statistics.mean(h for _, h in sizes),
            "bits_per_pixel": 8 * sum(os.path.getsize(p) for p in paths) / pixels,
            "mean_kib": statistics.mean(os.path.getsize(p) for p in paths) / 1024}


# ---- (a)-(c): one image at a time in this process ----

def decode_alone(path):
    """The bound: open, decode, RGB; the tool's own, so that a checkout measured with
    PYTHONPATH=OLD/scripts is held to the same bound."""
    with Image.open(path) as image:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")


def per_core_rate(function, items):
    """Images per CPU-second (this process) and per wall second."""
    cpu, wall = time.process_time(), time.perf_counter()
    for item in items:
        function(item)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return len(items) / cpu, len(items) / wall


def in_process_rounds(args, paths, train_set, reference_set):
    indices = list(range(len(paths)))
    pick = lambda r: [indices[(r * args.per_round + i) % len(indices)] for i in range(args.per_round)]  # noqa: E731
    kinds = {"decode": lambda i: decode_alone(paths[i]), "transform": train_set.__getitem__}
    if reference_set is not None:
        kinds["whole_decode_transform"] = reference_set.__getitem__
    for function in kinds.values():  # warm: imports, page cache
        function(0)
    rates = {kind: [] for kind in kinds}
    for r in range(args.rounds):
        chosen = pick(r)
        for kind, function in kinds.items():
            rates[kind].append(per_core_rate(function, chosen)[0])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rates.items()), flush=True)
    return rates


# ---- (d): the DataLoader ----

def loader_rate(train_set, workers, batch_size, batches):
    from hvdtrain.training import loaders
    loader = loaders.make_loader(train_set, None, batch_size, workers, False)
    iterator = iter(loader)
    next(iterator)  # workers started, first batches made: left out
    next(iterator)
    batches = min(batches, len(train_set) // batch_size - 2)  # within the one epoch
    start = time.perf_counter()
    count = 0
    for _ in range(batches):
        images, _ = next(iterator)
        count += len(images)
    rate = count / (time.perf_counter() - start)
    del iterator
    return rate


# ---- (e): the trainer ----

def trainer_rate(args, dataset, data_dir, output_dir):
    """train_cnn.py beside the hvdtrain imported (PYTHONPATH=OLD/scripts measures another version)."""
    import hvdtrain
    out = output_dir / f"train-{dataset}"
    script = Path(hvdtrain.__file__).resolve().parent.parent / "train_cnn.py"
    command = [sys.executable, str(script), "--dataset", dataset,
               "--model", args.trainer_model, "--image-size", str(args.image_size),
               "--batch-size", str(args.batch_size), "--max-steps", str(args.trainer_steps),
               "--epochs", "1", "--output-dir", str(out), "--no-resume", "--checkpoint-every", "0",
               "--precision", "fp32", "--synthetic-samples", str(args.batch_size * args.trainer_steps)]
    if dataset == "imagefolder":
        command += ["--data", str(data_dir), "--no-verify-images"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads((out / "results.json").read_text())["images_per_sec"], command


def normalisation_rate(args, train_set):
    """Per CPU-second: the trainer's normalisation of uint8 batches (normalize_pixels), per image."""
    import torch
    from hvdtrain.data import images
    if not hasattr(images, "normalize_pixels"):
        return None  # a version whose workers normalise (inside (b))
    batch = torch.stack([train_set[i][0] for i in range(args.batch_size)])
    cpu = time.process_time()
    for _ in range(20):
        images.normalize_pixels(batch)
    return 20 * args.batch_size / (time.process_time() - cpu)


def whole_decode_set(images, train, image_size):
    """The transform decoding every JPEG whole and at full size, in the version imported;
    None for a version that never decodes less (its (b) is that already)."""
    for economies in ({"reduced_decode": False, "partial_rows": False}, {"reduced_decode": False}):
        try:
            return images.ImageFolder(train, image_size, True, seed=0, **economies)
        except TypeError:  # an earlier version, without that economy
            continue
    return None


def main():
    args = parse_args()
    import torch
    from hvdtrain.bench import record
    from hvdtrain.data import images
    torch.set_num_threads(1)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    data_dir = args.data or make_photo_folder(Path(tempfile.mkdtemp(dir=args.output_dir, prefix="folder-")), args.images)
    _, train, _ = images.scan_image_folder(data_dir)
    paths = [path for path, _ in train]
    facts = folder_facts(paths)
    print(f"{facts['images']} training images, {facts['mean_width']:.0f} x {facts['mean_height']:.0f} px "
          f"on average, {facts['bits_per_pixel']:.2f} bits/pixel ({facts['mean_kib']:.0f} KiB)", flush=True)
    train_set = images.ImageFolder(train, args.image_size, True, seed=0)
    reference_set = whole_decode_set(images, train, args.image_size)
    rates = in_process_rounds(args, paths, train_set, reference_set)
    result = {"command": [sys.executable, *sys.argv], "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": {"processor": record.cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "pillow": Image.__version__, "torch": torch.__version__},
              "folder": facts, "image_size": args.image_size,
              "per_core": {kind: record.summarize(values) for kind, values in rates.items()}}
    bound = result["per_core"]["decode"]["median"]
    print(f"\nper core (images per CPU-second, median of {args.rounds} rounds, min-max):")
    for kind, row in result["per_core"].items():
        print(f"  {kind:<28} {row['median']:8.1f}  ({row['min']:.1f}-{row['max']:.1f})  "
              f"{row['median'] / bound:.3f} of decode alone")
    result["trainer_normalisation_per_core"] = normalisation_rate(args, train_set)
    if result["trainer_normalisation_per_core"]:
        print(f"  {'normalisation in the trainer':<28} {result['trainer_normalisation_per_core']:8.1f}  "
              f"(batches of {args.batch_size}, per image)")
    result["loader"] = {}
    for workers in args.loader_workers:
        rate = loader_rate(train_set, workers, args.batch_size, batches=max(4, args.per_round // args.batch_size))
        result["loader"][workers] = rate
        print(f"  DataLoader, {workers} worker(s): {rate:8.1f} images/s  ({rate / bound:.3f} x one core's bound)")
    if args.trainer:
        args.trainer_steps = min(args.trainer_steps, len(paths) // args.batch_size)  # one epoch
        for dataset in ("imagefolder", "synthetic"):
            rate, command = trainer_rate(args, dataset, data_dir, args.output_dir)
            result.setdefault("trainer", {})[dataset] = {"images_per_sec": rate, "command": command}
        trainer = result["trainer"]
        ratio = trainer["imagefolder"]["images_per_sec"] / trainer["synthetic"]["images_per_sec"]
        trainer["imagefolder_over_synthetic"] = ratio
        print(f"  train_cnn.py --model {args.trainer_model}: imagefolder "
              f"{trainer['imagefolder']['images_per_sec']:.1f}, synthetic {trainer['synthetic']['images_per_sec']:.1f} "
              f"images/s ({ratio:.3f})")
    (args.output_dir / "image_pipeline.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output_dir / 'image_pipeline.json'}")


if __name__ == "__main__":
    main()
