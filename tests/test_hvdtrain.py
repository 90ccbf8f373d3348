"""Unit tests of the shared package (single process; Horovod with size 1)."""
import math
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hvdtrain.runtime import checkpoint_files, dist, metrics, rng, runlog
from hvdtrain import cli
from hvdtrain.training import optim
from hvdtrain.errors import UsageError
from hvdtrain.data.sampling import ShardedSampler, UnpaddedShardSampler, assign_rows
from support.checkpoints import checkpoint_name
from support.checks import ok
from support.launch import python


def test_sharded_ranks_together_see_the_single_process_order():
    single = list(ShardedSampler(50, rank=0, size=1, batch_size=8, seed=3))
    ranks = [list(ShardedSampler(50, rank=r, size=2, batch_size=4, seed=3)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 24  # 50 // (2 * 4) = 6 full steps each
    for step in range(6):
        global_batch = set(ranks[0][step * 4:(step + 1) * 4]) | set(ranks[1][step * 4:(step + 1) * 4])
        assert global_batch == set(single[step * 8:(step + 1) * 8])


def test_sharded_sampler_resumes_mid_epoch_and_reshuffles_per_epoch():
    sampler = ShardedSampler(40, rank=1, size=2, batch_size=5, seed=0)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.set_epoch(2, start=3 * 2 * 5)  # after 3 steps of 2 x 5
    assert list(sampler) == whole[15:]
    assert len(sampler) == len(whole) - 15
    sampler.set_epoch(3)
    assert list(sampler) != whole


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4), (3, 1)])
def test_sharded_sampler_goes_on_at_another_size_training_every_sample_at_most_once(before, after):
    """Steps hold a prefix of the epoch's order at any size: a resize goes on after it, the
    rest cut to whole steps at the new size."""
    order = torch.randperm(103, generator=torch.Generator().manual_seed(5 * 100_003 + 1)).tolist()
    first = [ShardedSampler(103, rank, before, batch_size=4, seed=5) for rank in range(before)]
    for sampler in first:
        sampler.set_epoch(1)
    trained = [i for sampler in first for i in list(sampler)[:3 * 4]]  # 3 steps
    assert sorted(trained) == sorted(order[:3 * before * 4])
    second = [ShardedSampler(103, rank, after, batch_size=4, seed=5) for rank in range(after)]
    for sampler in second:
        sampler.set_epoch(1, start=len(trained))
    rest = [i for sampler in second for i in sampler]
    steps = (103 - len(trained)) // (after * 4)
    assert sorted(trained + rest) == sorted(order[:len(trained) + steps * after * 4])


