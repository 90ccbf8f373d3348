#!/usr/bin/env python
"""Data-parallel image classification with Horovod: ResNets on digits, CIFAR-10,
an image folder (ImageNet layout) or synthetic data.

    horovodrun -np 2 python scripts/train_cnn.py                     # digits, resnet20
    horovodrun -np 8 -H a:4,b:4 python scripts/train_cnn.py --dataset imagefolder \\
        --data /data/imagenet --model resnet50 --epochs 90 --warmup-epochs 5 --lr 0.0125

Every rank trains on its own shard of each epoch; Horovod averages the gradients,
so N workers with batch b train like one worker with batch N*b. Checkpoints hold
everything needed to continue at the exact next batch (see --resume).
"""
import argparse
import itertools
import time

from hvdtrain import cli, options


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    flag = argparse.BooleanOptionalAction
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", default="digits",
                      choices=["digits", "cifar10", "imagefolder", "synthetic"],
                      help="digits: scikit-learn's embedded 8x8 digits (no download); cifar10: "
                           "the python batches directory; imagefolder: train/<class>/*, val/<class>/*")
    data.add_argument("--data", help="data directory (cifar10, imagefolder)")
    data.add_argument("--image-size", type=cli.positive_int,
                      help="input resolution (default: digits 16, cifar10/synthetic 32, imagefolder 224)")
    data.add_argument("--workers", type=cli.non_negative_int,
                      help="DataLoader processes per rank (default: 4 for imagefolder, else 0)")
    data.add_argument("--verify-images", action=flag, default=True,
                      help="decode every image file before training (each rank checks its share)")
    data.add_argument("--synthetic-samples", type=cli.positive_int, default=4096, help="synthetic epoch size")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="resnet20", choices=options.CNN_MODELS,
                       help="resnet20/56: CIFAR-style; resnet18/50: ImageNet-style; convnet: no BatchNorm")
    model.add_argument("--sync-bn", action="store_true",
                       help="Horovod SyncBatchNorm: statistics over the global batch (CUDA only); without it "
                            "the ranks' BatchNorm statistics are averaged before evaluation and checkpoints")
    train = parser.add_argument_group("optimisation (defaults suit the digits data set)")
    train.add_argument("--epochs", type=cli.positive_int, default=8, help="length of the LR schedule")
    train.add_argument("--batch-size", type=cli.positive_int, default=16, help="per worker and backward pass")
    train.add_argument("--lr", type=cli.positive_float, default=0.1,
                       help="base LR per worker batch; used LR = lr x workers x accumulation steps")
    train.add_argument("--warmup-epochs", type=float, default=1.0, help="linear warmup (Goyal et al. 2017)")
    train.add_argument("--lr-decay", default="cosine", choices=["cosine", "step"], help="after the warmup")
    train.add_argument("--lr-milestones", type=float, nargs="+", default=[30, 60, 80],
                       help="epochs at which --lr-decay step multiplies the LR by --lr-gamma")
    train.add_argument("--lr-gamma", type=float, default=0.1, help="step decay factor")
    train.add_argument("--momentum", type=cli.fraction, default=0.9, help="SGD momentum")
    train.add_argument("--nesterov", action=flag, default=True, help="Nesterov momentum")
    train.add_argument("--weight-decay", type=float, default=5e-4, help="not on BatchNorm and bias parameters")
    train.add_argument("--label-smoothing", type=cli.fraction, default=0.0, help="of the training loss")
    horovod = options.add_run_arguments(parser, output_dir="runs/cnn", checkpoint_every=0)
    horovod.add_argument("--use-adasum", action="store_true",
                         help="combine updates with Adasum instead of averaging gradients (needs MPI)")
    horovod.add_argument("--gradient-predivide-factor", type=cli.positive_float, default=1.0,
                         help="divide gradients by this before the sum and by size/factor after")
    options.add_precision_arguments(horovod, cuda_auto="fp16 (with a GradScaler)", amp_alias=True)
    horovod.add_argument("--channels-last", action=flag, help="NHWC layout (default: on with CUDA)")
    horovod.add_argument("--balance", action="store_true",
                         help="split each step's global batch among the ranks by their measured speed, "
                              "re-split every --straggler-interval steps (heterogeneous workers)")
    options.add_elastic_arguments(horovod, commit_every=20)
    horovod.add_argument("--global-batch", type=cli.positive_int, metavar="N",
                         help="N samples per step at every world size (each rank's batch is N / workers): the "
                              "LR and the optimisation do not change when the run resumes on another number of "
                              "workers or an --elastic job resizes; default: --batch-size x workers, the LR "
                              "scaled with them")
    return parser.parse_args(argv)

