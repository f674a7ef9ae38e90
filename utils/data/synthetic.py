"""Synthetic batches: random tensors made on the device, for GPU-bound benchmarks."""
import torch

SYNTHETIC_STEPS = 100
SYNTHETIC_VAL_STEPS = 10
SYNTHETIC_CLASSES = 1000

class SyntheticBatches:
    """Random normalised images and labels made once on the device and replayed (GPU-bound runs)."""

    def __init__(self, steps, batch_size, image_size, num_classes, device, channels_last, seed):
        generator = torch.Generator(device=device).manual_seed(seed)
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.images = torch.randn(batch_size, 3, image_size, image_size, device=device,
                                  generator=generator).contiguous(memory_format=memory_format)
        self.targets = torch.randint(0, num_classes, (batch_size,), device=device, generator=generator)
        self.steps = steps

    def set_epoch(self, epoch):
        pass

    def __len__(self):
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.images, self.targets
