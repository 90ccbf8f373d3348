"""Time one optimizer step on a real model's parameters, against torch's fused AdamW.

    python tools/measure_optimizer_step.py --model bert-large [--device cuda] [--compile] [--compare OPTIM_PY ...]

The step alone: the model's parameters with random gradients, no forward or backward pass,
the device synchronised around each timed window. Measured: the project's LAMB (``optim.LAMB``
with BERT's decay groups) in its two forms, one multi-tensor op per formula and the step
compiled into a few kernels per group (training/lamb_fused.py: on CUDA, or with --compile; its
first step, the compilation, is timed apart), and torch's AdamW
with its multi-tensor (foreach) and its fused kernels. Fused AdamW is the bound: one pass over
the parameters, gradients and both moments, which every Adam-family step must make; LAMB adds
a norm per tensor on top. ``--compare`` times the LAMB of other copies of training/optim.py
too (an older version, a variant: their own default form), so a change is measured in the same
run. With both LAMB forms it then steps each from the same weights and prints how far apart they
end (--check-steps). Prints one line per optimizer and writes --output as JSON.
"""
import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from hvdtrain.models import bert
from hvdtrain.training import optim


LAMB_FORMS = {"multi-tensor": False, "compiled": True}  # optim.LAMB's fused=


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-large", choices=[f"bert-{name}" for name in sorted(bert.PRESETS)])
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed steps, the first (timed apart) included")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true",
                        help="time LAMB's compiled step too on a CPU (on CUDA it always is)")
    parser.add_argument("--compare", type=Path, nargs="+", default=[], metavar="OPTIM_PY",
                        help="other copies of training/optim.py whose LAMB is timed too")
    parser.add_argument("--check-steps", type=int, default=5,
                        help="with both LAMB forms: steps of each from the same weights, then their difference")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    device = torch.device(args.device)
    model = bert.build_model(bert.preset_config(args.model.removeprefix("bert-"), args.vocab_size)).to(device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator(device=device).manual_seed(0)
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, device=device, generator=generator) * 1e-3
    groups = lambda: optim.decay_groups(model, 0.01)  # noqa: E731
    forms = list(LAMB_FORMS) if device.type == "cuda" or args.compile else ["multi-tensor"]
    candidates = {f"lamb ({form})": lambda form=form: optim.LAMB(groups(), lr=1e-4, fused=LAMB_FORMS[form])
                  for form in forms}
    candidates["adamw-foreach"] = lambda: torch.optim.AdamW(groups(), lr=1e-4, foreach=True)
    candidates["adamw-fused (bound)"] = lambda: torch.optim.AdamW(groups(), lr=1e-4, fused=True)
    for path in args.compare:
        module = load_module(path)
        candidates[f"lamb ({path.name})"] = lambda module=module: module.LAMB(groups(), lr=1e-4)

    count = sum(p.numel() for p in parameters)
    print(f"{args.model}: {len(parameters)} tensors, {count / 1e6:.1f} M parameters, on {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}")
    results = {}
    for name, make in candidates.items():
        optimizer = make()
        first, seconds, launch = time_steps(optimizer, device, args.warmup_steps, args.steps)
        results[name] = {"ms_per_step": seconds * 1e3, "launch_ms_per_step": launch * 1e3, "first_step_s": first}
        del optimizer
    bound = results["adamw-fused (bound)"]["ms_per_step"]
    for name, result in results.items():
        result["bound_fraction"] = bound / result["ms_per_step"]
        print(f"{name:24s} {result['ms_per_step']:8.2f} ms per step ({result['launch_ms_per_step']:.2f} ms "
              f"to issue it), {result['bound_fraction']:.2f} of the fused AdamW bound; first step "
              f"{result['first_step_s']:.1f} s")
    agreement = None
    if "compiled" in forms:
        agreement = compare_forms(parameters, device, args.check_steps)
        print(f"lamb compiled against multi-tensor, {args.check_steps} steps from the same weights: weights within "
              f"{agreement['weights']:.1e}, moments within {agreement['moments']:.1e} of each tensor's largest value "
              f"(tests/test_lamb.py's tolerance: {RTOL:.0e})")
    if args.output:
        args.output.write_text(json.dumps({"model": args.model, "device": str(device), "tensors": len(parameters),
                                           "parameters": count, "results": results, "agreement": agreement}, indent=1))


RTOL = 1e-6  # tests/test_lamb.py's


def compare_forms(parameters, device, steps):
    """The largest difference, relative to each tensor's largest value, between the compiled and the
    multi-tensor LAMB after ``steps`` steps from the same weights with the same random gradients."""
    copies, optimizers = [], []
    for fused in (False, True):
        params = [torch.nn.Parameter(p.detach().clone()) for p in parameters]
        copies.append(params)
        optimizers.append(optim.LAMB([{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.01},
                                      {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
                                     lr=1e-3, fused=fused))
    generator = torch.Generator(device=device).manual_seed(1)
    for step in range(steps):
        for index in range(len(parameters)):
            grad = torch.randn(parameters[index].shape, device=device, generator=generator) * 1e-3
            for params in copies:
                params[index].grad = grad
        for optimizer in optimizers:
            optimizer.step()
    worst = {"weights": 0.0, "moments": 0.0}
    for reference, compiled in zip(*copies):
        pairs = [("weights", reference, compiled)] + [
            ("moments", optimizers[0].state[reference][key], optimizers[1].state[compiled][key])
            for key in ("exp_avg", "exp_avg_sq")]
        for kind, expected, actual in pairs:
            scale = expected.abs().max().item() or 1.0
            worst[kind] = max(worst[kind], (actual - expected).abs().max().item() / scale)
    return worst


def time_steps(optimizer, device, warmup, steps):
    """(seconds of the first step, seconds per step after the warm-up, seconds to issue one):
    the first holds any compilation; the host's share shows launch overhead."""
    synchronize(device)
    begin = time.perf_counter()
    optimizer.step()
    synchronize(device)
    first = time.perf_counter() - begin
    for _ in range(warmup - 1):
        optimizer.step()
    synchronize(device)
    issued = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        begin = time.perf_counter()
        optimizer.step()
        issued += time.perf_counter() - begin
    synchronize(device)
    return first, (time.perf_counter() - start) / steps, issued / steps


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
