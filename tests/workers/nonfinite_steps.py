"""Run under `horovodrun -np 2` with HVDTRAIN_INJECT_NONFINITE set (e.g. "rank=1,steps=3,4").

The trainers' own step, optim.finish_step with a nonfinite.NonFiniteGuard, on
a small model: SGD with momentum, 2 backward passes per step (so Horovod's
handle bookkeeping must survive a skipped step), gradient clipping. Checks,
each an AssertionError with what it saw:
- a skipped step leaves the weights and the momentum exactly as they were;
- a step that is not skipped changes the weights;
- every rank skipped the same steps;
- the final weights are finite and identical on every rank.
Each rank then prints "rank R: skipped [3, 4]; weights finite and equal on every rank".
"""
from types import SimpleNamespace

import torch
import horovod.torch as hvd

from hvdtrain.runtime import nonfinite
from hvdtrain.training import optim
from hvdtrain.runtime.run import TrainState

STEPS = 8
PASSES = 2


def snapshot(model, optimizer):
    weights = [p.detach().clone() for p in model.parameters()]
    momenta = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()
               if "momentum_buffer" in optimizer.state[p]]
    return weights, momenta


def same(a, b):
    return all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y)) for x, y in zip(a, b))


def main():
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=PASSES)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = TrainState()
    guard = nonfinite.NonFiniteGuard.from_settings(
        SimpleNamespace(nonfinite_loss="skip", max_nonfinite_steps=10), rank, state, say=lambda line: None)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    skipped = []
    for step in range(1, STEPS + 1):
        before = snapshot(model, optimizer)
        for _ in range(PASSES):
            loss = guard.watch(model(torch.randn(8, 6, generator=data)).pow(2).mean())
            (loss / PASSES).backward()
        if optim.finish_step(optimizer, scaler, 1.0, model.parameters(), guard):
            assert not same(before[:1], snapshot(model, optimizer)[:1]), f"step {step} changed nothing"
        else:
            skipped.append(step)
            assert same(before, snapshot(model, optimizer)), f"skipped step {step} changed the weights"
        state.step += 1
    everyone = hvd.allgather_object(skipped, name="skipped_steps")
    assert all(other == skipped for other in everyone), f"ranks skipped different steps: {everyone}"
    assert state.skipped_steps == len(skipped), (state.skipped_steps, skipped)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    weights = hvd.allgather(flat.unsqueeze(0), name="final_weights")
    assert torch.isfinite(weights).all(), f"non-finite weights: {weights}"
    assert all(torch.equal(row, weights[0]) for row in weights), f"weights differ between ranks: {weights}"
    print(f"rank {rank}: skipped {skipped}; weights finite and equal on every rank", flush=True)


if __name__ == "__main__":
    main()
