"""Run under `horovodrun -np N`: checks Horovod's collectives give exact answers.

Each check raises AssertionError with what it saw; the last line each rank
prints is "collectives ok rank=R size=N" only when every check passed. Under
Gloo it also prints how many TCP connections the rank holds after hvd.init()
and after hvd.shutdown() ("gloo connections init=K shutdown=M"): Gloo connects
one socket per peer in each of its contexts.
"""
import psutil
import torch
import horovod.torch as hvd


def tcp_connections():
    return sum(1 for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED)


def check_allreduce(rank, size):
    mine = torch.full((3,), float(rank + 1))
    average = hvd.allreduce(mine, op=hvd.Average, name="avg")
    total = hvd.allreduce(mine, op=hvd.Sum, name="sum")
    expected_sum = size * (size + 1) / 2
    assert torch.equal(total, torch.full((3,), expected_sum)), f"sum {total}"
    assert torch.allclose(average, torch.full((3,), expected_sum / size)), f"average {average}"


def check_broadcast(rank):
    received = hvd.broadcast(torch.tensor([rank * 10.0, 7.0]), root_rank=0, name="bcast")
    assert torch.equal(received, torch.tensor([0.0, 7.0])), f"broadcast {received}"


def check_broadcast_parameters(rank):
    torch.manual_seed(1000 + rank)  # a different initialisation on every rank
    model = torch.nn.Linear(4, 3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gathered = hvd.allgather(model.weight.detach().reshape(1, -1), name="weights")
    for other in gathered:
        assert torch.equal(other, gathered[0]), "parameters differ after broadcast_parameters"


def check_distributed_optimizer(rank, size):
    # loss = w . x with x = rank + 1 on each rank, so each rank's gradient is
    # rank + 1 and the averaged gradient is (size + 1) / 2.
    weight = torch.nn.Parameter(torch.zeros(5))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=[("weight", weight)])
    loss = (weight * float(rank + 1)).sum()
    loss.backward()
    optimizer.synchronize()
    expected = torch.full((5,), (size + 1) / 2)
    assert torch.allclose(weight.grad, expected), f"averaged gradient {weight.grad}"
    with optimizer.skip_synchronize():
        optimizer.step()
    assert torch.allclose(weight.detach(), -expected), f"weights after step {weight}"


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    check_allreduce(rank, size)
    check_broadcast(rank)
    check_broadcast_parameters(rank)
    check_distributed_optimizer(rank, size)
    print(f"collectives ok rank={rank} size={size}", flush=True)
    if hvd.gloo_enabled():
        after_init = tcp_connections()
        hvd.shutdown()
        print(f"gloo connections init={after_init} shutdown={tcp_connections()}", flush=True)


if __name__ == "__main__":
    main()
