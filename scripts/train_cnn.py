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
import time

import torch
import horovod.torch as hvd

from hvdtrain import cli, options, usercode
from hvdtrain.data import custom, images
from hvdtrain.durations import SectionTimer
from hvdtrain.errors import UsageError
from hvdtrain.runtime import collectives, consistency, dist, elastic, nonfinite, precision, rng
from hvdtrain.runtime.checkpoint import Checkpointer
from hvdtrain.runtime.metrics import EpochSums, SumMeter, Throughput, rate_text
from hvdtrain.runtime.run import Run
from hvdtrain.training import balance, batchnorm, cnn, epochs
from hvdtrain.training.cnn import CnnSettings
from hvdtrain.training.epochs import EpochPlan


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    flag = argparse.BooleanOptionalAction
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", default="digits", type=options.preset_or_code(options.CNN_DATASETS),
                      help="digits: scikit-learn's embedded 8x8 digits (no download); cifar10: "
                           "the python batches directory; imagefolder: train/<class>/*, val/<class>/*; "
                           "synthetic; or your own: MODULE:CALLABLE (or path/to/file.py:CALLABLE) whose "
                           "CALLABLE(data_dir) returns (train set, val set, number of classes), see docs/adapting.md")
    data.add_argument("--data", help="data directory (cifar10, imagefolder)")
    data.add_argument("--dataset-arg", type=cli.key_value, action="append", default=[], metavar="KEY=VALUE",
                      help="a keyword argument for your own --dataset's CALLABLE (repeat; VALUE a Python literal "
                           "or text); recorded in the checkpoint's settings")
    data.add_argument("--image-size", type=cli.positive_int,
                      help="input resolution (default: digits 16, cifar10/synthetic 32, imagefolder 224)")
    data.add_argument("--workers", type=cli.non_negative_int,
                      help="DataLoader processes per rank (default: 4 for imagefolder, else 0)")
    data.add_argument("--verify-images", action=flag, default=True,
                      help="decode every image file before training (each rank checks its share)")
    data.add_argument("--synthetic-samples", type=cli.positive_int, default=4096, help="synthetic epoch size")
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="resnet20", type=options.preset_or_code(options.CNN_MODELS),
                       help="resnet20/56: CIFAR-style; resnet18/50: ImageNet-style; convnet: no BatchNorm; or "
                            "your own: MODULE:CALLABLE (or path/to/file.py:CALLABLE) whose CALLABLE(num_classes, "
                            "in_channels) returns a torch.nn.Module, see docs/adapting.md")
    model.add_argument("--model-arg", type=cli.key_value, action="append", default=[], metavar="KEY=VALUE",
                       help="a keyword argument for your own --model's CALLABLE (repeat; VALUE a Python literal "
                            "or text, e.g. --model-arg width=64); recorded in the checkpoint's settings")
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
    horovod.add_argument("--channels-last", action=flag, help="NHWC layout for image inputs (default: on with CUDA)")
    horovod.add_argument("--balance", action="store_true",
                         help="split each step's global batch among the ranks by their measured speed, "
                              "re-split every --straggler-interval steps (heterogeneous workers)")
    options.add_elastic_arguments(horovod, commit_every=20)
    horovod.add_argument("--global-batch", type=cli.positive_int, metavar="N",
                         help="N samples per step at every world size (each rank's batch is N / workers): the "
                              "LR and the optimisation do not change when the run resumes on another number of "
                              "workers or an --elastic job resizes; default: --batch-size x workers, the LR "
                              "scaled with them")
    args = parser.parse_args(argv)
    args.model_arg = cli.keyword_arguments(parser, "--model-arg", args.model_arg, args.model)
    args.dataset_arg = cli.keyword_arguments(parser, "--dataset-arg", args.dataset_arg, args.dataset)
    return args


