"""The gpu backend's worker side: ByteSamples reads a file, sniffs its JPEG header and returns the
bytes with the crop box utils/data/crops.py draws for (seed, epoch, index); files nvJPEG cannot
take (PNG inside .JPEG, CMYK, grayscale, progressive, truncated, ...) are decoded there by PIL
instead. pack_bytes collates a batch into one uint8 buffer + offsets (five tensors through the
worker queue, not 256)."""
from typing import NamedTuple

import numpy as np
import torch

from utils.data.image_files import GPU, jpeg_header, pil_rgb, read_file
from utils.run.errors import UnreadableInput


class ByteSamples(torch.utils.data.Dataset):
    """(where, label) samples -> (payload, label, box, index, height, width, raw, size) for pack_bytes.

    key is (index, epoch) or (index, epoch, repeat) as the train samplers yield it, or a bare index
    (epoch 0, validation). boxes is utils.data.crops.TrainBoxes or CenterBoxes (the box, and the
    epoch's output size); read(where) -> bytes (default: a file path;
    a Hugging Face source passes its own). payload is the file's bytes when the header routes it
    to nvJPEG (raw False), else PIL's RGB pixels flattened (raw True).
    """

    def __init__(self, samples, boxes, read=read_file):
        self.samples, self.boxes, self.read = samples, boxes, read

    def __len__(self):
        return len(self.samples)

    def name(self, index):
        return str(self.samples[index][0])

    def __getitem__(self, key):
        index, epoch, repeat = (*key, 0)[:3] if isinstance(key, tuple) else (key, 0, 0)
        where, label = self.samples[index]
        try:
            data = self.read(where)
        except OSError as err:
            raise UnreadableInput(f"cannot read image {str(where)!r} ({err}); remove or replace that file") from None
        route, width, height = jpeg_header(data)
        if route == GPU:
            payload, raw = np.frombuffer(data, dtype=np.uint8), False
        else:
            pixels = pil_rgb(data, where)
            (height, width), payload, raw = pixels.shape[:2], pixels.reshape(-1), True
        return (payload, label, self.boxes(width, height, epoch, index, repeat), index, height, width, raw,
                self.boxes.size(epoch))


class Packed(NamedTuple):
    """One batch as the workers hand it over: every payload in one buffer."""
    buffer: torch.Tensor   # uint8 (total,): the payloads back to back
    offsets: torch.Tensor  # int64 (n+1,): payload i is buffer[offsets[i]:offsets[i+1]]
    shapes: torch.Tensor   # int64 (n, 2): image height, width
    raw: torch.Tensor      # bool (n,): payload is HWC RGB pixels (PIL-decoded), not JPEG bytes
    boxes: torch.Tensor    # float64 (n, 5): top, left, height, width, flip (source pixels)
    labels: torch.Tensor   # int64 (n,)
    indices: torch.Tensor  # int64 (n,): dataset indices, to name a file in an error
    size: int              # the side the boxes are resized to (one epoch's batch: one size)

    def __reduce__(self):
        # Between processes only the buffer goes through shared memory; the small fields travel
        # inside the pickle. Each shared tensor costs the receiver (the decode thread) a socket
        # connection to the worker to fetch its file descriptor: receiving a batch of 64 took
        # 6.2 ms with seven of them and 3.4 ms with one (2-core box; on the H200 the change was
        # within the noise of train.py's throughput).
        return _unpickle_packed, (self.buffer, *(field.numpy() for field in self[1:-1]), self.size)


def _unpickle_packed(buffer, *small):
    return Packed(buffer, *(torch.from_numpy(field) for field in small[:-1]), small[-1])


def _empty_buffer(size):
    """A uint8 tensor; inside a loader worker in shared memory already, as default_collate does,
    so the queue does not copy the batch's bytes a second time."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(size, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(size)
    return torch.empty(0, dtype=torch.uint8).new(storage)


def pack_bytes(batch):
    """collate_fn for ByteSamples: a list of samples -> Packed."""
    payloads = [sample[0] for sample in batch]
    sizes = {sample[7] for sample in batch}
    if len(sizes) != 1:  # a sampler yields one epoch's keys a batch, and the size is the epoch's
        raise ValueError(f"a batch of samples for output sizes {sorted(sizes)}; one batch has one size")
    offsets = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum([len(payload) for payload in payloads], out=offsets[1:])
    buffer = _empty_buffer(int(offsets[-1]))
    if len(buffer):
        np.concatenate(payloads, out=buffer.numpy())
    return Packed(buffer, torch.from_numpy(offsets),
                  torch.tensor([(sample[4], sample[5]) for sample in batch], dtype=torch.int64),
                  torch.tensor([sample[6] for sample in batch], dtype=torch.bool),
                  torch.tensor([sample[2] for sample in batch], dtype=torch.float64),
                  torch.tensor([sample[1] for sample in batch], dtype=torch.int64),
                  torch.tensor([sample[3] for sample in batch], dtype=torch.int64), sizes.pop())


def unpack(buffer, offsets):
    """The payloads of a Packed buffer as uint8 tensors (views of the buffer, no copy)."""
    # One split call makes every view; slicing in a loop cost a host call per image while the
    # training loop waited for the GIL.
    return list(buffer[int(offsets[0]):int(offsets[-1])].split(offsets.diff().tolist()))
