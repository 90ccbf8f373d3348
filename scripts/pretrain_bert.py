#!/usr/bin/env python
"""BERT pretraining (masked LM + next-sentence prediction), data-parallel with Horovod.

    python scripts/prepare_bert_data.py --output-dir data/bert128
    horovodrun -np 2 python scripts/pretrain_bert.py --data data/bert128 --model tiny --output-dir runs/bert

Phase 2 (NVIDIA's recipe: longer sequences, new step counter, phase 1 weights):

    python scripts/prepare_bert_data.py --max-seq-length 512 --vocab data/bert128/tokenizer --output-dir data/bert512
    horovodrun -np 2 python scripts/pretrain_bert.py --data data/bert512 --init-checkpoint runs/bert \\
        --max-seq-length 512 --output-dir runs/bert-phase2

Steps count optimizer updates; one update is --accumulation-steps micro-batches
of --batch-size sequences on every rank (global batch = batch x accumulation x
ranks; --elastic --global-batch N: N at every world size, split among the ranks).
--steps is the whole schedule (warmup + polynomial decay);
--stop-after N ends this run after step N (checkpoint, exit 0) without
changing the schedule, exactly like SIGTERM/SIGUSR1 do. Relaunching with the
same --output-dir resumes at the same step and sample.
"""
from contextlib import nullcontext
from pathlib import Path

import torch
import horovod.torch as hvd

from hvdtrain import cli, options
from hvdtrain.data import bert_data, bert_elastic
from hvdtrain.durations import SectionTimer
from hvdtrain.errors import UsageError
from hvdtrain.models import bert as bert_models  # transformers: loaded only where a model is built (--elastic: before hvd.init())
from hvdtrain.runtime import collectives, consistency, dist, elastic, nonfinite, precision, rng
from hvdtrain.runtime.checkpoint import Checkpointer
from hvdtrain.runtime.metrics import SumMeter, Throughput, rate_text
from hvdtrain.runtime.run import Run, finished_before_start
from hvdtrain.training import balance, bert
from hvdtrain.training.batching import Batching
from hvdtrain.training.bert import BertSettings


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    data = parser.add_argument_group("data")
    data.add_argument("--data", required=True, type=Path, help="shard directory from prepare_bert_data.py")
    data.add_argument("--max-seq-length", type=cli.positive_int,
                      help="expected sequence length; an error when the shards differ (default: the shards')")
    data.add_argument("--no-binning", action="store_true",
                      help="pad every sequence to max_seq_length even when the shards were prepared with "
                           "--bin-size (default: each step draws from one length bin, as NVIDIA LDDL)")
    data.add_argument("--mlm-probability", type=cli.fraction, default=0.15,
                      help="dynamic masking: fraction of tokens to predict")
    model = parser.add_argument_group("model (never downloaded)")
    choice = model.add_mutually_exclusive_group()
    choice.add_argument("--model", help=f"preset: {', '.join(options.BERT_PRESETS)} (default: base, "
                                        "or the --init-checkpoint's configuration)")
    choice.add_argument("--config", type=Path, help="BertConfig JSON file instead of a preset")
    model.add_argument("--init-checkpoint", type=Path,
                       help="start from these weights, with a new step counter: phase 2 from phase 1 (a checkpoint "
                            "or its directory), or continued pretraining from a Hugging Face BERT directory "
                            "(save_pretrained's; prepare the data with --vocab DIR)")
    train = parser.add_argument_group("optimisation")
    train.add_argument("--steps", type=cli.positive_int, default=200, help="optimizer steps in the schedule")
    train.add_argument("--batch-size", type=cli.positive_int, default=16, help="sequences per rank per micro-batch")
    train.add_argument("--optimizer", choices=("lamb", "adamw"), default="lamb",
                       help="LAMB (NVIDIA's BERT recipe, large batches) or AdamW")
    train.add_argument("--lamb-nvlamb", action="store_true",
                       help="NVLAMB: the LAMB trust ratio also for biases and LayerNorm (FusedLAMB use_nvlamb)")
    train.add_argument("--lr", type=cli.positive_float,
                       help="peak learning rate (default: 6e-3 for LAMB as NVIDIA's phase 1, 1e-3 for AdamW)")
    train.add_argument("--warmup-proportion", type=cli.fraction, default=0.1,
                       help="fraction of --steps with a linear LR warmup")
    train.add_argument("--poly-power", type=float, default=0.5, help="decay: lr * (1 - progress) ** power (NVIDIA: 0.5)")
    train.add_argument("--weight-decay", type=float, default=0.01, help="not applied to biases and LayerNorm")
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global norm; 0 turns it off")
    device = options.add_run_arguments(parser, output_dir="runs/bert", checkpoint_every=100)
    options.add_precision_arguments(device, cuda_auto="bf16 where the GPU has it, else fp32")
    device.add_argument("--compile", action="store_true", help="torch.compile the encoder")
    options.add_elastic_arguments(device, commit_every=10)
    device.add_argument("--global-batch", type=cli.positive_int, metavar="N",
                        help="N instances per step at every world size, split among the workers: the "
                             "optimisation does not change when the run resumes on another number of workers or "
                             "an --elastic job resizes, and a resume on another number goes on mid-epoch; "
                             "default: batch x accumulation x workers")
    device.add_argument("--balance", action="store_true",
                        help="split each step's instances among the ranks by their measured speed, re-split "
                             "every --straggler-interval steps (heterogeneous workers)")
    out = parser.add_argument_group("output")
    out.add_argument("--export-dir", type=Path, help="Hugging Face model directory (default: OUTPUT_DIR/model)")
    out.add_argument("--log-every", type=cli.positive_int, default=10,
                     help="steps between log lines and metrics.jsonl rows")
    args = parser.parse_args(argv)
    args.export_dir = args.export_dir or args.output_dir / "model"
    args.lr = args.lr or (6e-3 if args.optimizer == "lamb" else 1e-3)
    if args.lamb_nvlamb and args.optimizer != "lamb":
        parser.error("--lamb-nvlamb only applies to --optimizer lamb")
    if args.balance and (args.elastic or args.global_batch or not args.straggler_interval):
        raise UsageError("--balance needs the ranks' timings (--straggler-interval > 0) and a fixed world and "
                         "global batch: not with --elastic or --global-batch")
    return args