def load_data(args, ctx, workers):
    """(train set, val set, classes, channels); run under collectives.agree_on_errors."""
    with ctx.watchdog.phase("scanning and verifying the images"):
        if usercode.is_spec(args.dataset):  # your own: its random draws keyed per sample (data/custom.py)
            data = custom.load(args.dataset, args.data, args.seed, args.dataset_arg)
            if workers:  # a data set that cannot reach them: one line now, not a dead worker later
                custom.check_workers_receive(data[0], args.dataset, workers)
        else:
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
    startup = dist.before_init(args)  # quiet Ctrl-C, SIGTERM/SIGUSR1 a stop request, the variables hvd.init() reads
    # Horovod: initialize Horovod
    hvd.init()
    # Horovod: this rank's GPU (one per process), its share of the node's cores, its watchdog and heartbeat
    ctx = dist.after_init(startup)
    # Horovod: a check that fails on one rank stops every rank with the same one line (--elastic: each
    # rank checks alone, since a worker joining a running job may make no collective before its sync)
    agree = collectives.agreement(alone=args.elastic)
    resolved = agree(cnn.check_args, args, ctx)
    rng.seed_everything(args.seed)
    train_set, val_set, num_classes, channels = agree(load_data, args, ctx, resolved["workers"])
    settings = CnnSettings.build(args, **resolved, world_size="elastic" if args.elastic else ctx.size,
                                 train_samples=len(train_set), num_classes=num_classes)
    model = agree(cnn.build_model, settings, ctx, num_classes, channels, train_set)
    if not settings.elastic:
        # Horovod: the same job on every rank (settings, data and model), or one line naming the difference
        consistency.check_ranks_agree(settings, cnn.data_facts(settings, train_set, val_set, model))
    note = cnn.resume_note(settings, train_set)  # your own data set: does exact resume hold?
    if note:
        ctx.print0(note)
    batching = cnn.batching(settings, ctx)  # Horovod: the global batch grows with the workers, so does the LR
    # Horovod: gradients are averaged by allreduce during backward, every `accumulation_steps`
    # backward passes (or combined by Adasum; with --balance or --global-batch ranks hold
    # unequal shares: summed, each loss a share of the global batch, see Trainer.loss_scale);
    # fp16 compression on request.
    summed = settings.balance or bool(settings.global_batch)
    optimizer = hvd.DistributedOptimizer(
        cnn.build_optimizer(settings, model, batching.lr), named_parameters=model.named_parameters(),
        compression=dist.gradient_compression(settings.fp16_allreduce),
        backward_passes_per_step=settings.accumulation_steps,
        op=hvd.Adasum if settings.use_adasum else hvd.Sum if summed else hvd.Average,
        gradient_predivide_factor=settings.gradient_predivide_factor)
    dist.fixed_gradient_buckets(optimizer)  # Horovod: fused the same way every step, bit-for-bit results
    scheduler = cnn.build_schedule(settings, optimizer, epochs.schedule_length(settings, batching, len(train_set)))
    state = cnn.CnnState()
    trainer = cnn.Trainer.of(
        settings, model, optimizer, scheduler, torch.nn.CrossEntropyLoss(label_smoothing=settings.label_smoothing),
        ctx.device, guard=nonfinite.NonFiniteGuard.from_settings(settings, ctx.rank, state, say=ctx.print0),
        timer=SectionTimer(),  # this rank's time in data, compute, comm and optimizer: the straggler report's
        sum_over=batching.global_batch if summed else None)

    # The epoch's training sums over every rank (--elastic, --global-batch: folded in at every save).
    sums = EpochSums(SumMeter("train_loss", "train_top1"), folded=settings.global_position)
    shares = balance.Shares(ctx.size, settings.step_batch, settings.accumulation_steps) if settings.balance else None
    # What a checkpoint holds: the same on every rank, then each rank's own (its RNG, its metric
    # sums, its BatchNorm statistics: their average is what the model holds).
    checkpointer = Checkpointer(
        ctx, settings.output_dir, keep=settings.keep_checkpoints, write_mode=settings.checkpoint_write,
        shared={"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": trainer.scaler,
                "epoch_sums": sums, **({"balance": shares} if shares else {}), "train_state": state},
        per_rank={"rng": rng.RngState(settings.seed), "meter": sums.meter, "batchnorm": batchnorm.RankStatistics(model)},
        upgrade=cnn.upgrade_checkpoint)
    # Horovod: the run's elastic state, an hvd.elastic.State over the checkpoint's components: under
    # --elastic committed in memory, restored after a lost worker and synced from rank 0 in a new world
    commits = elastic.Commits(checkpointer, ctx, settings.elastic_commit_every, enabled=settings.elastic)
    run = Run(ctx, settings, state, checkpointer, commits, trainer.timer, shares)
    # Horovod: under --elastic, hvd.elastic.run calls train() again after every reset
    train_in_world = hvd.elastic.run(train) if settings.elastic else train
    train_in_world(commits, run, trainer, sums, (train_set, val_set))


