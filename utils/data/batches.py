"""The batch path every image source shares, after the dataset pair: seeded samples, the sharded
sampler, uint8 collate, the device prefetcher, the gpu backend's assembly, and the Data bundle the
scripts iterate.

Batches leave the workers as uint8 NHWC tensors (no ToTensor, no float on the CPU); the
prefetcher moves them to the device on a side stream and converts and normalises them there.
Augmentation is a pure function of (seed, epoch, sample index), so runs repeat exactly and a
resumed run sees the same crops as an uninterrupted one, whatever the worker or process count.
The sources (utils/data/folder.py, utils/data/hf.py) make map-style datasets of (PIL image or
tensor, label) and utils.data.sources.build_data hands them to sharded_data(); this module imports
none of them, and the gpu backend's modules (utils/data/gpu/) import nothing from here.
"""
import contextlib
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from utils.ingredients import augment_transform
from utils.run.errors import UsageError, WorkerLost
from utils.run.preemption import ignore_stop_signals_in_worker, lost_workers_named, quiet_worker_deaths

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class SeededSamples(torch.utils.data.Dataset):
    """Applies the dataset's keyed train crop (train_transform) with the sample's (seed, epoch,
    index, repeat), after seeding torch's RNG from the same key for any further random transform.
    The key is (index, epoch) or, from the repeated-augmentation sampler, (index, epoch, repeat)."""

    def __init__(self, dataset, seed, extra=None):
        self.dataset = dataset
        self.seed = seed
        self.crop = dataset.transform  # a CpuTrainCrop: it needs the key, so the dataset must not call it
        dataset.transform = None
        self.extra = extra  # --aa: a PIL policy after the crop and flip (utils.ingredients.augment_transform)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        if torch.utils.data.get_worker_info() is not None:
            return self._sample(key)
        # -j 0: the sample is made in the training process, whose global generators the step
        # seeded from (seed, epoch, step, rank) for random erasing, mixup and dropout on the CPU.
        # Left reseeded by the last sample they made those draws depend on the worker count.
        with kept_global_rngs():
            return self._sample(key)

    def _sample(self, key):
        index, epoch, repeat = (*key, 0)[:3]
        # The CPU generator only: the transforms here draw from nothing else, and torch.manual_seed
        # (which also visits every accelerator backend) costs 0.3 ms a sample, as much as a resize.
        seed = (self.seed * 1_000_003 + epoch) * 10_000_019 + index
        torch.default_generator.manual_seed((seed * 7 + repeat if repeat else seed) % (2 ** 63))
        image, label = self.dataset[index]
        image = self.crop(image, self.seed, epoch, index, repeat)  # a uint8 HWC tensor
        if self.extra is not None:  # the policies take PIL images
            image = self.extra(Image.fromarray(image.numpy()))
        return image, label


@contextlib.contextmanager
def kept_global_rngs():
    """torch's CPU generator, Python's and NumPy's as they were before the block."""
    states = torch.default_generator.get_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


class ShardedEpochSampler(torch.utils.data.Sampler):
    """One shuffled pass per epoch, shared by all ranks and split without duplicates.

    The permutation comes from (seed, epoch); it is cut to a whole number of global batches
    (drop_last, as for training) and rank r takes every world-th sample. Yields (index, epoch)
    so SeededSamples can seed the augmentation in whichever worker process serves it.
    set_epoch(epoch, first_step) starts the pass at that step (a resumed mid-epoch checkpoint):
    rank r's samples of global step s are positions [s x global batch, (s+1) x global batch) of
    the permutation whatever the process count, so skipping first_step x batch_size of them
    continues the same pass. len() stays the whole epoch's.
    """

    def __init__(self, size, batch_size, rank, world, seed):
        self.size, self.rank, self.world, self.seed = size, rank, world, seed
        self.global_batch = batch_size * world
        self.batch_size = batch_size
        self.epoch = 0
        self.skip = 0
        if size < self.global_batch:
            raise UsageError(f"the train split has {size} images, fewer than one global batch of "
                             f"{self.global_batch} ({batch_size} per process x {world}); lower "
                             "--batch-size")

    def set_epoch(self, epoch, first_step=0):
        self.epoch = epoch
        self.skip = first_step * self.batch_size

    def __len__(self):
        return (self.size // self.global_batch) * self.global_batch // self.world

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator)
        usable = (self.size // self.global_batch) * self.global_batch
        for index in order[:usable][self.rank::self.world][self.skip:].tolist():
            yield index, self.epoch


class RepeatedAugmentationSampler(ShardedEpochSampler):
    """Repeated augmentation (torchvision's RASampler, --ra-reps N): the epoch's shuffle with each
    image written N times in a row, dealt to the ranks in turn, so with N or more processes an
    image's copies land on different ranks, in the same step; each copy has its own crop (the
    key's repeat number). Each rank keeps as many samples as ShardedEpochSampler gives it, so an
    epoch is as long as without repeats and holds about 1/N of the images, N times each. Yields
    (index, epoch, repeat); set_epoch and mid-epoch resume work as for ShardedEpochSampler."""

    def __init__(self, size, batch_size, rank, world, seed, reps):
        super().__init__(size, batch_size, rank, world, seed)
        self.reps = reps

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator)
        repeated = order.repeat_interleave(self.reps)
        positions = torch.arange(len(repeated))[self.rank::self.world][:len(self)][self.skip:]
        for index, repeat in zip(repeated[positions].tolist(), (positions % self.reps).tolist()):
            yield index, self.epoch, repeat


