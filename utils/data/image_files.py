"""Image files as both input backends read them: which decoder can take a file (from its header,
without decoding it), and the CPU decoders (PIL images for the sources' transforms, uint8 tensors
for the cpu backend's train crop).

jpeg_header sorts a file by its markers: GPU for a plain JPEG (8-bit baseline or extended-Huffman,
three YCbCr components, 1x1 chroma sampling, complete to its EOI), else the reason it is not one
(png, cmyk, grayscale, progressive, truncated, ...). The gpu backend sends plain JPEGs to nvJPEG
and the rest to PIL (utils/data/gpu/packing.py); the cpu backend's train loader (rgb_pixels) decodes
plain JPEGs with torchvision's libjpeg-turbo straight into a tensor, the rest with PIL, as
ImageFolder's loader would.
"""
import io

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from utils.run.errors import UnreadableInput

GPU = "gpu"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# SOF markers nvJPEG decodes (baseline and extended sequential Huffman), and why the rest go to PIL.
SOF_GPU = (0xC0, 0xC1)
SOF_OTHER = {0xC2: "progressive", 0xC6: "progressive", 0xC3: "lossless", 0xC7: "lossless",
             0xC5: "hierarchical", 0xC9: "arithmetic", 0xCA: "arithmetic", 0xCB: "arithmetic",
             0xCD: "arithmetic", 0xCE: "arithmetic", 0xCF: "arithmetic"}
STANDALONE = {0x01, 0xD0, 0xD1, 0xD2, 0xD3, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8}
# What PIL raises for a file it cannot decode. DecompressionBombError (an image over twice
# Image.MAX_IMAGE_PIXELS, refused at open) is a plain Exception, not an OSError: without it such a
# file ended the run with a loader worker's traceback instead of the message naming the file.
UNREADABLE_IMAGE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def jpeg_header(data):
    """(route, width, height) from the markers of an encoded image, without decoding it.

    route is GPU for an 8-bit baseline/extended-Huffman JPEG with 3 components (YCbCr, chroma
    sampled 1x1 against any luma factors) whose scan is followed by an EOI; otherwise the reason
    the file goes to the CPU decoder. width/height are the frame's (0 where no frame was read).
    """
    if data[:8] == PNG_MAGIC:
        return "png", 0, 0
    if data[:2] != b"\xff\xd8":
        return "not-jpeg", 0, 0
    pos, n, frame, adobe = 2, len(data), None, None
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return "bad-marker", *_size(frame)
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in STANDALONE:
            pos += 2
            continue
        if marker == 0xD9:  # EOI before any scan
            return "truncated", *_size(frame)
        end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
        if end > n or end < pos + 4:
            return "truncated", *_size(frame)
        if marker in SOF_GPU or marker in SOF_OTHER:
            frame = (marker, data[pos + 4:end])
        elif marker == 0xEE and data[pos + 4:pos + 9] == b"Adobe" and end - pos >= 16:
            adobe = data[pos + 15]  # APP14 transform flag: 0 RGB/CMYK, 1 YCbCr, 2 YCCK
        elif marker == 0xDA:
            route = _frame_route(frame, adobe)
            # FF D9 cannot occur inside entropy-coded data (0xFF is stuffed), so its absence
            # after the scan header means the file was cut short.
            if route == GPU and data.rfind(b"\xff\xd9") < end:
                route = "truncated"
            return route, *_size(frame)
        pos = end
    return "truncated", *_size(frame)


def _size(frame):
    if frame is None or len(frame[1]) < 6:
        return 0, 0
    segment = frame[1]
    return int.from_bytes(segment[3:5], "big"), int.from_bytes(segment[1:3], "big")


def _frame_route(frame, adobe):
    if frame is None:
        return "no-frame"
    marker, segment = frame
    if marker in SOF_OTHER:
        return SOF_OTHER[marker]
    if len(segment) < 6 or segment[0] != 8:
        return "not-8-bit"
    components = segment[5]
    if components == 1:
        return "grayscale"
    if components == 4:
        return "ycck" if adobe == 2 else "cmyk"
    if components != 3 or len(segment) < 6 + 3 * components:
        return f"{components}-components"
    if adobe == 0:
        return "adobe-rgb"  # 3 components stored as RGB, not YCbCr
    if segment[6 + 4] != 0x11 or segment[6 + 7] != 0x11:
        return "odd-sampling"
    width, height = _size(frame)
    return GPU if width and height else "no-size"


def jpeg_route(data):
    """GPU, or the reason (png, cmyk, grayscale, progressive, truncated, not-jpeg, ...) for PIL."""
    return jpeg_header(data)[0]


def read_file(path):
    with open(path, "rb") as handle:
        return handle.read()


def pil_rgb(data, name):
    """Decode with PIL into an HWC uint8 RGB array, as the cpu backend's ImageFolder loader does;
    an unreadable file is the same UsageError naming it."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))
    except UNREADABLE_IMAGE as err:
        raise UnreadableInput(f"cannot read image {str(name)!r} ({err}); remove or replace that file") from None


def as_rgb(image):
    """A PIL image, decoded, in RGB. Image.convert("RGB") copies even an image that is RGB already
    (about a quarter of a 500x375 JPEG's decode time); the crop and resize make new images anyway,
    so an RGB image is passed on as it is and only other modes are converted."""
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def rgb_loader(path):
    """ImageFolder's loader without the needless copy (as_rgb); the same pixels as torchvision's."""
    with open(path, "rb") as handle:
        return as_rgb(Image.open(handle))


def rgb_pixels(path):
    """A file's pixels as a uint8 (height, width, 3) RGB tensor, for the cpu backend's train crop.

    A plain JPEG is decoded by torchvision's libjpeg-turbo straight into a tensor: the same pixels
    as PIL's (identical on 99 of 99 ImageNet-like files checked), without PIL's copy out of its own
    memory (numpy reads a PIL image through tobytes); on the 2-core development machine 1.17 ms
    against PIL's 1.3 ms plus 0.2 ms for that copy, for a 500x375 file. Anything else (PNG, CMYK,
    grayscale, progressive, a damaged scan) goes through PIL as ImageFolder's loader would, and
    an unreadable file is the same UsageError naming it.
    """
    data = read_file(path)
    if jpeg_route(data) == GPU:
        try:
            encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return decode_jpeg(encoded, mode=ImageReadMode.RGB).permute(1, 2, 0)  # a view: HWC in memory
        except RuntimeError:
            pass  # libjpeg refused the scan; PIL decodes it or names the file
    return torch.from_numpy(np.array(pil_rgb(data, path)))