def load_setup(args, ctx):
    """The checks of the data and of --init-checkpoint, run on every rank (collectives.agree_on_errors);
    whether a step fits the data at this size is bert.training_data's.

    Returns (metadata, BertConfig, init-checkpoint state or None).
    """
    metadata = bert_data.read_metadata(args.data)
    length = metadata["max_seq_length"]
    if args.max_seq_length is not None and args.max_seq_length != length:
        raise UsageError(f"the shards in {args.data} have max_seq_length {length}, "
                         f"not --max-seq-length {args.max_seq_length}")
    bert_data.check_tokenizer(args.data, metadata)
    for entry in metadata["shards"][ctx.rank::ctx.size]:  # each rank opens a share of the files
        bert_data.check_shard(args.data, entry, metadata)
    init = None
    if args.init_checkpoint is not None:
        init = bert.load_init(args.init_checkpoint)
        if not {"model", "bert_config", "train_state"} <= set(init):
            raise UsageError(f"--init-checkpoint {args.init_checkpoint} is not a pretrain_bert.py checkpoint")
        bert_data.check_vocabulary(init, metadata, f"--init-checkpoint {args.init_checkpoint}")
    config = model_config(args, metadata, init)
    bert_models.check_sequence_length(config, length)
    return metadata, config, init


def model_config(args, metadata, init):
    vocab_size = metadata["vocab_size"]
    if args.config is not None:
        return bert_models.json_config(args.config, vocab_size)
    if args.model is None and init is not None:
        return bert_models.config_from(init["bert_config"])
    return bert_models.preset_config(args.model or "base", vocab_size)


def autocast_settings(args, ctx):
    """(autocast dtype or None, GradScaler on?); auto: see runtime/precision.py."""
    chosen = precision.resolve(args.precision, ctx.device.type, cuda_auto="bf16")
    return chosen.dtype, chosen.scaler


def load_init_weights(args, model, init):
    try:
        model.load_state_dict(init["model"])
    except RuntimeError as error:
        first = str(error).strip().splitlines()[1:2] or [""]
        raise UsageError(f"--init-checkpoint {args.init_checkpoint} does not fit this model: "
                         f"{first[0].strip()}") from None


def resolved_settings(args, ctx, metadata, config, amp_dtype):
    """Everything that decides what the run computes, frozen (and compared on resume)."""
    architecture = {key: getattr(config, key) for key in bert_models.ARCHITECTURE_KEYS}
    name = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]
    # --elastic: the size changes while the run goes on (and between relaunches); not compared on resume.
    return BertSettings.build(
        args, precision=name, world_size="elastic" if args.elastic else ctx.size, architecture=architecture,
        vocab_sha256=metadata["vocab_sha256"], max_seq_length=metadata["max_seq_length"],
        num_instances=metadata["num_instances"],
        model=args.model or ("base" if args.config is None and args.init_checkpoint is None else None))


