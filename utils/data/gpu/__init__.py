"""The gpu input backend (--data-backend gpu): loader workers send file bytes and crop boxes, the
main process decodes whole batches and crops them on the GPU.

One direction, worker -> decoder -> resampling -> batch:

  packing.py        worker side: ByteSamples (bytes, header, box per image; PIL for files nvJPEG
                    cannot take), pack_bytes (a batch in one buffer: Packed), unpack
  decoders.py       JPEG decoders: nvJPEG (cuda) and nvImageCodec's hardware engines (hardware),
                    settle_jpeg_decoder (which one), the CUDA work-queue caveat
  resample.py       batched crop + resize + flip as two matmuls per chunk, PIL's kernels
  canvas_kernel.py  the Triton kernels of the resampling on CUDA (canvas, normalise into place)
  pipeline.py       main-process side: GpuBatchDecoder (Packed -> normalised batch), GpuBatches and
                    WorkAhead (decode and resampling threads ahead of the training loop)
"""