if __name__ == "__main__":
    # --help and a bad argument answer here, before torch and Horovod load: a tenth of a
    # second instead of two, on every rank. main() parses again (the same result).
    cli.run_main(parse_args)

# The training's imports, after the early parse above.
import torch
import horovod.torch as hvd

from hvdtrain.data import images
from hvdtrain.errors import UsageError
from hvdtrain.runtime import collectives, consistency, dist, elastic, horovod_profile, precision, rng, signals
from hvdtrain.runtime.checkpoint import Checkpointer
from hvdtrain.runtime.metrics import SumMeter, rate_text, total_throughput
from hvdtrain.runtime.run import Run
from hvdtrain.training import balance, batchnorm, cnn
from hvdtrain.training.cnn import CnnSettings


def load_data(args, ctx, workers):
    """(train set, val set, classes, channels); run under agree_on_errors."""
    with ctx.watchdog.phase("scanning and verifying the images"):
        data = images.load(args.dataset, args.data, args.image_size, args.seed, args.synthetic_samples,
                           verify_share=(ctx.rank, ctx.size) if args.verify_images else None,
                           on_file=ctx.watchdog.beat)
    train_set = data[0]
    shard = len(train_set) // ctx.size
    if shard == 0:
        raise UsageError(f"more workers than training samples: {ctx.size} workers, "
                         f"{len(train_set)} samples")
    if not args.global_batch and shard < args.batch_size * args.accumulation_steps:
        raise UsageError(f"not enough training samples: {len(train_set)} samples over {ctx.size} workers "
                         f"leave {shard} per worker, fewer than one batch of "
                         f"{args.batch_size * args.accumulation_steps}")
    if workers > shard:
        raise UsageError(f"--workers {workers}: more DataLoader workers than the {shard} "
                         f"training samples each rank loads")
    return data


def main():
    args = parse_args()
    dist.exit_quietly_on_interrupt()
    stop_request = signals.StopRequest()
    dist.request_diagnostics(args.horovod_timeline, args.horovod_autotune, args.horovod_autotune_log)
    profile = horovod_profile.apply(args)  # Horovod's variables from benchmark.py tune, before hvd.init()
    # Horovod: hvd.init(), this rank's device, the node's cores shared by its ranks
    ctx = dist.init(use_cuda=not args.cpu, threads=args.threads, elastic=args.elastic)
    if profile:
        ctx.print0(profile)
    # Horovod: a check that fails on one rank stops every rank with the same one line
    agree = lambda check, *a: elastic.agree_before_start(args.elastic, check, *a)  # noqa: E731
    resolved = agree(cnn.check_args, args, ctx)
    rng.seed_everything(args.seed)
    train_set, val_set, num_classes, channels = agree(load_data, args, ctx, resolved["workers"])
    # Horovod: the global batch grows with the workers, so does the LR (cnn.used_lr)
    settings = CnnSettings.build(args, **resolved, world_size="elastic" if args.elastic else ctx.size,
                                 scaled_lr=cnn.used_lr(args, ctx), train_samples=len(train_set),
                                 num_classes=num_classes)
    if not settings.elastic:  # a worker joining an elastic job may make no collective before its sync
        # Horovod: the same job on every rank (settings and data), or one line naming the difference
        consistency.check_ranks_agree(settings, cnn.data_facts(settings, train_set, val_set))

    model = cnn.build_model(settings, ctx, num_classes, channels)
    # Horovod: gradients are averaged by allreduce during backward, every `accumulation_steps`
    # backward passes (or combined by Adasum; with --balance or --global-batch ranks hold
    # unequal shares: summed, each loss a share of the global batch, see Trainer.loss_scale);
    # fp16 compression on request.
    summed = settings.balance or bool(settings.global_batch)
    optimizer = hvd.DistributedOptimizer(
        cnn.build_optimizer(settings, model), named_parameters=model.named_parameters(),
        compression=dist.gradient_compression(settings.fp16_allreduce),
        backward_passes_per_step=settings.accumulation_steps,
        op=hvd.Adasum if settings.use_adasum else hvd.Sum if summed else hvd.Average,
        gradient_predivide_factor=settings.gradient_predivide_factor)
    # --elastic, --global-batch: the LR schedule counts samples, whose number per epoch no world size changes.
    steps_per_epoch = cnn.steps_per_epoch(settings, ctx.size, len(train_set))
    scheduler = cnn.build_schedule(settings, optimizer, len(train_set) if settings.global_position else steps_per_epoch)
    trainer = cnn.Trainer(model, optimizer, scheduler, precision.scaler(settings.precision, ctx.device),
                          torch.nn.CrossEntropyLoss(label_smoothing=settings.label_smoothing), ctx.device,
                          settings.precision, settings.channels_last, settings.accumulation_steps, settings.use_adasum,
                          sum_over=ctx.size * settings.step_batch if settings.balance else settings.global_batch)

    meter = SumMeter("train_loss", "train_top1")
    state, components = cnn.CnnState(), trainer.components()
    # --elastic, --global-batch: the epoch's position in samples; folds the meter's sums at every save
    position = elastic.ElasticPosition(meter) if settings.global_position else None
    if position is not None:
        components["elastic_position"] = position
    shares = balance.Shares(ctx.size, settings.step_batch, settings.accumulation_steps) if settings.balance else None
    if shares is not None:
        components["balance"] = shares
    # What a checkpoint holds: the same on every rank, then each rank's own (its RNG, its metric
    # sums, its BatchNorm statistics: their average is what the model holds).
    checkpointer = Checkpointer(ctx, settings.output_dir, keep=settings.keep_checkpoints,
                                write_mode=settings.checkpoint_write,
                                shared={**components, "train_state": state},
                                per_rank={"rng": rng.RngState(settings.seed), "meter": meter,
                                          "batchnorm": batchnorm.RankStatistics(trainer.model)})
    run = Run(ctx, settings, state, checkpointer, settings.epochs * steps_per_epoch, stop_request)
    # Horovod: every rank restores the checkpoint (or train() broadcasts rank 0's weights); under
    # --elastic inside hvd.elastic.run, which syncs rank 0's state and calls train() again after a reset.
    run.launch(lambda: train(run, trainer, (train_set, val_set), meter, position, shares))


