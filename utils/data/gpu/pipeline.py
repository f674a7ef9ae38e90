"""The gpu backend's main-process side: GpuBatchDecoder turns a Packed batch into normalised float
NCHW images and int64 targets on the device; GpuBatches iterates a loader through it (the
prefetcher contract: len() and (images, targets) batches), its two halves in WorkAhead threads
ahead of the training loop. The boxes come from the workers (utils/data/gpu/packing.py), the
pixels from the decoders (decoders.py) and the resampling (resample.py). Everything runs on CPU tensors as well
(torchvision's CPU decode_jpeg in place of nvJPEG), which is how the tests cover it without a GPU."""
import queue
import threading

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from utils.data.gpu.decoders import HardwareJpeg
from utils.data.gpu.packing import unpack
from utils.data.gpu.resample import CANVAS_BUDGET, _canvas_kernel, resample_batch, resample_chunks, to_device
from utils.data.image_files import pil_rgb
from utils.run.preemption import lost_workers_named


class GpuBatchDecoder:
    """Packed batch -> (images float (n, 3, S, S) normalised, channels_last if asked; targets int64),
    S the batch's own size (Packed.size: the epoch's, under progressive resizing).

    device cuda: nvJPEG (torchvision.io.decode_jpeg on a list) for the JPEG payloads, fp16
    resampling matmuls; device cpu: the same with torchvision's CPU decoder and fp32 (the tests).
    name_of(index) names a dataset file in errors; cpu_fallback(bytes, name) -> HWC uint8 decodes
    a file nvJPEG refused although its header looked fine. train selects where the resampling
    kernels stop: at the crop box (train: crop, then resize) or at the image edge (val: resize,
    then centre crop; give it utils.data.crops.CenterBoxes boxes).
    """

    def __init__(self, device, mean, std, channels_last=False, cpu_fallback=pil_rgb,
                 name_of=str, interpolation="bilinear", train=True, jpeg_decoder="cuda"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.train, self.interpolation = train, interpolation
        self.cpu_fallback, self.name_of = cpu_fallback, name_of
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # fp16 holds 0..255 exactly and halves the canvas traffic; the CPU has no fast fp16 matmul.
        self.dtype = torch.float16 if self.cuda else torch.float32
        self.mean = torch.tensor([m * 255 for m in mean], device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor([s * 255 for s in std], device=self.device).view(1, 3, 1, 1)
        # High priority: the decode path's few small kernels are then not queued behind a whole
        # training step's, so the next batch is ready when the step ends.
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        # JPEG decode has a stream of its own, so a batch's decode and the previous batch's
        # resampling can run from two threads at once (GpuBatches).
        self.decode_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.hardware = HardwareJpeg(self.device) if self.cuda and jpeg_decoder == "hardware" else None
        self.in_use = []  # the pictures the resampling stream may still be reading (resample)
        self.canvas_budget = CANVAS_BUDGET  # pixels one chunk's canvas may hold (_chunks)

    def __call__(self, packed):
        return self.resample(*self.decode_stage(packed))

    def decode_stage(self, packed):
        """First half: the batch's pictures decoded on the decode stream. Returns (packed,
        pictures, ready): ready is an event after the decode (None on the CPU)."""
        if not self.cuda:
            return packed, self.decode(packed), None
        # Stream ordering, pytorch/vision#9606: decode_jpeg(device="cuda") allocates its outputs
        # on the current stream, then lets nvJPEG write them from a private stream that does not
        # wait for that stream, so a block freed there while queued kernels still read it can be
        # overwritten. We therefore decode on a stream of our own and synchronise it first (the
        # only work queued on it is the previous decode's copies; decode_jpeg blocks the host
        # anyway, so the wait costs nothing); the kernels that read the pictures run on another
        # stream, and the pictures stay referenced until that stream is done with them (resample),
        # so no block they still read is handed out again. The training stream is never
        # host-synchronised.
        with torch.cuda.stream(self.decode_stream):
            self.decode_stream.synchronize()
            pictures = self.decode(packed)
            ready = torch.cuda.Event()
            ready.record(self.decode_stream)
        return packed, pictures, ready

    def resample(self, packed, pictures, ready):
        """Second half: crop, resize, flip, normalise on the resampling stream; returns (images,
        targets), ordered before later work on the stream current at the call (hand_over)."""
        return self.hand_over(self.resample_ahead(packed, pictures, ready))

    def resample_ahead(self, packed, pictures, ready):
        """resample, leaving the order with the consumer's stream to hand_over: (images, targets,
        done), done an event after their kernels (None on the CPU).

        A decode thread works batches ahead of the step. Had it made the consumer's stream wait
        here, that wait would land in the stream's queue wherever the training loop happened to
        be, mid-way through an earlier step, and hold that step's later kernels until this
        batch's resampling had run. hand_over, in the consumer's thread when it takes the batch,
        puts the wait just before the first step that reads it."""
        if not self.cuda:
            return (*self._finish(packed, pictures), None)
        with torch.cuda.stream(self.stream):
            self.stream.synchronize()  # the previous batch's resampling: bounds what is queued
            # The pictures were allocated on the decode stream and are read on this one. Rather than
            # a record_stream per picture (hundreds of host calls a batch, each taking the GIL
            # from the training loop), the batch is kept referenced until the synchronize above,
            # in the next call, has seen its resampling finish.
            self.in_use = pictures
            self.stream.wait_event(ready)
            images, targets = self._finish(packed, pictures)
            done = torch.cuda.Event()
            done.record(self.stream)
        return images, targets, done

    @staticmethod
    def hand_over(staged):
        """(images, targets, done) from resample_ahead -> (images, targets), ordered before later
        work on the calling thread's current stream (the step's), with record_stream keeping our
        allocator from reusing their memory until that stream is done with them."""
        images, targets, done = staged
        if done is not None:
            consumer = torch.cuda.current_stream(images.device)
            consumer.wait_event(done)
            images.record_stream(consumer)
            targets.record_stream(consumer)
        return images, targets

    def _finish(self, packed, pictures):
        kernels = _canvas_kernel() if self.cuda else None
        if kernels is None:
            pixels = resample_batch(pictures, packed.boxes, packed.shapes, packed.size, self.train,
                                    self.interpolation, self.dtype, self.canvas_budget)
            images = pixels.float().contiguous(memory_format=self.memory_format)
            images.sub_(self.mean).div_(self.std)
        else:
            # One pass per chunk rounds, clamps, normalises and writes each image at its place in
            # the batch and layout; the torch ops above take seven passes over the batch (a cat,
            # the reordering, round, clamp, the fp32 channels_last copy, sub, div).
            images = torch.empty(len(pictures), 3, packed.size, packed.size, device=self.device,
                                 memory_format=self.memory_format)
            for group, chunk in resample_chunks(pictures, packed.boxes, packed.shapes, packed.size, self.train,
                                                self.interpolation, self.dtype, self.canvas_budget):
                kernels.normalise_into(images, chunk, to_device(torch.tensor(group), self.device), self.mean,
                                       self.std)
        return images, packed.labels.to(self.device, non_blocking=True)

    def decode(self, packed):
        """The batch's images as uint8 CHW tensors on the device, in batch order."""
        payloads = unpack(packed.buffer, packed.offsets)
        raw, shapes = packed.raw.tolist(), packed.shapes.tolist()
        pictures = [None] * len(payloads)
        jpegs = [i for i, is_raw in enumerate(raw) if not is_raw]
        if jpegs:
            decoded = self._decode_jpegs([payloads[i] for i in jpegs], packed.indices[jpegs].tolist(),
                                         [shapes[i] for i in jpegs])
            for i, picture in zip(jpegs, decoded):
                pictures[i] = picture
        by_pil = [i for i, is_raw in enumerate(raw) if is_raw]  # the workers' PIL pixels
        if by_pil:
            # One copy for all of them: a copy per image from the loader's memory is a host call
            # (and a wait) each.
            parts = [payloads[i] for i in by_pil]
            on_device = torch.cat(parts).to(self.device, non_blocking=True).split([len(part) for part in parts])
            for i, pixels in zip(by_pil, on_device):
                height, width = shapes[i]
                pictures[i] = pixels.view(height, width, 3).permute(2, 0, 1)
        return pictures

    def _decode_jpegs(self, payloads, indices, shapes):
        if self.hardware is None:
            return self._nvjpeg(payloads, indices)
        pictures = self.hardware(payloads, self.decode_stream, shapes)
        refused = [k for k, picture in enumerate(pictures) if picture is None]
        if refused:  # the engines take baseline 4:2:0/4:2:2/4:4:4 files; nvJPEG or PIL the rest
            again = self._nvjpeg([payloads[k] for k in refused], [indices[k] for k in refused])
            for k, picture in zip(refused, again):
                pictures[k] = picture
        return pictures

    def _nvjpeg(self, payloads, indices):
        try:
            return decode_jpeg(payloads, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            # One file the decoder refuses fails the whole batched call: retry one by one, and give
            # the refused ones to the CPU decoder (which raises the UsageError if PIL cannot either).
            return [self._decode_one(payload, index) for payload, index in zip(payloads, indices)]

    def _decode_one(self, payload, index):
        try:
            return decode_jpeg(payload, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            pixels = self.cpu_fallback(payload.numpy().tobytes(), self.name_of(index))
            return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).to(self.device)


class GpuBatches:
    """A loader of Packed batches seen through a GpuBatchDecoder: len() and (images, targets),
    the contract utils.data.batches.DevicePrefetcher offers.

    On CUDA two threads work ahead of the training loop: one decodes (decode_jpeg holds its
    thread until nvJPEG is done, tens of ms a batch, and torchvision lets one decode run at a
    time), the other crops and resizes the batch decoded before, AHEAD batches ahead of the step.
    In the main thread that time would be taken from launching the training step; torch ops
    release the GIL, so the threads overlap. Order on the device is kept by streams: as the
    training loop takes a batch, its current stream (the step's) is made to wait for the event
    after that batch's resampling (GpuBatchDecoder.hand_over, in the loop's thread), so the step
    queued next reads finished pixels and no earlier step waits for them. An error in a thread
    (a corrupt file: UsageError) is raised again in the training loop. threads: 2 as above, 1 for
    one thread doing both halves, 0 for none (all in the caller's); default 2 on CUDA, 0 on the
    CPU.
    """

    AHEAD = 2

    def __init__(self, loader, decoder, threads=None):
        self.loader, self.decoder = loader, decoder
        self.threads = (2 if decoder.cuda else 0) if threads is None else threads

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        # iter(loader) here, in the caller's thread: a DataLoader forks its workers on its first
        # iteration, and that must not happen in a decode thread beside other CUDA work
        # (a dead loader worker: WorkerLost, raised again in the loop's thread if a decode thread met it)
        packed_batches = lost_workers_named(self.loader)
        if self.threads == 0:
            return (self.decoder(packed) for packed in packed_batches)
        decoder = self.decoder
        if self.threads == 1:
            return WorkAhead(packed_batches, lambda packed: decoder.resample_ahead(*decoder.decode_stage(packed)),
                             self.AHEAD, decoder.hand_over)
        decoded = WorkAhead(packed_batches, decoder.decode_stage, 1)
        return WorkAhead(decoded, lambda staged: decoder.resample_ahead(*staged), self.AHEAD, decoder.hand_over)


class WorkAhead:
    """decode(item) for the loader's items, computed in a thread up to depth items ahead, each
    passed through hand_over (if given) in the thread that takes it. The thread starts at
    construction, so creating one starts the work (train.py starts the next epoch's batches
    before validating). close() stops the thread and waits for it; closing a later stage closes
    the stage it reads from."""

    _DONE = object()

    def __init__(self, loader, decode, depth, hand_over=None):
        self._hand_over = hand_over
        self._results = results = queue.Queue(maxsize=depth)
        self._stop = stop = threading.Event()
        done = self._DONE

        def work():  # a closure, not a method: the thread must not keep self alive (__del__)
            try:
                for item in loader:
                    if stop.is_set():
                        return
                    results.put((decode(item), None))
            except BaseException as err:  # handed to the consumer, raised there
                results.put((None, err))
                return
            finally:
                close = getattr(loader, "close", None)
                if close is not None:  # a WorkAhead stage before this one: stop its thread here
                    close()
            results.put((done, None))

        self._thread = threading.Thread(target=work, name="gpu-decode", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._stop.is_set():
            raise StopIteration
        value, err = self._results.get()
        if err is not None:
            self.close()
            raise err
        if value is self._DONE:
            self.close()
            raise StopIteration
        return value if self._hand_over is None else self._hand_over(value)

    def close(self):
        self._stop.set()
        while self._thread.is_alive():  # let the worker see the flag, emptying what it still puts
            try:
                self._results.get(timeout=0.1)
            except queue.Empty:
                pass

    def __del__(self):  # dropped unfinished: let the thread see the flag and end, without waiting here
        self._stop.set()
        try:
            while True:  # room for the put it may be blocked in
                self._results.get_nowait()
        except Exception:  # queue.Empty, or anything at interpreter exit
            pass
