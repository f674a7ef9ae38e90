"""The gpu input backend's pieces: shared crop boxes, header routing, byte packing, the batched
decoder (on CPU tensors here; nvJPEG itself in the tests marked gpu)."""
import io
import sys

import numpy as np
import pytest
import torch
from conftest import run_command
from PIL import Image
from torchvision import transforms
from torchvision.transforms import functional as F

from utils.data.crops import CenterBoxes, CpuTrainCrop, TrainBoxes, center_box, train_box, val_resize, val_transform
from utils.data.gpu.packing import ByteSamples, Packed, pack_bytes, unpack
from utils.data.gpu.pipeline import GpuBatchDecoder, GpuBatches
from utils.data.gpu.resample import _canvas, resample_batch
from utils.data.image_files import GPU, jpeg_route, pil_rgb, rgb_loader, rgb_pixels
from utils.run.errors import UsageError

SIZE = 64
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def photo(width=160, height=120, seed=0):
    """Smooth colour waves under fine grain, like a photo: the detail is in the brightness, the
    colour varies slowly (decoders differ most in chroma upsampling, so content whose colour
    changes pixel to pixel would measure that rather than the decoder)."""
    rng = np.random.RandomState(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([128 + 90 * np.sin(xx / (17 + seed)), 128 + 90 * np.cos(yy / 13.0),
                     128 + 60 * np.sin((xx + yy) / 11.0)], -1)
    grain = rng.normal(0, 20, (height, width, 1)) + rng.normal(0, 4, base.shape)
    return Image.fromarray(np.clip(base + grain, 0, 255).astype(np.uint8))


def reference_crop(picture, box, size, train=True, interpolation="bilinear"):
    """One image through torchvision's tensor transforms (antialiased): the per-image path the
    batched resample_batch is checked against. Returns uint8 (3, size, size)."""
    top, left, height, width, flip = box
    mode = transforms.InterpolationMode(interpolation)
    if train:
        out = F.resized_crop(picture, int(top), int(left), int(height), int(width), [size, size],
                             interpolation=mode, antialias=True)
    else:
        full_h, full_w = picture.shape[-2:]
        new_h, new_w = round(full_h * size / height), round(full_w * size / width)
        out = F.resize(picture, [new_h, new_w], interpolation=mode, antialias=True)
        out = F.crop(out, round(top * new_h / full_h), round(left * new_w / full_w), size, size)
    return F.hflip(out) if flip else out


def encode(image, **options):
    buffer = io.BytesIO()
    image.save(buffer, **options)
    return buffer.getvalue()


def odd_files():
    """One file of every kind the header router must tell apart: (name, bytes, expected route)."""
    image = photo()
    baseline = encode(image, format="JPEG", quality=90)
    return [("baseline.JPEG", baseline, GPU),
            ("subsampling444.JPEG", encode(image, format="JPEG", quality=90, subsampling=0), GPU),
            ("grayscale.JPEG", encode(image.convert("L"), format="JPEG"), "grayscale"),
            ("cmyk.JPEG", encode(image.convert("CMYK"), format="JPEG"), "cmyk"),
            ("progressive.JPEG", encode(image, format="JPEG", progressive=True), "progressive"),
            ("png.JPEG", encode(image, format="PNG"), "png"),
            ("truncated.JPEG", baseline[:len(baseline) // 2], "truncated")]


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory):
    """Real files on disk: baseline JPEGs of several sizes plus the odd ones ImageNet holds."""
    root = tmp_path_factory.mktemp("mixed")
    samples = []
    for k, (width, height) in enumerate([(160, 120), (97, 131), (200, 90), (64, 64)]):
        path = root / f"photo{k}.JPEG"
        path.write_bytes(encode(photo(width, height, seed=k), format="JPEG", quality=90))
        samples.append((str(path), k))
    for name, data, route in odd_files():
        if route != "truncated":
            (root / name).write_bytes(data)
            samples.append((str(root / name), len(samples)))
    return samples


# ----------------------------------------------------------------------------- crop boxes

def test_train_box_is_a_pure_function_of_seed_epoch_index():
    boxes = [train_box(1, 2, index, 500, 375, 0.08, 0.5) for index in range(200)]
    assert boxes == [train_box(1, 2, index, 500, 375, 0.08, 0.5) for index in range(200)]
    torch.manual_seed(123)  # the global RNGs play no part
    assert boxes[7] == train_box(1, 2, 7, 500, 375, 0.08, 0.5)
    assert boxes != [train_box(1, 3, index, 500, 375, 0.08, 0.5) for index in range(200)]
    for top, left, height, width, flip in boxes:
        assert 0 <= top and top + height <= 375 and 0 <= left and left + width <= 500
        assert 0.08 * 500 * 375 * 0.97 <= height * width  # scale range, up to rounding
    flips = sum(box[4] for box in boxes)
    assert 70 < flips < 130  # hflip 0.5
    assert not any(train_box(1, 2, index, 500, 375, 0.08, 0.0)[4] for index in range(50))


def test_train_box_falls_back_to_the_centre_like_torchvision():
    # A 1000x10 strip never fits a 3/4..4/3 box of >= 90% of its area: torchvision's fallback.
    assert train_box(0, 0, 0, 1000, 10, 0.9, 0.0) == (0, (1000 - 13) // 2, 10, 13, False)


def test_center_box_matches_resize_then_center_crop():
    # 500x375, 224/0.875 = 256: resized to 341x256, crop at (16, 58) -> source /(256/375)
    top, left, height, width, flip = center_box(500, 375, 224, 256)
    assert (height, width) == pytest.approx((224 * 375 / 256, 224 * 500 / 341))
    assert (top, left) == pytest.approx((16 * 375 / 256, 58 * 500 / 341)) and flip is False


def pil_crop(image, box, size, interpolation="bilinear"):
    """torchvision's resized_crop + hflip on a PIL image: the pixels both backends stay close to."""
    top, left, height, width, flip = box
    mode = transforms.InterpolationMode(interpolation)
    out = transforms.functional.resized_crop(image, top, left, height, width, [size, size], interpolation=mode)
    return torch.from_numpy(np.array(transforms.functional.hflip(out) if flip else out)).permute(2, 0, 1).float()


def test_cpu_crop_and_tensor_path_use_the_same_boxes():
    image = photo(160, 120)
    crop = CpuTrainCrop(SIZE, 0.08, 0.5)
    boxes = TrainBoxes(seed=3, min_scale=0.08, hflip=0.5, sizes=SIZE)
    for index in range(20):
        assert crop.box(image, 3, 5, index) == boxes(160, 120, 5, index)


def test_tensor_path_pixels_match_the_pil_path():
    """Same boxes, same kernels: the batched resample is within rounding of PIL (whose two passes
    each round to uint8). Tolerance: mean abs diff < 0.5, max 1 level for bilinear."""
    images = [photo(160, 120, seed=s) for s in range(3)] + [photo(97, 131, seed=5)]
    crop = CpuTrainCrop(SIZE, 0.08, 0.5)
    boxes = [crop.box(image, 0, 1, index) for index, image in enumerate(images)]
    pictures = [torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images]
    shapes = torch.tensor([(image.height, image.width) for image in images])
    out = resample_batch(pictures, torch.tensor(boxes, dtype=torch.float64), shapes, SIZE)
    assert any(box[4] for box in boxes) and not all(box[4] for box in boxes)  # both flip states
    for k, image in enumerate(images):
        expected = pil_crop(image, boxes[k], SIZE)
        diff = (out[k] - expected).abs()
        assert diff.mean() < 0.5 and diff.max() <= 1, (k, diff.mean(), diff.max())
        # the per-image torchvision path it stands in for agrees too
        reference = reference_crop(pictures[k], boxes[k], SIZE).float()
        assert (out[k] - reference).abs().mean() < 0.5


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
def test_cpu_crop_pixels_match_pil(interpolation):
    """The cpu backend's crop resizes with torch's uint8 kernels (nearest: PIL's own): within one
    level of PIL's resized_crop for bilinear, bicubic's clipped overshoot apart, equal for nearest;
    downscaled, upscaled and flipped boxes alike."""
    images = [photo(160, 120, seed=s) for s in range(4)] + [photo(97, 131, seed=5)]
    crop = CpuTrainCrop(SIZE, 0.08, 0.5, interpolation)
    boxes = [crop.box(image, 0, 2, index) for index, image in enumerate(images)]
    assert any(box[4] for box in boxes) and not all(box[4] for box in boxes)  # both flip states
    assert min(box[2] for box in boxes) < SIZE < max(box[2] for box in boxes)  # up- and downscaled
    for k, image in enumerate(images):
        out = crop(image, 0, 2, k)
        assert out.shape == (SIZE, SIZE, 3) and out.dtype == torch.uint8
        diff = (out.permute(2, 0, 1).float() - pil_crop(image, boxes[k], SIZE, interpolation)).abs()
        limit = {"bilinear": 1, "bicubic": 8, "nearest": 0}[interpolation]
        assert diff.mean() < 0.5 and diff.max() <= limit, (k, diff.mean(), diff.max())


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
def test_validation_resize_center_crop_matches_torchvision_pil(interpolation):
    image = photo(160, 120)
    mode = transforms.InterpolationMode(interpolation)
    expected = transforms.Compose([transforms.Resize(int(SIZE / 0.875), interpolation=mode),
                                   transforms.CenterCrop(SIZE)])(image)
    expected = torch.from_numpy(np.array(expected)).permute(2, 0, 1).float()
    box = CenterBoxes(SIZE, val_resize(SIZE, 0.875))(160, 120, 0, 0)
    out = resample_batch([torch.from_numpy(np.array(image)).permute(2, 0, 1)],
                         torch.tensor([box], dtype=torch.float64), torch.tensor([[120, 160]]), SIZE,
                         train=False, interpolation=interpolation)[0]
    diff = (out - expected).abs()
    if interpolation == "nearest":  # same taps, except where PIL's accumulated centre falls below
        assert (diff == 0).float().mean() > 0.97  # an exact integer (here one column of 64)
        return
    # bicubic overshoots: PIL clips its intermediate pass to 0..255, we clip once at the end
    assert diff.mean() < 0.5 and diff.max() <= (1 if interpolation == "bilinear" else 8), (diff.mean(), diff.max())


def test_chunked_canvas_gives_the_same_pixels():
    """A small canvas budget splits the batch into several matmul chunks; order and pixels hold."""
    images = [photo(40 + 30 * k, 50 + 10 * k, seed=k) for k in range(5)]
    pictures = [torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images]
    boxes = torch.tensor([train_box(0, 0, k, image.width, image.height, 0.3, 0.5) for k, image in enumerate(images)],
                         dtype=torch.float64)
    shapes = torch.tensor([(image.height, image.width) for image in images])
    whole = resample_batch(pictures, boxes, shapes, SIZE)
    chunked = resample_batch(pictures, boxes, shapes, SIZE, budget=3 * 60 * 90)
    assert torch.equal(whole, chunked)


def canvas_case():
    """Twelve pictures, stored CHW and HWC (raw payloads are HWC memory seen as CHW), with regions
    touching the far edges or not; returns (pictures, regions, tall, wide)."""
    generator = torch.Generator().manual_seed(0)
    pictures, regions = [], []
    for k in range(12):
        height, width = torch.randint(8, 40, (2,), generator=generator).tolist()
        picture = torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)
        if k % 2:
            picture = picture.permute(1, 2, 0).contiguous().permute(2, 0, 1)
        top, left = (0, 0) if k % 3 == 0 else (height // 3, width // 4)
        pictures.append(picture)
        regions.append((top, left, height - top - (k % 2), width - left))
    return pictures, regions, max(r[2] for r in regions) + 3, max(r[3] for r in regions) + 5


def check_canvas(canvas, pictures, regions, tall, wide, zeros_beyond):
    """Each region sits at its slot's top left with the picture's own pixels; beyond it finite
    values (the weights there are zero), or zeros where the canvas promises them."""
    assert canvas.shape == (len(pictures), tall, 3, wide)
    canvas = canvas.cpu()
    for k, (picture, (top, left, height, width)) in enumerate(zip(pictures, regions)):
        region = picture.cpu()[:, top:top + height, left:left + width].permute(1, 0, 2).float()
        assert torch.equal(canvas[k, :height, :, :width].float(), region), k
        if zeros_beyond:
            assert not canvas[k, height:].any() and not canvas[k, :, :, width:].any(), k
    assert canvas.min() >= 0 and canvas.max() <= 255


def test_canvas_holds_each_region_at_its_top_left():
    pictures, regions, tall, wide = canvas_case()
    check_canvas(_canvas(pictures, regions, tall, wide, torch.float32), pictures, regions, tall, wide, False)


def in_triton_interpreter(*lines):
    """Run lines of Python in a fresh process with Triton's interpreter on (the switch is read
    when a kernel is defined), this directory importable; returns what it printed."""
    code = "\n".join(["import sys", "sys.path.insert(0, 'tests')", *lines])
    done = run_command([sys.executable, "-c", code], env={"TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_triton_canvas_kernel_in_the_interpreter():
    """The CUDA canvas kernel run by Triton's interpreter on CPU tensors (a fresh process: the
    switch is read when the kernel is defined): regions in place, zeros beyond them."""
    printed = in_triton_interpreter(
        "from test_gpu_batches import canvas_case, check_canvas",
        "from utils.data.gpu.canvas_kernel import region_canvas, region_table",
        "import torch",
        "pictures, regions, tall, wide = canvas_case()",
        "canvas = region_canvas(region_table(pictures, regions), tall, wide, torch.float32)",
        "check_canvas(canvas, pictures, regions, tall, wide, True)",
        "print('canvas ok', tuple(canvas.shape))")
    assert "canvas ok (12, " in printed


@pytest.mark.gpu
def test_triton_canvas_on_the_gpu_matches_the_torch_canvas():
    from utils.data.gpu.canvas_kernel import region_canvas, region_table
    from utils.data.gpu.resample import _torch_canvas
    pictures, regions, tall, wide = canvas_case()
    pictures = [picture.cuda() for picture in pictures]
    canvas = region_canvas(region_table(pictures, regions).cuda(), tall, wide, torch.float16)
    check_canvas(canvas, pictures, regions, tall, wide, True)
    check_canvas(_torch_canvas(pictures, regions, tall, wide, torch.float16), pictures, regions, tall, wide, False)
    check_canvas(_canvas(pictures, regions, tall, wide, torch.float16), pictures, regions, tall, wide, True)


def normalise_case(device="cpu"):
    """Two chunks of resampled images (fp16, the matmuls' (k, size, 3, size) layout seen as
    (k, 3, size, size)) with ties at .5, values beyond 0..255 and both signs of zero, their
    places in a batch of 7, and ImageNet's mean and std x 255 as the decoder holds them."""
    generator = torch.Generator().manual_seed(1)
    size, chunks = 13, []
    for group in ([4, 0, 6], [2, 5, 1, 3]):
        values = torch.randint(-40, 600, (len(group), size, 3, size), generator=generator) / 2.0
        values.view(-1)[:4] = torch.tensor([-0.0, 0.5, 254.5, 255.5])
        chunks.append((group, values.half().to(device).permute(0, 2, 1, 3)))
    mean = torch.tensor([m * 255 for m in IMAGENET_MEAN], device=device).view(1, 3, 1, 1)
    std = torch.tensor([s * 255 for s in IMAGENET_STD], device=device).view(1, 3, 1, 1)
    return chunks, size, mean, std


def normalised_by_torch(chunks, size, mean, std, memory_format):
    """What GpuBatchDecoder._finish computes with torch ops: round, clamp, fp32, normalise."""
    order = [i for group, _ in chunks for i in group]
    pixels = torch.cat([images for _, images in chunks])[torch.tensor(order).argsort()]
    images = pixels.round_().clamp_(0, 255).float().contiguous(memory_format=memory_format)
    return images.sub_(mean).div_(std)


def check_normalise_into(normalise_into, device):
    chunks, size, mean, std = normalise_case(device)
    for memory_format in (torch.contiguous_format, torch.channels_last):
        out = torch.full((7, 3, size, size), float("nan"), device=device).contiguous(memory_format=memory_format)
        for group, images in chunks:
            normalise_into(out, images, torch.tensor(group, device=device), mean, std)
        want = normalised_by_torch(chunks, size, mean, std, memory_format)
        assert out.is_contiguous(memory_format=memory_format) and torch.equal(out.cpu(), want.cpu())


def test_triton_normalise_kernel_in_the_interpreter():
    """The kernel that rounds, clamps, normalises and places each image, run by Triton's
    interpreter on CPU tensors: bit for bit the torch ops' result, in both layouts."""
    printed = in_triton_interpreter(
        "from test_gpu_batches import check_normalise_into",
        "from utils.data.gpu.canvas_kernel import normalise_into",
        "check_normalise_into(normalise_into, 'cpu')",
        "print('normalise ok')")
    assert "normalise ok" in printed


@pytest.mark.gpu
def test_triton_normalise_on_the_gpu_matches_the_torch_ops():
    from utils.data.gpu.canvas_kernel import normalise_into
    check_normalise_into(normalise_into, "cuda")


def test_padding_never_reaches_the_output():
    """An image resampled in a batch of larger ones (its canvas padded with their bytes) equals
    the same image resampled alone, for every interpolation and both flips."""
    images = [photo(150, 110, seed=k) for k in range(4)] + [photo(40, 30, seed=9)]
    pictures = [torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images]
    shapes = torch.tensor([(image.height, image.width) for image in images])
    for interpolation in ("bilinear", "bicubic", "nearest"):
        for flip in (0.0, 1.0):
            boxes = torch.tensor([(5, 7, 60, 80, flip)] * 4 + [(3, 2, 25, 30, flip)], dtype=torch.float64)
            together = resample_batch(pictures, boxes, shapes, 16, interpolation=interpolation)
            alone = resample_batch(pictures[-1:], boxes[-1:], shapes[-1:], 16, interpolation=interpolation)
            assert torch.equal(together[-1], alone[0]), (interpolation, flip)


# ----------------------------------------------------------------------------- routing, packing

@pytest.mark.parametrize("name,data,route", odd_files(), ids=[f[0] for f in odd_files()])
def test_header_routing(name, data, route, tmp_path):
    path = tmp_path / name
    path.write_bytes(data)
    assert jpeg_route(path.read_bytes()) == route


def test_not_an_image_routes_to_pil():
    assert jpeg_route(b"GIF89a....") == "not-jpeg" and jpeg_route(b"") == "not-jpeg"


def test_pack_round_trip_keeps_bytes_and_metadata(mixed_folder):
    dataset = ByteSamples(mixed_folder, TrainBoxes(0, 0.08, 0.5, SIZE))
    batch = [dataset[(index, 2)] for index in range(len(dataset))]
    packed = pack_bytes(batch)
    payloads = unpack(packed.buffer, packed.offsets)
    assert len(payloads) == len(batch)
    for payload, sample in zip(payloads, batch):
        assert payload.dtype == torch.uint8 and np.array_equal(payload.numpy(), sample[0])
        assert payload.untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr()  # views
    assert packed.labels.tolist() == [label for _, label in mixed_folder]
    assert packed.indices.tolist() == list(range(len(batch)))
    assert packed.boxes[:, :4].tolist() == [list(sample[2][:4]) for sample in batch]
    routes = [jpeg_route(open(path, "rb").read()) for path, _ in mixed_folder]
    assert packed.raw.tolist() == [route != GPU for route in routes]
    # the JPEG payloads are the files; the others PIL's pixels at the true size
    for (path, _), payload, raw, (height, width) in zip(mixed_folder, payloads, packed.raw, packed.shapes.tolist()):
        size = Image.open(path).size
        assert (width, height) == size
        if not raw:
            assert payload.numpy().tobytes() == open(path, "rb").read()
        else:
            assert len(payload) == width * height * 3


def test_packed_batches_cross_worker_processes(mixed_folder):
    dataset = ByteSamples(mixed_folder, CenterBoxes(SIZE, val_resize(SIZE, 0.875)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1, collate_fn=pack_bytes)
    got = list(loader)
    assert sum(len(packed.labels) for packed in got) == len(dataset)
    assert unpack(got[0].buffer, got[0].offsets)[0].numpy().tobytes() == open(mixed_folder[0][0], "rb").read()
    for start, packed in zip(range(0, len(dataset), 4), got):
        here = pack_bytes([dataset[index] for index in range(start, min(start + 4, len(dataset)))])
        for name, field, expected in zip(Packed._fields[:-1], packed, here):
            assert field.dtype == expected.dtype and torch.equal(field, expected), name
        assert packed.size == here.size == SIZE  # the output size, a plain int
        # Only the buffer crossed through shared memory; the small fields came inside the pickle.
        assert packed.buffer.is_shared() and not any(field.is_shared() for field in packed[1:-1])


# ----------------------------------------------------------------------------- decoder

def decoded(mixed_folder, train=True, channels_last=False):
    boxes = TrainBoxes(0, 0.08, 0.5, SIZE) if train else CenterBoxes(SIZE, val_resize(SIZE, 0.875))
    dataset = ByteSamples(mixed_folder, boxes)
    packed = pack_bytes([dataset[(index, 1)] for index in range(len(dataset))])
    decoder = GpuBatchDecoder("cpu", IMAGENET_MEAN, IMAGENET_STD, channels_last, name_of=dataset.name,
                              train=train)
    return decoder(packed), packed


def cpu_backend_pixels(path, train, index):
    """What the cpu backend feeds the model: PIL decode, then CpuTrainCrop / Resize+CenterCrop."""
    with Image.open(path) as image:
        image = image.convert("RGB")
    if train:
        return CpuTrainCrop(SIZE, 0.08, 0.5)(image, 0, 1, index).permute(2, 0, 1).float()
    out = transforms.Compose([transforms.Resize(int(SIZE / 0.875)), transforms.CenterCrop(SIZE)])(image)
    return torch.from_numpy(np.array(out)).permute(2, 0, 1).float()


@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_decoder_matches_the_cpu_backend_on_a_mixed_folder(mixed_folder, train):
    (images, targets), packed = decoded(mixed_folder, train, channels_last=True)
    assert images.shape == (len(mixed_folder), 3, SIZE, SIZE) and images.dtype == torch.float32
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert targets.dtype == torch.int64 and targets.tolist() == [label for _, label in mixed_folder]
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255
    for index, (path, _) in enumerate(mixed_folder):
        pixels = images[index] * std + mean
        diff = (pixels - cpu_backend_pixels(path, train, index)).abs()
        # libjpeg-turbo decodes in both; the rest is resampling rounding
        assert diff.mean() < 0.5 and diff.max() <= 1.01, (path, diff.mean(), diff.max())


def test_decoder_repeats_bit_for_bit(mixed_folder):
    (first, _), _ = decoded(mixed_folder)
    (second, _), _ = decoded(mixed_folder)
    assert torch.equal(first, second)


def test_corrupt_file_is_a_usage_error_naming_it(tmp_path):
    bad = tmp_path / "broken.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg at all" * 3)
    dataset = ByteSamples([(str(bad), 0)], TrainBoxes(0, 0.08, 0.5, SIZE))
    with pytest.raises(UsageError, match="broken.JPEG"):
        dataset[(0, 0)]
    truncated = tmp_path / "cut.JPEG"
    truncated.write_bytes(odd_files()[0][1][:300])
    with pytest.raises(UsageError, match="cut.JPEG"):
        ByteSamples([(str(truncated), 0)], TrainBoxes(0, 0.08, 0.5, SIZE))[(0, 0)]


def test_an_image_pil_refuses_as_a_decompression_bomb_is_a_usage_error_naming_it(tmp_path):
    """PIL refuses at open an image over twice Image.MAX_IMAGE_PIXELS with DecompressionBombError,
    which is no OSError: every reader (cpu train crop, val loader, gpu backend's workers) must still
    name the file in the one-line error, not end the run with a worker's traceback."""
    from utils.data.folder import image_folder
    folder = tmp_path / "val" / "a"
    folder.mkdir(parents=True)
    big = folder / "huge.png"
    side = int((2 * Image.MAX_IMAGE_PIXELS) ** 0.5) + 2  # 1-bit and blank: a 22 kB file
    Image.new("1", (side, side)).save(big, optimize=True)
    with pytest.raises(UsageError, match="huge.png"):
        rgb_pixels(big)
    with pytest.raises(UsageError, match="huge.png"):
        ByteSamples([(str(big), 0)], TrainBoxes(0, 0.08, 0.5, SIZE))[(0, 0)]
    with pytest.raises(UsageError, match="huge.png"):
        image_folder(str(tmp_path), "val", val_transform(SIZE, val_resize(SIZE, 0.875)))[0]


def garbled_scan(jpeg):
    """The JPEG with its scan data replaced by garbage and an EOI: the header still says GPU."""
    start = jpeg.find(b"\xff\xda")
    return jpeg[:start] + b"\xff\xda\x00\x02" + b"\xff\x00" * 10 + b"\xff\xd9"


class WholeImages:
    """Boxes that are the whole image, unflipped (ByteSamples' boxes: a box, and the epoch's size)."""

    def __call__(self, width, height, epoch, index, repeat=0):
        return 0, 0, height, width, False

    def size(self, epoch):
        return SIZE


def whole_image_sample(data, label, index):
    """A ByteSamples item for a 160x120 JPEG payload whose box is the whole image, unflipped, to
    be resized to SIZE."""
    return np.frombuffer(data, np.uint8), label, (0, 0, 120, 160, False), index, 120, 160, False, SIZE


@pytest.mark.parametrize("name,data,route", odd_files(), ids=[f[0] for f in odd_files()])
def test_cpu_backend_pixels_equal_imagefolders_loader_for_every_kind_of_file(name, data, route, tmp_path):
    """rgb_pixels (libjpeg-turbo through torchvision for plain JPEGs, PIL for the rest) gives the
    pixels ImageFolder's PIL loader gives, to the level, and the same one-line error for a file
    neither can read (a truncated file, a garbled scan behind a good header)."""
    path = tmp_path / name
    path.write_bytes(data)
    if route == "truncated":
        with pytest.raises(UsageError, match=name):
            rgb_pixels(path)
        return
    pixels = rgb_pixels(path)
    assert pixels.dtype == torch.uint8 and pixels.shape[2] == 3
    assert np.array_equal(pixels.numpy(), np.asarray(rgb_loader(path)))
    garbled = tmp_path / f"garbled-{name}"
    garbled.write_bytes(garbled_scan(data))
    if jpeg_route(garbled.read_bytes()) == GPU:
        with pytest.raises(UsageError, match=f"garbled-{name}"):
            rgb_pixels(garbled)


def test_decoder_falls_back_per_file_when_the_batch_decode_fails(mixed_folder, tmp_path):
    """A file whose header passes but whose body the decoder rejects goes to cpu_fallback alone;
    if PIL cannot read it either, the error names it."""
    good = open(mixed_folder[0][0], "rb").read()
    bad = garbled_scan(good)
    assert jpeg_route(bad) == GPU
    names = {0: "good.JPEG", 1: "bad.JPEG"}
    calls = []

    def fallback(data, name):
        calls.append(name)
        return pil_rgb(data, name)

    samples = [whole_image_sample(good, 0, 0), whole_image_sample(bad, 1, 1)]
    decoder = GpuBatchDecoder("cpu", IMAGENET_MEAN, IMAGENET_STD, cpu_fallback=fallback, name_of=names.get)
    with pytest.raises(UsageError, match="bad.JPEG"):
        decoder(pack_bytes(samples))
    assert calls == ["bad.JPEG"]


@pytest.mark.parametrize("threads", [1, 2])
def test_threaded_batches_equal_the_callers_own_in_order(mixed_folder, threads):
    """GpuBatches' decode threads (2: decode and resampling in two, CUDA's default; 1: one)
    hand over the same batches, in loader order, as decoding in the calling thread."""
    dataset = ByteSamples(mixed_folder, TrainBoxes(0, 0.08, 0.5, SIZE))
    packed = [pack_bytes([dataset[(index, 1)] for index in range(start, min(start + 3, len(dataset)))])
              for start in range(0, len(dataset), 3)]
    decoder = GpuBatchDecoder("cpu", IMAGENET_MEAN, IMAGENET_STD, name_of=dataset.name)
    expected = list(GpuBatches(packed, decoder, threads=0))
    got = list(GpuBatches(packed, decoder, threads=threads))
    assert len(got) == len(packed) > 1
    for (images, targets), (want_images, want_targets) in zip(got, expected):
        assert torch.equal(images, want_images) and torch.equal(targets, want_targets)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_start_decoding_at_iter_and_close_ends_them(mixed_folder, threads):
    """iter() starts the decode threads (train.py starts the next epoch before validating), with
    no batch asked for yet; close() of the iterator ends every stage's thread."""
    import threading
    dataset = ByteSamples(mixed_folder, TrainBoxes(0, 0.08, 0.5, SIZE))
    packed = [pack_bytes([dataset[(index, 1)]]) for index in range(len(dataset))]
    decoder = GpuBatchDecoder("cpu", IMAGENET_MEAN, IMAGENET_STD, name_of=dataset.name)
    decoded = threading.Event()
    taken = []

    def loader():  # taken when a thread asks; the event once its first batch is decoded
        for batch in packed:
            taken.append(batch)
            if len(taken) == 2:
                decoded.set()
            yield batch

    before = set(threading.enumerate())
    iterator = iter(GpuBatches(loader(), decoder, threads=threads))
    assert decoded.wait(timeout=120), "no batch was taken before the first next()"
    started = [t for t in threading.enumerate() if t not in before and t.name == "gpu-decode"]
    assert len(started) == threads
    images, _ = next(iterator)
    assert images.shape == (1, 3, SIZE, SIZE)
    iterator.close()
    assert not any(t.is_alive() for t in started)
    assert len(taken) < len(packed)  # stopped early: its queues hold at most 6 batches, the folder 9
    with pytest.raises(StopIteration):
        next(iterator)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_error_in_a_thread_reaches_the_training_loop(mixed_folder, threads):
    good = open(mixed_folder[0][0], "rb").read()
    batches = [pack_bytes([whole_image_sample(data, 0, index)])
               for index, data in enumerate([good, garbled_scan(good), good])]
    decoder = GpuBatchDecoder("cpu", IMAGENET_MEAN, IMAGENET_STD, name_of={0: "a", 1: "bad.JPEG", 2: "c"}.get)
    iterator = iter(GpuBatches(batches, decoder, threads=threads))
    images, _ = next(iterator)
    assert images.shape == (1, 3, SIZE, SIZE)
    with pytest.raises(UsageError, match="bad.JPEG"):
        next(iterator)


# ----------------------------------------------------------------------------- on the GPU

@pytest.fixture(params=["cuda", "hardware"])
def jpeg_decoder(request):
    """Both JPEG decoders: nvJPEG on the SMs, and the hardware engines (when nvImageCodec is
    installed: it is optional, so its absence skips those cases rather than failing them)."""
    if request.param == "hardware":
        pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec (optional) not installed")
    return request.param


def gpu_decoder(dataset, jpeg_decoder, train=True):
    return GpuBatchDecoder("cuda", IMAGENET_MEAN, IMAGENET_STD, channels_last=True, name_of=dataset.name,
                           train=train, jpeg_decoder=jpeg_decoder)


@pytest.mark.gpu
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_gpu_finish_in_one_kernel_equals_the_torch_ops(mixed_folder, train):
    """The decoder's last pass (utils.data.gpu.canvas_kernel.normalise_into per chunk) gives bit for bit
    what resample_batch and the torch normalisation give, for a batch split into several chunks."""
    from utils.data.gpu.resample import resample_batch
    boxes = TrainBoxes(0, 0.08, 0.5, SIZE) if train else CenterBoxes(SIZE, val_resize(SIZE, 0.875))
    dataset = ByteSamples(mixed_folder, boxes)
    packed = pack_bytes([dataset[(index, 1)] for index in range(len(dataset))])
    decoder = gpu_decoder(dataset, "cuda", train=train)
    pictures = decoder.decode(packed)
    torch.cuda.synchronize()
    budget = 3 * max(h * w for h, w in packed.shapes.tolist())  # several chunks, so reordering happens
    want = resample_batch(pictures, packed.boxes, packed.shapes, SIZE, train, "bilinear", torch.float16, budget)
    want = want.float().contiguous(memory_format=torch.channels_last).sub_(decoder.mean).div_(decoder.std)
    decoder.canvas_budget = budget
    got, _ = decoder._finish(packed, pictures)
    assert got.is_contiguous(memory_format=torch.channels_last) and torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_decoded_pixels_close_to_pil(mixed_folder, jpeg_decoder):
    """Decoded pixels (no crop: the whole image as its box at its own size) vs PIL: mean abs < 2."""
    dataset = ByteSamples(mixed_folder, WholeImages())
    packed = pack_bytes([dataset[index] for index in range(len(dataset))])
    pictures = gpu_decoder(dataset, jpeg_decoder).decode(packed)
    for (path, _), picture in zip(mixed_folder, pictures):
        expected = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
        assert picture.shape == expected.shape
        assert (picture.cpu().float() - expected.float()).abs().mean() < 2, path


@pytest.mark.gpu
@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_gpu_pipeline_matches_the_cpu_backend(mixed_folder, train, jpeg_decoder):
    boxes = TrainBoxes(0, 0.08, 0.5, SIZE) if train else CenterBoxes(SIZE, val_resize(SIZE, 0.875))
    dataset = ByteSamples(mixed_folder, boxes)
    packed = pack_bytes([dataset[(index, 1)] for index in range(len(dataset))])
    images, targets = gpu_decoder(dataset, jpeg_decoder, train)(packed)
    torch.cuda.synchronize()
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255
    for index, (path, _) in enumerate(mixed_folder):
        pixels = images[index].cpu() * std + mean
        diff = (pixels - cpu_backend_pixels(path, train, index)).abs()
        assert diff.mean() < 2.5, (path, diff.mean())  # nvJPEG's IDCT/upsampling + fp16 resampling
    assert targets.tolist() == [label for _, label in mixed_folder]


@pytest.mark.gpu
def test_gpu_pipeline_repeats_bit_for_bit(mixed_folder, jpeg_decoder):
    dataset = ByteSamples(mixed_folder, TrainBoxes(0, 0.08, 0.5, SIZE))
    packed = pack_bytes([dataset[(index, 1)] for index in range(len(dataset))])
    decoder = gpu_decoder(dataset, jpeg_decoder)
    first = decoder(packed)[0].cpu()
    for _ in range(3):
        assert torch.equal(decoder(packed)[0].cpu(), first)


@pytest.mark.gpu
def test_gpu_decode_survives_queued_work_on_the_consumer_stream(mixed_folder, jpeg_decoder):
    """pytorch/vision#9606: tensors freed while kernels queued on the caller's stream still read
    them must not be overwritten by the decode. Queue a long matmul chain, free its inputs, decode."""
    dataset = ByteSamples(mixed_folder, TrainBoxes(0, 0.08, 0.5, SIZE))
    packed = pack_bytes([dataset[(index, 1)] for index in range(len(dataset))])
    decoder = gpu_decoder(dataset, jpeg_decoder)
    for _ in range(20):
        victims = [torch.full((1 << 20,), 1.5, device="cuda") for _ in range(8)]
        slow = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            slow = slow @ slow.T / 4096
        sums = [victim.sum() for victim in victims]
        del victims
        decoder(packed)
        assert all(float(total) == 1.5 * (1 << 20) for total in sums)


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("consumer", ["default", "side"])
def test_gpu_threads_hand_over_the_decoders_batches_under_queued_work(mixed_folder, jpeg_decoder, threads, consumer):
    """GpuBatches' threads on CUDA: each batch bit for bit what the decoder gives when called
    directly, while the consumer keeps its stream busy (batches read only after it): the default
    stream, or a side stream current in the consumer's thread only (the hand-over orders the
    stream of the thread that takes the batch, not the decode threads' own current stream)."""
    dataset = ByteSamples(mixed_folder, TrainBoxes(0, 0.08, 0.5, SIZE))
    batches = [pack_bytes([dataset[(index, epoch)] for index in range(len(dataset))]) for epoch in range(8)]
    decoder = gpu_decoder(dataset, jpeg_decoder)
    expected = [decoder(packed)[0].cpu() for packed in batches]
    stream = torch.cuda.current_stream() if consumer == "default" else torch.cuda.Stream()
    kept = []
    with torch.cuda.stream(stream):
        slow = torch.randn(4096, 4096, device="cuda")
        for images, _ in GpuBatches(batches, decoder, threads=threads):
            for _ in range(10):
                slow = slow @ slow.T / 4096
            kept.append(images.clone())  # queued after the matmuls, on the consumer's stream
    stream.synchronize()
    assert len(kept) == len(expected)
    for got, want in zip(kept, expected):
        assert torch.equal(got.cpu(), want)


def test_spares_are_paired_so_that_fewest_must_grow():
    """Each picture gets a spare image of its own, and no other pairing leaves fewer pictures
    larger than their spare (each of those costs a free and an allocation on the GPU)."""
    from utils.data.gpu.decoders import pair_by_size
    assert pair_by_size([5, 1, 3], [2, 9, 4, 7]) == [3, 0, 2]
    assert pair_by_size([100, 50], [60, 40]) == [1, 0]
    assert pair_by_size([], [4, 2]) == []
    generator = np.random.default_rng(0)
    for _ in range(50):
        capacities = generator.integers(1, 100, 40).tolist()
        needs = generator.integers(1, 100, int(generator.integers(1, 41))).tolist()
        chosen = pair_by_size(needs, capacities)
        assert len(set(chosen)) == len(needs) and all(0 <= k < len(capacities) for k in chosen)
        grown = sum(need > capacities[k] for need, k in zip(needs, chosen))
        for _ in range(20):  # no other pairing needs fewer spares to grow
            other = generator.permutation(len(capacities))[:len(needs)]
            assert grown <= sum(need > capacities[k] for need, k in zip(needs, other))


@pytest.mark.gpu
def test_hardware_decoder_reuses_retired_images_and_gives_the_same_pixels(mixed_folder):
    """Once batches retire, the hardware decoder decodes into their images' buffers; every picture
    equals its decode by a fresh decoder although each call sees the files in another order (so a
    buffer is reused for pictures of other sizes)."""
    pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec (optional) not installed")
    from utils.data.gpu.decoders import HardwareJpeg
    payloads = [torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8) for path, _ in mixed_folder]
    payloads = [payload for payload in payloads if jpeg_route(payload.numpy().tobytes()) == GPU]
    stream = torch.cuda.Stream()
    first = HardwareJpeg("cuda")(payloads, stream)
    stream.synchronize()
    wanted = [None if picture is None else picture.cpu() for picture in first]
    assert sum(picture is not None for picture in wanted) >= 4
    decoder = HardwareJpeg("cuda")
    for call in range(10):
        order = [(k + call) % len(payloads) for k in range(len(payloads))]
        pictures = decoder([payloads[k] for k in order], stream)
        stream.synchronize()
        for k, picture in zip(order, pictures):
            assert (picture is None) == (wanted[k] is None)
            if picture is not None:
                assert torch.equal(picture.cpu(), wanted[k]), (call, k)
    assert decoder.reused >= 4 * len(payloads)


@pytest.mark.gpu
def test_jpeg_decoder_is_settled_on_cuda():
    """auto: cuda, with the reason, and under --deterministic hardware where nvImageCodec finds
    JPEG engines; cuda asked for is kept; hardware asked for without nvImageCodec is a usage error
    naming what is missing."""
    from utils.data.gpu.decoders import settle_jpeg_decoder
    assert settle_jpeg_decoder("auto", "cuda") == ("cuda", "auto: nvJPEG measured faster in training")
    assert settle_jpeg_decoder("cuda", "cuda") == ("cuda", "--jpeg-decoder")
    try:
        import nvidia.nvimgcodec  # noqa: F401
    except ImportError:
        with pytest.raises(UsageError, match="nvImageCodec is not installed"):
            settle_jpeg_decoder("hardware", "cuda")
        assert settle_jpeg_decoder("auto", "cuda", deterministic=True)[0] == "cuda"
    else:
        assert settle_jpeg_decoder("hardware", "cuda") == ("hardware", "--jpeg-decoder")
        name, why = settle_jpeg_decoder("auto", "cuda", deterministic=True)
        assert name == "hardware" and why.startswith("auto: --deterministic")


def test_phase_timing_leaves_the_threaded_loader_alone(mixed_folder):
    """profile.py's data-wait split wraps the loader the main thread reads; GpuBatches' threads
    read theirs, so with threads it stays unwrapped (its ranges would land in the main thread's
    table, as a negative host-to-device), and with none it is wrapped."""
    from utils.profiling import TimedLoader, time_data_wait
    decoder = GpuBatchDecoder("cpu", IMAGENET_MEAN, IMAGENET_STD)
    loader = torch.utils.data.DataLoader(ByteSamples(mixed_folder, TrainBoxes(0, 0.08, 0.5, SIZE)), batch_size=2,
                                         collate_fn=pack_bytes)
    threaded, inline = GpuBatches(loader, decoder, threads=2), GpuBatches(loader, decoder, threads=0)
    assert time_data_wait(threaded, phases=None) is False and threaded.loader is loader
    assert time_data_wait(inline, phases=None) is True and isinstance(inline.loader, TimedLoader)
