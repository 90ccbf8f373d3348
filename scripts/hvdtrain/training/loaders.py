"""DataLoaders for the trainers' samplers: worker processes that leave stop signals to the rank."""
from torch.utils.data import DataLoader

from hvdtrain.runtime import signals


def make_loader(dataset, sampler, batch_size, workers, pin_memory):
    extra = {}
    if workers > 0:
        # Horovod: forkserver workers that leave SIGTERM/SIGUSR1 to the rank.
        extra = signals.worker_loader_options()
    if batch_size is None:  # the sampler yields whole batches (ElasticBatchSampler)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory, **extra)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=pin_memory, drop_last=False, **extra)