def train(commits, run, trainer, sums, datasets):
    """The epochs left, in this world. ``commits``: hvd.elastic.run's state (run.save commits it);
    ``run``: the settings, this rank's context, the train state and the run's life (runtime/run.py)."""
    settings, ctx, state = run.settings, run.ctx, run.state
    if run.begin() == "fresh":  # this world; once per job the newest checkpoint restored, if there is one
        # Horovod: every rank starts from rank 0's initial weights (the optimizer's state is still empty)
        collectives.broadcast_parameters(trainer.model.state_dict(), root_rank=0)
    if run.nothing_to_train(finished=state.epoch >= settings.epochs):
        return
    batching = cnn.batching(settings, ctx)  # at this world size: the global batch, the LR
    train_set, val_set = datasets
    plan = EpochPlan(settings, batching, ctx.rank, state, train_set, val_set, run.shares, ctx.device.type == "cuda")
    run.retarget(plan.total_steps)
    run.log.info(f"{cnn.with_arguments(settings.model, settings.model_arg)} on "
                 f"{cnn.with_arguments(settings.dataset, settings.dataset_arg)}: {len(train_set)} train / {len(val_set)} val images, "
                 f"{settings.num_classes} classes; {ctx.size} worker{'s' if ctx.size > 1 else ''} x batch "
                 f"{batching.rank_batch} = global batch {batching.global_batch}; lr {batching.lr:g}; "
                 f"{plan.steps_per_epoch} steps/epoch; device {ctx.device.type}, "
                 f"{precision.description(settings.precision, ctx.device.type)}"
                 + (f"; resuming at epoch {state.epoch} sample {state.epoch_samples} (step {state.step})"
                    if state.step else ""))
    images = Throughput()  # this launch's images/s over every epoch, and the epoch's (its first steps left out)
    started = time.perf_counter()
    while state.epoch < settings.epochs:
        plan.start_epoch()  # from the epoch's sample position, at this world size
        if state.step_in_epoch == 0:
            images.start_window()
        with ctx.watchdog.phase("starting the data loader"):  # worker processes import torch
            batches = iter(plan.train_loader)
        reason = None
        for batch in trainer.timer.timed(batches, "data"):
            plan.set_learning_rate(trainer.scheduler)  # warmup, then decay: where the samples trained put it
            # Horovod: forward and backward; the gradients' allreduce starts during the last backward pass
            samples = trainer.forward_backward(batch, sums.meter)
            # Horovod: wait for the averaged gradients, the ranks' NaN/Inf vote (an allreduce), step
            trainer.step()
            plan.advance()
            images.step(samples)
            # Horovod: every --stop-check-every steps the stop vote (an allreduce), every
            # --straggler-interval steps the timings' allgather
            reason = run.step_done()
            if reason or plan.epoch_done or plan.must_restart:  # must_restart: --balance's new shares
                break
            run.save()  # Horovod: a checkpoint's collectives and --elastic's commit, when one is due
        epoch_end = plan.epoch_done  # its last step trained (or none was left: the world grew just before)
        is_best = False
        if epoch_end:
            # Horovod: the rates', BatchNorm statistics', train and validation sums' allreduces
            row, is_best = end_epoch(trainer, plan.val_loader, sums, state, ctx, images.window_rates(ctx.size))
            run.log.record(row, state.step)  # before the checkpoint: a crash in between repeats the row once
            run.log.info(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        # Horovod: a checkpoint's collectives and --elastic's commit, when one is due (every epoch's end,
        # a stop, the schedule's end: Run.save)
        run.save(epoch_end=epoch_end, is_best=is_best, last=state.epoch == settings.epochs, stopping=reason is not None)
        if reason:
            # Horovod: this launch's images/s over every rank, an allreduce
            rates = images.launch_rates(ctx.size)
            return run.stop(reason, cnn.results(state, settings, batching, rates, time.perf_counter() - started))
    rates = images.launch_rates(ctx.size)  # Horovod: this launch's images/s over every rank, an allreduce
    path = run.finish(cnn.results(state, settings, batching, rates, time.perf_counter() - started))
    row = state.last_row
    run.log.info(f"val_top1 {row['val_top1']:.4f} val_top5 {row['val_top5']:.4f} "
                 f"{rate_text(rates[0], 'images')}; results in {path}")


def end_epoch(trainer, val_loader, sums, state, ctx, rates):
    """Evaluate the model the checkpoint saves; (the epoch's row, whether it is the best so far: best.pt).

    ``rates``: the epoch's images/s over every rank, per rank, and its seconds (Throughput.window_rates).
    """
    # Horovod: grouped_allreduce of the BatchNorm statistics: what is evaluated is what is saved
    batchnorm.average_statistics(trainer.model)
    # Horovod: metrics are allreduced sums and counts, exact over every rank's samples
    train_metrics = sums.epoch_metrics(ctx.size)
    with ctx.watchdog.phase("evaluating"):  # a long validation set is no hang
        evaluation = trainer.evaluate(val_loader)  # Horovod: allreduce of the validation sums
    total_rate, per_worker, seconds = rates
    row = {"epoch": state.epoch + 1, "step": state.step, "lr": trainer.last_lr, **train_metrics, **evaluation,
           "images_per_sec": total_rate, "images_per_sec_per_worker": per_worker, "epoch_seconds": seconds}
    sums.next_epoch()
    state.next_epoch()
    is_best = row["val_top1"] > state.best_top1
    state.best_top1, state.last_row = max(state.best_top1, row["val_top1"]), row
    return row, is_best


if __name__ == "__main__":
    cli.run_main(main)