def train(run, trainer, datasets, meter, position=None, shares=None):
    """The epochs left, in the current world; --elastic enters again after every reset."""
    settings, state, ctx = run.settings, run.state, run.ctx
    if run.take_fresh_start():
        # Horovod: every rank starts from rank 0's initial weights (the optimizer state is still empty)
        collectives.broadcast_parameters(trainer.model.state_dict(), root_rank=0)
    if state.epoch >= settings.epochs:
        return run.already_finished()
    if run.stop_after_already_reached():
        return
    train_set, val_set = datasets
    cnn.resume_position(state, settings, run.resized_from or ctx.size)  # a checkpoint from before epoch_samples
    sampler, train_loader, val_loader = cnn.make_loaders(settings, ctx, train_set, val_set, shares)
    global_batch = cnn.global_batch(settings, ctx.size)
    steps_per_epoch = cnn.steps_per_epoch(settings, ctx.size, len(train_set))  # at this world size
    samples = position.samples if position else state.epoch_samples  # the epoch's, trained
    if run.resized_from or position is not None:  # the steps left at this world size
        left = cnn.steps_per_epoch(settings, ctx.size, len(train_set) - samples)
        run.retarget(state.step + left + (settings.epochs - state.epoch - 1) * steps_per_epoch)
    if run.resized_from and position is None:  # the LR schedule counts steps: those of this size
        steps = state.epoch * steps_per_epoch + samples // global_batch
        elastic.set_schedule_at(trainer.scheduler, steps, cnn.used_lr(settings, ctx))
    where = f"epoch {state.epoch} sample {samples}"
    run.log.info(f"{settings.model} on {settings.dataset}: {len(train_set)} train / {len(val_set)} val images, "
                 f"{settings.num_classes} classes; {ctx.size} worker{'s' if ctx.size > 1 else ''} x batch "
                 f"{global_batch // ctx.size} = global batch {global_batch}; lr {cnn.used_lr(settings, ctx):g}; "
                 f"{steps_per_epoch} steps/epoch; device {ctx.device.type}, "
                 f"{precision.describe(settings.precision, ctx.device.type)}"
                 + (f"; resuming at {where} (step {state.step})" if state.step else ""))
    started = time.perf_counter()
    while state.epoch < settings.epochs:
        if state.step_in_epoch == 0:
            run.throughput.start_window()
        reason = train_epoch(run, trainer, (train_set, sampler, train_loader, val_loader), meter, position, shares)
        if reason:
            return run.stop(reason, cnn.results(run, time.perf_counter() - started))
    path = run.write_results({**cnn.results(run, time.perf_counter() - started), "completed": True})
    row = state.last_row
    run.log.info(f"val_top1 {row['val_top1']:.4f} val_top5 {row['val_top5']:.4f} "
                 f"{rate_text(run.rates()[0], 'images')}; results in {path}")