def test_unpadded_validation_counts_every_sample_once():
    shards = [list(UnpaddedShardSampler(11, rank=r, size=3)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(11))


def test_assign_rows_gives_every_row_to_one_rank_in_equal_shares():
    sizes = [9, 9, 8, 0, 9]  # 5 files on 2 ranks: one file is split between them
    for epoch in range(3):
        shares = [assign_rows(sizes, r, 2, seed=1, epoch=epoch) for r in range(2)]
        rows = [(f, row) for share in shares for f, start, stop in share for row in range(start, stop)]
        assert sorted(rows) == [(f, row) for f, n in enumerate(sizes) for row in range(n)]
        assert sorted(sum(stop - start for _, start, stop in share) for share in shares) == [17, 18]
    assert assign_rows(sizes, 0, 2, 1, 0) != assign_rows(sizes, 0, 2, 1, 1)  # reshuffled per epoch


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    for step in (1, 2, 3, 9):
        checkpoint_files.atomic_save({"w": torch.full((2,), float(step))}, checkpoint_files.checkpoint_path(tmp_path, step))
    just_written = checkpoint_files.checkpoint_path(tmp_path, 4)  # after a resume from step 3
    checkpoint_files.atomic_save({"w": torch.zeros(2)}, just_written)
    checkpoint_files.prune(tmp_path, keep=2, just_written=just_written)
    assert [p.name for p in checkpoint_files.checkpoint_paths(tmp_path)] == [checkpoint_name(9), checkpoint_name(4)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp file left behind"


def test_settings_are_frozen_and_the_resume_contract_sorts_every_change():
    from hvdtrain.runtime.settings import Settings, check_resume, resume_differences
    from hvdtrain.errors import UsageError

    @dataclass(frozen=True)
    class Small(Settings):
        lr: float
        epochs: int
        threads: int
        output_dir: str

    settings = Small.build(SimpleNamespace(lr=0.1, epochs=4, threads=2), output_dir=Path("/tmp/out"))
    assert dict(settings)["output_dir"] == "/tmp/out"  # plain values, as a checkpoint holds them
    with pytest.raises(TypeError, match="fields without a value: .'threads'"):
        Small.build(SimpleNamespace(lr=0.1, epochs=4), output_dir="/tmp/out")  # a flag with no field fails early
    with pytest.raises(AttributeError):
        settings.lr = 0.2
    refused, adjusted = resume_differences({"lr": 0.2, "epochs": 2, "threads": 8, "output_dir": "/x"}, settings)
    assert refused == [("lr", 0.2, 0.1)] and adjusted == [("epochs", 2, 4)]
    with pytest.raises(UsageError, match=r"lr 0.2 -> 0.1"):
        check_resume({"lr": 0.2, "epochs": 4}, settings, "out")


def test_a_refused_resize_names_one_rank_in_the_singular():
    """The refusal and the resize line share their wording: once "checkpoint of 1 ranks"."""
    from hvdtrain.runtime.settings import resize_refusal_line
    line = resize_refusal_line(1, 2, "runs/x", "its epoch 0 is in progress")
    assert line == "cannot resume 1 rank's checkpoint in runs/x on 2: its epoch 0 is in progress"
    assert resize_refusal_line(2, 1, "runs/x", "why") == "cannot resume 2 ranks' checkpoint in runs/x on 1: why"


def test_rng_state_survives_a_weights_only_checkpoint(tmp_path):
    rng.seed_everything(5)
    state = rng.get_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    checkpoint_files.atomic_save({"rng": state}, tmp_path / "rng.pt")
    rng.seed_everything(99)
    rng.set_state(checkpoint_files.load(tmp_path / "rng.pt")["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_decay_groups_exempt_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    decay, no_decay = optim.decay_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_lamb_moves_each_layer_by_lr_times_its_norm():
    # With one step and no decay the Adam update is ~sign(grad), and the trust
    # ratio (here on every tensor: NVLAMB) rescales it to ||w||: every tensor
    # moves by lr * ||w||, whatever its scale.
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(10) * 100)
    small = torch.nn.Parameter(torch.randn(10) * 0.01)
    before = [big.detach().clone(), small.detach().clone()]
    opt = optim.LAMB([big, small], lr=0.01, weight_decay=0.0, nvlamb=True)
    (big.sum() * 3 + (small ** 2).sum()).backward()
    opt.step()
    for new, old in zip((big, small), before):
        assert torch.isclose((new.detach() - old).norm(), 0.01 * old.norm(), rtol=1e-3)


def test_lamb_steps_all_tensors_with_a_fixed_number_of_ops():
    """One multi-tensor op per formula, whatever the tensor count: a loop per tensor made
    ~15 kernels each, and on an H200 BERT-large's optimizer step took longer than its
    forward and backward passes (docs/performance.md, "The GPU check")."""
    def ops_per_step(tensors):
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(tensors)]
        for parameter in params:
            parameter.grad = torch.randn(3)
        opt = optim.LAMB([{"params": params, "weight_decay": 0.1}])
        opt.step()  # the moments are created once, a pair per tensor
        with CountedOps() as counted:
            opt.step()
        return counted.device_ops

    assert ops_per_step(40) == ops_per_step(4)


class CountedOps(TorchDispatchMode):
    """The aten ops a block dispatches on non-CPU-scalar tensors (device kernels, roughly)."""

    def __enter__(self):
        self.device_ops = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.dim() > 0 for t in tensors) or func.__name__.startswith("_foreach"):
            self.device_ops += 1
        return func(*args, **(kwargs or {}))


def test_lamb_without_decay_or_trust_ratio_is_torch_adam_over_steps():
    """Weight decay 0 and no NVLAMB: the LAMB step is Adam's, step after step."""
    torch.manual_seed(0)
    start = [torch.randn(5, 3, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    lamb = optim.LAMB([{"params": ours, "weight_decay": 0.0}], lr=0.01, eps=1e-6)
    adam = torch.optim.Adam(theirs, lr=0.01, eps=1e-6, foreach=False)
    for _ in range(5):
        grads = [torch.randn_like(t) for t in start]
        for params, optimizer in ((ours, lamb), (theirs, adam)):
            for parameter, grad in zip(params, grads):
                parameter.grad = grad.clone()
            optimizer.step()
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine.detach(), reference.detach(), rtol=1e-12, atol=1e-12)


def lamb_first_step_by_hand(weights, grads, lr, weight_decay, eps, adapt):
    """One LAMB step from zero moments, written out from the formulas.

    Step 1: m = (1-b1) g and v = (1-b2) g^2, so the bias-corrected m_hat = g and
    v_hat = g^2; update = m_hat / (sqrt(v_hat) + eps) + weight_decay * w; with
    adaptation w -= lr * (||w|| / ||update||) * update, without w -= lr * update.
    """
    update = [g / (abs(g) + eps) + weight_decay * w for w, g in zip(weights, grads)]
    ratio = 1.0
    if adapt:
        ratio = math.sqrt(sum(w * w for w in weights)) / math.sqrt(sum(u * u for u in update))
    return [w - lr * ratio * u for w, u in zip(weights, update)]


@pytest.mark.parametrize("nvlamb", [False, True], ids=["fusedlamb-default", "nvlamb"])
def test_lamb_first_step_matches_the_formulas(nvlamb):
    """Trust ratio for decayed tensors always; for weight_decay-0 groups (biases,
    LayerNorm) only with nvlamb, as apex FusedLAMB(use_nvlamb=...) does."""
    lr, weight_decay, eps = 0.01, 0.1, 1e-6
    weights = {"decayed": [3.0, 4.0], "exempt": [0.6, 0.8]}
    grads = {"decayed": [2.0, -1.0], "exempt": [-3.0, 0.5]}
    params = {name: torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for name, w in weights.items()}
    for name, parameter in params.items():
        parameter.grad = torch.tensor(grads[name], dtype=torch.float64)
    opt = optim.LAMB([{"params": [params["decayed"]], "weight_decay": weight_decay},
                      {"params": [params["exempt"]], "weight_decay": 0.0}],
                     lr=lr, eps=eps, nvlamb=nvlamb)
    opt.step()
    expected = {
        "decayed": lamb_first_step_by_hand(weights["decayed"], grads["decayed"], lr, weight_decay, eps,
                                           adapt=True),
        "exempt": lamb_first_step_by_hand(weights["exempt"], grads["exempt"], lr, 0.0, eps, adapt=nvlamb),
    }
    for name, parameter in params.items():
        assert parameter.tolist() == pytest.approx(expected[name], rel=0, abs=1e-12), name
    # The two modes really differ for the exempt tensor: ||w|| = 1, ||update|| ~ sqrt(2).
    plain = lamb_first_step_by_hand(weights["exempt"], grads["exempt"], lr, 0.0, eps, adapt=False)
    adapted = lamb_first_step_by_hand(weights["exempt"], grads["exempt"], lr, 0.0, eps, adapt=True)
    assert abs(plain[0] - adapted[0]) > 1e-3
    # The state format is unchanged: per tensor a step count and the two moments.
    assert all(set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params.values())
    assert all(set(group) == {"params", "lr", "betas", "eps", "weight_decay"}
               for group in opt.state_dict()["param_groups"])


def test_schedule_warms_up_linearly_then_decays_to_zero():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = optim.warmup_then_decay(opt, warmup_steps=4, total_steps=12, decay="cosine")
    rates = []
    for _ in range(12):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert rates[4] == pytest.approx(1.0) and rates[-1] < 0.05
    assert all(a >= b for a, b in zip(rates[4:], rates[5:]))


def test_cuda_device_is_the_local_rank_when_every_rank_sees_every_gpu():
    # --gpus-per-node=4 --ntasks-per-node=4: each rank sees all 4 (or more) GPUs.
    assert [dist.cuda_device_index(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [dist.cuda_device_index(r, 2, 8) for r in range(2)] == [0, 1]


def test_cuda_device_is_0_when_each_rank_sees_only_its_own_gpu():
    # --gpus-per-task=1 or a per-rank CUDA_VISIBLE_DEVICES: set_device(local_rank)
    # would ask for a device that does not exist on every rank but the first.
    assert [dist.cuda_device_index(r, 4, 1) for r in range(4)] == [0, 0, 0, 0]


def test_ranks_that_each_see_one_gpu_the_same_one_are_refused_in_one_line():
    """Found by the GPU check (2 ranks, 1 H200): each rank saw one GPU, took device 0, and the job
    died in NCCL's first collective as "another rank died, froze or left the job"."""
    own = [("node-a", "boot-1/1", "GPU-aaaa"), ("node-a", "boot-1/1", "GPU-bbbb"), ("node-b", "boot-2/1", "GPU-aaaa")]
    assert dist.shared_gpus(own) is None  # its own GPU each (the same UUID on two nodes is no clash)
    assert dist.shared_gpus([("node-a", "boot-1/1", None)] * 2) is None  # CPU ranks
    same = [("node-a", "boot-1/1", "GPU-aaaa"), ("node-a", "boot-1/1", "GPU-aaaa")]
    message = dist.shared_gpus(same)
    assert message.startswith("node-a: ranks 0-1 would share one GPU, which NCCL refuses") and "\n" not in message


def test_fewer_gpus_than_ranks_on_a_node_is_a_one_line_usage_error():
    with pytest.raises(UsageError) as error:
        dist.cuda_device_index(3, 4, 2)
    message = str(error.value)
    assert "4 ranks share 2 visible GPUs" in message and "\n" not in message, message


def test_sync_batchnorm_conversion_keeps_every_statistic():
    import horovod.torch as hvd
    from hvdtrain.models import resnet

    model = resnet.build("resnet20", 10, 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = dist.to_sync_batchnorm(model)
    kinds = {type(m) for m in converted.modules()}
    assert hvd.SyncBatchNorm in kinds and torch.nn.BatchNorm2d not in kinds
    after = converted.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------- what a run prints
def test_resume_command_drops_the_flags_that_would_not_resume():
    argv = ["scripts/train_cnn.py", "--output-dir", "runs/my run", "--no-resume", "--stop-after", "3",
            "--max-steps=4", "--epochs", "2"]
    assert cli.resume_command(argv) == "scripts/train_cnn.py --output-dir 'runs/my run' --epochs 2"


def test_progress_report_every_interval_with_rate_and_time_left():
    now = [100.0]
    report = runlog.ProgressReport(total_steps=400, start_step=100, interval=30, clock=lambda: now[0])
    now[0] = 110.0
    assert report.line(120) is None  # within the interval
    now[0] = 150.0
    assert report.line(200) == "progress: step 200/400 (50%), 2 steps/s, about 1 min 40 s left"
    now[0] = 160.0
    assert report.line(220) is None  # 10 s after the last line
    assert runlog.ProgressReport(10, 0, 0, clock=lambda: now[0]).line(5) is None  # 0: no lines


def test_progress_interval_and_durations():
    assert runlog.progress_interval({}) == 30.0
    assert runlog.progress_interval({"HVDTRAIN_PROGRESS_SECONDS": "0"}) == 0.0
    with pytest.raises(UsageError, match="HVDTRAIN_PROGRESS_SECONDS='soon'"):
        runlog.progress_interval({"HVDTRAIN_PROGRESS_SECONDS": "soon"})
    assert [runlog.duration(s) for s in (42, 185, 7620)] == ["42 s", "3 min 05 s", "2 h 07 min"]


def test_a_rate_that_was_not_timed_says_so():
    assert metrics.rate_text(863.24, "images") == "863.2 images/s"
    assert metrics.rate_text(0.0, "images") == "images/s: too few steps to time"


def test_the_option_lists_name_the_models_that_exist():
    """options.py names the models for the early parse; the model code builds them."""
    from hvdtrain import options
    from hvdtrain.bench import options as bench_options
    from hvdtrain.models import bert, resnet
    assert sorted(options.CNN_MODELS) == sorted(resnet.MODELS)
    assert sorted(bench_options.CNN_MODELS) == sorted(resnet.MODELS)
    assert bert.PRESETS is options.BERT_PRESETS


class _Recorder:
    """What a CheckpointManager asked of its parts, in order: hooks, commits, checkpoint files."""

    def __init__(self, commit_every):
        self.did, self.commit_every = [], commit_every
        self.host_updates = SimpleNamespace()  # the commit's part of the save: no hooks here

    def parts(self):  # the checkpointer's components: one, with save hooks
        return [SimpleNamespace(before_save=lambda: self.did.append("hooks"), after_save=lambda: None)]

    def write(self, step, settings, is_best=False):
        self.did.append(f"checkpoint {step}" + (" best" if is_best else ""))

    def wait_for_writes(self):
        self.did.append("on disk")

    def due(self, step):
        return step % self.commit_every == 0

    def commit_step(self, step):
        self.did.append("commit")

    def check_host_updates(self):
        self.did.append("hosts?")


@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
def test_the_checkpoint_manager_saves_at_its_cadence_and_commits_only_while_the_run_goes_on(elastic):
    """One call after every step (CheckpointManager.after_step): checkpoints every --checkpoint-every
    steps, at an epoch's end, the schedule's end and a stop; --elastic commits every
    --elastic-commit-every steps and at an epoch's end, the save hooks once for both, the copy before
    the file, the host check after it. No commit at a stop or at the schedule's end: its host check
    may reset the world, and the reset world would find the run finished and never write its results.
    A stop and the schedule's end wait for the checkpoint's background write."""
    from hvdtrain.runtime.cadence import CheckpointManager
    recorder, state = _Recorder(commit_every=2), SimpleNamespace(step=0)
    manager = CheckpointManager(recorder, SimpleNamespace(checkpoint_every=3), state,
                                commits=recorder if elastic else None)
    steps = {1: {}, 2: {}, 3: {}, 4: {"epoch_end": True, "is_best": True}, 5: {"stopping": True},
             6: {"last": True, "epoch_end": True}}
    done = []
    for step, kind in steps.items():
        state.step, recorder.did = step, []
        manager.after_step(**kind)
        done.append(recorder.did)
    if elastic:
        assert done == [[], ["hooks", "commit", "hosts?"], ["hooks", "checkpoint 3"],
                        ["hooks", "commit", "checkpoint 4 best", "hosts?"], ["hooks", "checkpoint 5", "on disk"],
                        ["hooks", "checkpoint 6", "on disk"]]
    else:
        assert done == [[], [], ["hooks", "checkpoint 3"], ["hooks", "checkpoint 4 best"],
                        ["hooks", "checkpoint 5", "on disk"], ["hooks", "checkpoint 6", "on disk"]]


def test_a_commits_copy_of_the_state_is_whole_and_apart_from_training():
    """elastic.Commits copies the run's state with checkpoint_writer.copy_state, not copy.deepcopy:
    every tensor its own, the module's ``_metadata`` kept (BatchNorm's version), anything else copied."""
    import copy
    from hvdtrain.runtime.checkpoint_writer import copy_state
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng.get_state(),
             "steps": [1, (2, "three")]}
    copied = copy_state(state)
    assert copied["model"]._metadata == state["model"]._metadata
    assert _pytree.tree_structure(copied) == _pytree.tree_structure(copy.deepcopy(state))
    assert torch.equal(copied["rng"]["torch"], state["rng"]["torch"]) and copied["rng"]["python"] == state["rng"]["python"]
    assert copied["steps"] == [1, (2, "three")]
    before = copy.deepcopy(state)
    with torch.no_grad():
        for tensor in [*model.state_dict().values(), *optimizer.state_dict()["state"][0].values()]:
            tensor.add_(1)
    assert all(torch.equal(copied["model"][name], before["model"][name]) for name in before["model"])
    assert torch.equal(copied["optimizer"]["state"][0]["momentum_buffer"],
                       before["optimizer"]["state"][0]["momentum_buffer"])
    model.load_state_dict(copied["model"])
    assert all(torch.equal(model.state_dict()[name], before["model"][name]) for name in before["model"])


def test_the_background_writer_keeps_one_write_in_flight_and_reports_its_failure_once(capsys):
    from hvdtrain.runtime.checkpoint_writer import BackgroundWriter
    writer, order = BackgroundWriter(), []
    writer.start(lambda: order.append("first"), "step-1.pt")
    writer.wait()  # the next write starts only once the first is done
    writer.start(lambda: order.append("second"), "step-2.pt")
    writer.wait()
    assert order == ["first", "second"]

    def full_disk():
        raise OSError(28, "No space left on device")
    writer.start(full_disk, "step-3.pt")
    with pytest.raises(UsageError, match=r"writing the checkpoint step-3.pt failed \(OSError: \[Errno 28\] No space "
                                         r"left on device\); the previous checkpoint is the newest valid one"):
        writer.wait()
    writer.wait()  # said once
    writer.start(full_disk, "step-4.pt")
    writer.finish()  # an --elastic reset: said as a warning, nothing raised
    assert "warning: writing the checkpoint step-4.pt failed" in capsys.readouterr().out


def test_checkpoints_of_the_earlier_layout_read_as_todays():
    """Until 2026-11 --elastic and --global-batch saved the CNN's position apart ("elastic_position":
    its samples, its metric totals) and BERT's as "bert_position"; older CNN checkpoints had no
    epoch_samples. Each trainer's upgrade reads them in today's layout (a resume goes on from them:
    an old --global-batch checkpoint resumed to the end equals an uninterrupted run, bit for bit)."""
    from hvdtrain.training import bert, cnn
    totals = {"train_loss": [3.5, 64.0], "train_top1": [20.0, 64.0]}
    elastic = cnn.upgrade_checkpoint({"train_state": {"step_in_epoch": 2, "epoch_samples": 0},
                                      "elastic_position": {"samples": 64, "totals": totals},
                                      "settings": {"world_size": "elastic"}})
    assert "elastic_position" not in elastic and elastic["train_state"]["epoch_samples"] == 64
    assert elastic["epoch_sums"] == {"totals": totals}
    plain = cnn.upgrade_checkpoint({"train_state": {"step_in_epoch": 3, "epoch_samples": 96}, "settings": {}})
    assert plain["train_state"]["epoch_samples"] == 96 and plain["epoch_sums"] == {"totals": {}}
    oldest = cnn.upgrade_checkpoint({"train_state": {"step_in_epoch": 3}, "settings": {
        "world_size": 2, "batch_size": 16, "accumulation_steps": 2}})
    assert oldest["train_state"]["epoch_samples"] == 3 * 2 * 16 * 2  # its steps were all of its own size
    position = {"epoch": 0, "steps": 5, "taken": [80]}
    assert bert.upgrade_checkpoint({"bert_position": position}) == {"position": position}


STEPS_OF_FREED_MEMORY = """
import resource, sys, numpy as np
from hvdtrain.runtime import host_memory
kept = host_memory.keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(8 << 20, np.uint8) for _ in range(10)]  # a step's activations: 80 MB in blocks of 8 MB
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, *faults)
"""


def test_a_steps_freed_host_memory_is_taken_again_without_page_faults():
    """runtime/host_memory.py, as dist.setup calls it: steps after the first fault no page in
    again (glibc's own thresholds gave 80 MB back to the kernel after each); a user's MALLOC_*
    setting is left alone."""
    runs = {how: ok(python(["-c", STEPS_OF_FREED_MEMORY, how], timeout=60)).output.split()
            for how in ("plain", "keep")}
    pages = (80 << 20) // 4096
    assert runs["keep"][0] == "True" and max(map(int, runs["keep"][2:])) < pages // 20
    assert min(map(int, runs["plain"][2:])) > pages // 10  # what is avoided (about 5,000 faults a step here)
    users = ok(python(["-c", STEPS_OF_FREED_MEMORY, "keep"], timeout=60, env={"MALLOC_TRIM_THRESHOLD_": "100000"}))
    assert users.output.split()[0] == "False"