def fast_collate(batch):
    """Stack images (PIL, or uint8 HWC tensors from CpuTrainCrop) into one uint8 NHWC tensor; labels
    into int64. Each image is copied once, straight into the batch (np.stack would copy it twice)."""
    first = np.asarray(batch[0][0], dtype=np.uint8)
    images = torch.empty((len(batch), *first.shape), dtype=torch.uint8)
    pixels = images.numpy()
    pixels[0] = first
    for k, (image, _) in enumerate(batch[1:], start=1):
        pixels[k] = np.asarray(image, dtype=np.uint8)  # a size or mode that differs fails here, named by numpy
    targets = torch.tensor([target for _, target in batch], dtype=torch.int64)
    return images, targets


class DevicePrefetcher:
    """Iterates a uint8 NHWC loader and yields normalised float NCHW batches on the device.

    On CUDA the copy and normalisation of batch i+1 run on a side stream while batch i trains;
    record_stream tells the caching allocator the main stream still uses the tensors.
    """

    def __init__(self, loader, device, mean, std, channels_last):
        self.loader = loader
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = torch.tensor([m * 255 for m in mean], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor([s * 255 for s in std], device=device).view(1, 3, 1, 1)
        self.cuda = device.type == "cuda"

    def __len__(self):
        return len(self.loader)

    def _to_device(self, images, targets):
        images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        images = images.permute(0, 3, 1, 2).float().contiguous(memory_format=self.memory_format)
        images = images.sub_(self.mean).div_(self.std)
        return images, targets

    def __iter__(self):
        # iter(loader) now, not at the first batch: a DataLoader's workers start on it, so
        # starting an epoch (Data.start_epoch) starts its decoding
        return self._batches(lost_workers_named(self.loader))  # a dead worker: WorkerLost, the loop stops on

    def _batches(self, loader):
        if not self.cuda:
            for images, targets in loader:
                yield self._to_device(images, targets)
            return
        stream = torch.cuda.Stream()
        pending = None
        for images, targets in loader:
            with torch.cuda.stream(stream):
                batch = self._to_device(images, targets)
            if pending is not None:
                yield pending
            torch.cuda.current_stream().wait_stream(stream)
            for tensor in batch:
                tensor.record_stream(torch.cuda.current_stream())
            pending = batch
        if pending is not None:
            yield pending


@dataclass
class Data:
    train: object          # iterable of (images, targets) on the device; has set_epoch
    val: object
    num_classes: int
    val_size: int          # images in the whole val split (all ranks together)
    train_sampler: object = None
    classes: list = None   # class names in label order, where the source has them (eval.py checks them)
    _val_started: object = None  # validation's batches, started by start_epoch before the train threads
    _val_forked: bool = False

    def set_epoch(self, epoch, first_step=0):
        if self.train_sampler is not None:
            self.train_sampler.set_epoch(epoch, first_step)

    def start_epoch(self, epoch):
        """The epoch's training batches from its first step, their loading already under way
        (loader workers and the gpu backend's decode threads start here, not at the first batch
        taken). close() them if they go unused.

        The first time, validation's batches are started before them: the val loader forks its
        workers on its first iteration, and forking while the gpu backend's decode threads run
        CUDA work hung the process (an H100, nvJPEG threads of the next epoch, --compile-mode
        reduce-overhead: the fork never returned). Later iterations reuse those workers
        (persistent), so nothing forks beside the threads again."""
        if not self._val_forked:
            self._val_forked = True
            self._val_started = iter(self.val)
        self.set_epoch(epoch)
        try:
            return iter(self.train)
        except WorkerLost as lost:  # died since its last batch: met at the epoch's first step instead,
            return _raising(lost)   # after this epoch's validation and checkpoint (train.py's order)

    def val_batches(self):
        """An iterator over validation's batches: the one start_epoch started, else a new one."""
        started, self._val_started = self._val_started, None
        return started if started is not None else iter(self.val)


def _raising(err):
    """An iterator whose first next() raises err."""
    raise err
    yield


def batch_loader(dataset, sampler, batch_size, workers, device, collate_fn=fast_collate, pin_memory=True):
    """The DataLoader both backends read through: persistent workers that ignore stop signals,
    whose death reaches the loop at a batch (WorkerLost), not mid-save (quiet_worker_deaths)."""
    if workers > 0:
        quiet_worker_deaths()
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
        collate_fn=collate_fn, pin_memory=pin_memory and device.type == "cuda", drop_last=False,
        persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None,
        worker_init_fn=ignore_stop_signals_in_worker if workers > 0 else None)  # the main process stops