def train_epoch(run, trainer, data, meter, position=None, shares=None):
    """Train the rest of the current epoch, evaluate at its end; returns why this launch must stop, or None.

    The epoch goes on from its sample position at the current world size (a prefix of its
    order is trained, sampling.ShardedSampler). --elastic, --global-batch (``position``): the
    steps and the LR follow the samples trained. --balance (``shares``): returns early when the
    shares change; the epoch goes on from the next step with the new split.
    """
    settings, state = run.settings, run.state
    train_set, sampler, loader, val_loader = data
    train_set.set_epoch(state.epoch)  # the augmentation key; workers copy it at iter()
    sampler.set_epoch(state.epoch, position.samples if position else state.epoch_samples)
    global_batch, steps_left = cnn.global_batch(settings, run.ctx.size), sampler.steps_left
    if not steps_left:
        # The world grew just before the epoch's end: what is left is less than one step.
        # Horovod: the epoch's end as after its last step (end_epoch's allreduces, then after_step's)
        is_best = end_epoch(run, trainer, val_loader, meter, position)
        run.checkpoints.after_step(epoch_end=True, is_best=is_best, last=state.epoch == settings.epochs)
        return None
    with run.ctx.watchdog.phase("starting the data loader"):  # worker processes import torch
        batches = iter(loader)
    step_bounds = sampler.steps if position else itertools.repeat(None)  # position: (start, stop) samples
    peak_lr = cnn.used_lr(settings, run.ctx)  # for the current world size
    timer = run.stragglers.timer  # this rank's time in data, compute, comm, optimizer
    for taken, (bounds, batch) in enumerate(zip(step_bounds, timer.timed(batches, "data")), start=1):
        if position:
            elastic.set_schedule_at(trainer.scheduler, state.epoch * len(train_set) + position.samples, peak_lr)
        # Horovod: the gradient allreduce (started in backward, awaited in optim.finish_step),
        # then the ranks' NaN/Inf vote, one allreduce (NonFiniteGuard.skip_step)
        samples = trainer.train_step(batch, meter, run.nonfinite, timer)
        if position:
            position.samples = bounds[1]
        else:
            state.epoch_samples += global_batch
        # Horovod: every --stop-check-every steps the stop-signal allgather, every
        # --straggler-interval steps the timings' allgather (Run.step_done)
        reason = run.step_done(samples)
        rebalanced = run.rebalance(shares, "samples")  # --balance: new shares, saved below
        epoch_end = taken == steps_left
        # Horovod: at the epoch's end, the rates', metrics' and BatchNorm statistics' allreduces (end_epoch)
        is_best = end_epoch(run, trainer, val_loader, meter, position) if epoch_end else False
        # Horovod: when one is due, the checkpoint's collectives and --elastic's commit
        # (CheckpointManager.after_step lists them): every --checkpoint-every and
        # --elastic-commit-every steps, at the epoch's end, before a stop
        run.checkpoints.after_step(epoch_end=epoch_end, is_best=is_best, stopping=reason is not None,
                                   last=state.epoch == settings.epochs)
        if reason or epoch_end or rebalanced:  # rebalanced: a new split, so a new sampler
            return reason
    return None


def end_epoch(run, trainer, val_loader, meter, position=None):
    """Evaluate and append the epoch's row; True when it is the best so far (best.pt)."""
    state = run.state
    total_rate, per_worker = total_throughput(run.throughput.window_rate())  # Horovod: allreduce of the rates
    # Horovod: grouped_allreduce of the BatchNorm statistics: what is evaluated is what is saved
    batchnorm.average_statistics(trainer.model)
    # Horovod: metrics are allreduced sums and counts, exact over every rank's samples
    train_metrics = meter.reduce("train") if position is None else position.epoch_metrics(run.ctx.size)
    with run.ctx.watchdog.phase("evaluating"):  # a long validation set is no hang
        evaluation = trainer.evaluate(val_loader)  # Horovod: allreduce of the validation sums
    row = {"epoch": state.epoch + 1, "step": state.step, "lr": trainer.last_lr, **train_metrics,
           **evaluation, "images_per_sec": total_rate,
           "images_per_sec_per_worker": per_worker,
           "epoch_seconds": run.throughput.window_all[1]}
    meter.reset()
    state.next_epoch()
    if position is not None:
        position.next_epoch()
    is_best = row["val_top1"] > state.best_top1
    state.best_top1, state.last_row = max(state.best_top1, row["val_top1"]), row
    run.log.record(row, state.step)  # before the checkpoint: a crash in between repeats the row once
    run.log.info(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return is_best


if __name__ == "__main__":
    cli.run_main(main)