def main(argv=None):
    args = parse_args(argv)
    elastic.check_launcher(args.elastic)
    # Quiet Ctrl-C, SIGTERM/SIGUSR1 a stop request, the variables hvd.init() reads; under --elastic
    # transformers imported now (a spare stands by in hvd.init(): the world that takes it waits for what it
    # imports after)
    startup = dist.before_init(args, imports_ahead=[bert_models.import_transformers])
    # Horovod: initialize Horovod
    hvd.init()
    # Horovod: this rank's GPU (one per process), its share of the node's cores, its watchdog and heartbeat
    ctx = dist.after_init(startup)
    # Horovod: a check that fails on one rank stops every rank with the same one line (--elastic: each
    # rank checks alone, since a worker joining a running job may make no collective before its sync)
    agree = collectives.agreement(alone=args.elastic)
    metadata, config, init = agree(load_setup, args, ctx)
    amp_dtype, use_scaler = agree(autocast_settings, args, ctx)
    settings = resolved_settings(args, ctx, metadata, config, amp_dtype)
    if not settings.elastic:
        # Horovod: the same job on every rank (settings and shards), or one line naming the difference
        consistency.check_ranks_agree(settings, {"shards_sha256": consistency.digest(
            f"{entry['file']} {entry['instances']} {entry.get('sha256', '')}" for entry in metadata["shards"])})

    # Horovod: rank 0 finds this run finished in --output-dir (a relaunch): said, no model built
    if finished_before_start(ctx, settings):
        return
    # --elastic, --global-batch and --balance: the epoch's global position (--balance: and the ranks'
    # shares of each step), valid at any world size
    position = bert_elastic.BinPosition() if settings.global_position or settings.balance else None
    shares = (balance.Shares(ctx.size, settings.step_batch, settings.accumulation_steps, unit="instances")
              if settings.balance else None)
    # Horovod: one step at least fits the data at this size, or one line on every rank (train() reads it)
    agree(bert.training_data, settings, metadata, ctx, position, shares)
    rng.seed_everything(settings.seed)  # the same initial weights on every rank
    model, objective = bert.build_model(settings, ctx, config)
    # Horovod: gradients are averaged by allreduce once per update, after the last of its
    # `accumulation_steps` micro-batches; fp16 compression on request. --global-batch: ranks hold
    # unequal slices, each loss is its share of the step's global mean and the allreduce sums them.
    summed = bool(settings.global_batch) or settings.balance  # --balance: unequal shares too
    optimizer = hvd.DistributedOptimizer(
        bert.build_optimizer(settings, model), named_parameters=model.named_parameters(),
        backward_passes_per_step=settings.accumulation_steps, op=hvd.Sum if summed else hvd.Average,
        compression=dist.gradient_compression(settings.fp16_allreduce))
    dist.fixed_gradient_buckets(optimizer)  # Horovod: fused the same way every step, bit-for-bit results
    # Horovod: one small allreduce per step: its masked tokens and sequences over every rank
    counts = bert.step_counts(lambda local: collectives.sum_over_ranks(local, name="bert.step_counts"))
    state = bert.BertState()
    trainer = bert.Trainer.of(
        settings, model, objective, optimizer, bert.build_schedule(settings, optimizer), ctx.device, amp_dtype, use_scaler,
        guard=nonfinite.NonFiniteGuard.from_settings(settings, ctx.rank, state, say=ctx.print0),
        timer=SectionTimer(),  # this rank's time in data, compute, comm and optimizer: the straggler report's
        global_counts=counts if summed else None)
    rng.seed_everything(settings.seed + 1 + ctx.rank)  # own dropout masks per rank (a resume restores them)
    if init is not None:  # phase 2: the weights only; a resume below replaces them
        agree(load_init_weights, args, model, init)

    meter = SumMeter("mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy")
    # What a checkpoint holds: the same on every rank, each rank's own (its RNG, its metric sums),
    # and what --init-checkpoint and the export read (the model's configuration, the vocabulary's hash).
    checkpointer = Checkpointer(
        ctx, settings.output_dir, keep=settings.keep_checkpoints, write_mode=settings.checkpoint_write,
        shared={**trainer.components(), **({"position": position} if position else {}),
                **({"balance": shares} if shares else {}), "train_state": state},
        per_rank={"rng": rng.RngState(settings.seed), "meter": meter},
        extra={"bert_config": model.config.to_dict(), "vocab_sha256": metadata["vocab_sha256"]},
        upgrade=bert.upgrade_checkpoint)
    # Horovod: the run's elastic state, an hvd.elastic.State over the checkpoint's components: under
    # --elastic committed in memory, restored after a lost worker and synced from rank 0 in a new world
    commits = elastic.Commits(checkpointer, ctx, settings.elastic_commit_every, enabled=settings.elastic)
    run = Run(ctx, settings, state, checkpointer, commits, trainer.timer, shares)
    # Horovod: under --elastic, hvd.elastic.run calls train() again after every reset
    train_in_world = hvd.elastic.run(train) if settings.elastic else train
    train_in_world(commits, run, trainer, meter, bert.Inputs(metadata, config, init, position))