def sharded_data(train_set, val_set, num_classes, spec, accelerator):
    """Data over map-style datasets of (PIL image, label), shared by every image source.

    spec: the utils.data.sources.DataSpec (batch size, workers, seed, crops, normalisation, layout,
    backend). Training: one seeded shuffle per epoch split over the processes
    (ShardedEpochSampler). Validation: rank r takes every world-th image, no padding, so every
    image counts once. train_set None (evaluation only) builds the val loader alone.
    """
    device = accelerator.device
    rank, world = accelerator.process_index, accelerator.num_processes
    val_indices = list(range(rank, len(val_set), world))
    sampler = None
    if train_set is not None and spec.ra_reps > 1:
        sampler = RepeatedAugmentationSampler(len(train_set), spec.batch_size, rank, world, spec.seed, spec.ra_reps)
    elif train_set is not None:
        sampler = ShardedEpochSampler(len(train_set), spec.batch_size, rank, world, spec.seed)
    aa = spec.aa if train_set is not None else "none"
    if spec.backend == "gpu":
        if aa not in (None, "", "none"):
            raise UsageError(f"--aa {aa}: the gpu data backend decodes and crops on the GPU and has no PIL "
                             "stage for augmentation policies; use --data-backend cpu (or auto, which picks it "
                             "for --aa)")
        train, val = gpu_backend(train_set, val_set, sampler, val_indices, spec, device)
    else:
        mean, std = spec.mean, spec.std
        load = lambda dataset, order: batch_loader(dataset, order, spec.batch_size, spec.workers, device)
        val = DevicePrefetcher(load(val_set, val_indices), device, mean, std, spec.channels_last)
        train = None
        if train_set is not None:
            extra = augment_transform(aa, spec.sizes.max_res, mean, spec.interpolation or "bilinear")
            train = DevicePrefetcher(load(SeededSamples(train_set, spec.seed, extra), sampler),
                                     device, mean, std, spec.channels_last)
    return Data(train, val, num_classes, len(val_set), sampler, getattr(val_set, "classes", None))


def gpu_backend(train_set, val_set, sampler, val_indices, spec, device):
    """--data-backend gpu over ImageFolder-style datasets (a .samples list of (path, label)):
    workers read bytes and draw the same boxes as the cpu backend; the main process decodes
    (utils/data/gpu/pipeline.py). The same sampler and val split, so sharding is unchanged."""
    from utils.data.crops import CenterBoxes, TrainBoxes
    from utils.data.gpu.packing import ByteSamples, pack_bytes
    from utils.data.gpu.pipeline import GpuBatchDecoder, GpuBatches

    def batches(dataset, boxes, order, train):
        samples = ByteSamples(dataset.samples, boxes)
        decoder = GpuBatchDecoder(device, spec.mean, spec.std, spec.channels_last,
                                  name_of=samples.name, interpolation=spec.interpolation, train=train,
                                  jpeg_decoder=spec.jpeg_decoder)
        # No pinning: nvJPEG reads the bytes from host memory itself; pinning would only copy them.
        loader = batch_loader(samples, order, spec.batch_size, spec.workers, device, collate_fn=pack_bytes,
                              pin_memory=False)
        return GpuBatches(loader, decoder)

    val = batches(val_set, CenterBoxes(*spec.val_geometry), val_indices, train=False)
    train = None
    if train_set is not None:
        train = batches(train_set, TrainBoxes(spec.seed, spec.min_scale, spec.hflip, spec.sizes), sampler, train=True)
    return train, val
