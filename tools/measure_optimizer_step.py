"""Time one optimizer step on a real model's parameters, against torch's fused AdamW.

    python tools/measure_optimizer_step.py --model bert-large [--device cuda] [--compare OPTIM_PY ...]

The step alone: the model's parameters with random gradients, no forward or backward pass,
the device synchronised around each timed window. Measured: the project's LAMB (``optim.LAMB``
with BERT's decay groups), torch's AdamW with its multi-tensor (foreach) and its fused
kernels. Fused AdamW is the bound: one pass over the parameters, gradients and both moments,
which every Adam-family step must make; LAMB adds a norm per tensor on top. ``--compare``
times the LAMB of other copies of training/optim.py too (an older version, a variant), so a
change is measured in the same run. Prints one line per optimizer and writes --output as JSON.
"""
import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from hvdtrain.models import bert
from hvdtrain.training import optim


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-large", choices=[f"bert-{name}" for name in sorted(bert.PRESETS)])
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compare", type=Path, nargs="+", default=[], metavar="OPTIM_PY",
                        help="other copies of training/optim.py whose LAMB is timed too")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    device = torch.device(args.device)
    model = bert.build_model(bert.preset_config(args.model.removeprefix("bert-"), args.vocab_size)).to(device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator(device=device).manual_seed(0)
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, device=device, generator=generator) * 1e-3
    groups = lambda: optim.decay_groups(model, 0.01)  # noqa: E731
    candidates = {"lamb": lambda: optim.LAMB(groups(), lr=1e-4),
                  "adamw-foreach": lambda: torch.optim.AdamW(groups(), lr=1e-4, foreach=True),
                  "adamw-fused (bound)": lambda: torch.optim.AdamW(groups(), lr=1e-4, fused=True)}
    for path in args.compare:
        module = load_module(path)
        candidates[f"lamb ({path.name})"] = lambda module=module: module.LAMB(groups(), lr=1e-4)

    count = sum(p.numel() for p in parameters)
    print(f"{args.model}: {len(parameters)} tensors, {count / 1e6:.1f} M parameters, on {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}")
    results = {}
    for name, make in candidates.items():
        optimizer = make()
        seconds, launch = time_steps(optimizer, device, args.warmup_steps, args.steps)
        results[name] = {"ms_per_step": seconds * 1e3, "launch_ms_per_step": launch * 1e3}
        del optimizer
    bound = results["adamw-fused (bound)"]["ms_per_step"]
    for name, result in results.items():
        result["bound_fraction"] = bound / result["ms_per_step"]
        print(f"{name:22s} {result['ms_per_step']:8.2f} ms per step ({result['launch_ms_per_step']:.2f} ms "
              f"to issue it), {result['bound_fraction']:.2f} of the fused AdamW bound")
    if args.output:
        args.output.write_text(json.dumps({"model": args.model, "device": str(device), "tensors": len(parameters),
                                           "parameters": count, "results": results}, indent=1))


def time_steps(optimizer, device, warmup, steps):
    """(seconds per step, seconds to issue a step): the host's share shows launch overhead."""
    for _ in range(warmup):
        optimizer.step()
    synchronize(device)
    issued = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        begin = time.perf_counter()
        optimizer.step()
        issued += time.perf_counter() - begin
    synchronize(device)
    return (time.perf_counter() - start) / steps, issued / steps


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_module(path):
    spec = importlib.util.spec_from_file_location(f"optim_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