def train(commits, run, trainer, meter, inputs):
    """The steps left, in this world. ``commits``: hvd.elastic.run's state (run.save commits it);
    ``run``: the settings, this rank's context, the train state and the run's life (runtime/run.py)."""
    settings, ctx, state = run.settings, run.ctx, run.state
    metadata, config, init, position = inputs
    begun = run.begin()  # this world; once per job the newest checkpoint restored: "fresh", "resumed" or "reset"
    if begun == "fresh":
        # Horovod: every rank starts from rank 0's initial weights (the optimizer's state is still empty)
        collectives.broadcast_parameters(trainer.model.state_dict(), root_rank=0)
    if begun == "resumed":
        ctx.print0(f"resumed from {settings.output_dir} at step {state.step}")
    elif begun == "fresh" and init is not None:
        ctx.print0(f"initialised from {settings.init_checkpoint} ({bert.init_origin(init)})")
    if run.nothing_to_train(finished=state.step >= settings.steps):
        return
    run.retarget(settings.steps)
    batching = Batching.of(settings, ctx.size)  # at this world size: the global batch
    data = bert.training_data(settings, metadata, ctx, position, run.shares)  # this rank's batches in this world
    if settings.elastic and data.resumed_mid_epoch(state.epoch):
        ctx.print0(f"elastic: {data.resumed_mid_epoch(state.epoch)} at {ctx.size} rank(s)")
    run.log.info(f"BERT {config.num_hidden_layers} layers x {config.hidden_size}, vocab {config.vocab_size}, "
                 f"seq {metadata['max_seq_length']}, {metadata['num_instances']} instances, {ctx.size} rank(s), "
                 f"global batch {batching.global_batch}, {settings.optimizer}, "
                 f"{precision.description(settings.precision, ctx.device.type)}")
    sequences, tokens = Throughput(), Throughput()  # this launch's, over every step (its first left out)
    trainer.model.train()
    while state.step < settings.steps:
        if state.step_in_epoch >= data.steps_in_epoch(state.epoch):
            state.next_epoch()
            continue
        if data.epoch != state.epoch:
            with ctx.watchdog.phase("loading this rank's first shard of the epoch"):
                # Horovod: every rank's verdict on its first shard, one allgather_object: a damaged
                # shard on one rank is one line and exit 2 on every rank. Later shards are read (and
                # checked) as the epoch goes, one ahead.
                collectives.agree_on_errors(data.start_epoch, state.epoch, state.step_in_epoch)
        micro_batches = (data.batch(state.step_in_epoch, micro) for micro in range(settings.accumulation_steps))
        first_compiled = settings.compile and not sequences.steps
        with ctx.watchdog.phase("the first compiled step") if first_compiled else nullcontext():
            # Horovod: forward and backward (--global-batch, --balance: first the step's counts, an
            # allreduce); the gradients' allreduce starts after the last micro-batch
            trained = trainer.forward_backward(micro_batches, meter)
            # Horovod: wait for the averaged gradients, the ranks' NaN/Inf vote (an allreduce), step
            trainer.step()
        data.advance(state.step + 1)  # the step's instances join the position
        sequences.step(trained)
        tokens.step(trainer.last_tokens)
        # Horovod: every --stop-check-every steps the stop vote (an allreduce), every
        # --straggler-interval steps the timings' allgather
        reason = run.step_done()
        if state.step == 1 or state.step % settings.log_every == 0 or state.step == settings.steps:
            state.last_row = bert.log_row(state, meter, trainer.last_lr)  # Horovod: allreduce of the sums
            run.log.record(state.last_row, state.step)
            run.log.info(bert.row_line(state.last_row))
            if state.step == 1:
                state.initial_mlm_loss = state.last_row["mlm_loss"]
        # Horovod: a checkpoint's collectives and --elastic's commit, when one is due (every
        # --checkpoint-every and --elastic-commit-every steps, the schedule's end, a stop: Run.save)
        run.save(last=state.step == settings.steps, stopping=reason is not None)
        if reason:
            # Horovod: this launch's sequences/s and tokens/s over every rank, two allreduces
            return run.stop(reason, bert.results(state, settings, batching, sequences, tokens))
    # Horovod: this launch's sequences/s and tokens/s over every rank, two allreduces
    results = bert.results(state, settings, batching, sequences, tokens)
    with ctx.watchdog.phase("exporting the model"):
        if ctx.is_main:
            results["export_dir"] = bert.export(trainer.model, settings, metadata)
            run.log.info(f"exported a Hugging Face model to {settings.export_dir}")
        collectives.barrier("bert.exported")  # Horovod: the other ranks wait here, inside the phase
    run.finish(results)
    run.log.info(f"finished at step {state.step}: {rate_text(results['sequences_per_sec'], 'sequences')}, "
                 f"{rate_text(results['tokens_per_sec'], 'tokens', 0)} on {ctx.size} rank(s)")


if __name__ == "__main__":
    cli.run_main(main)
