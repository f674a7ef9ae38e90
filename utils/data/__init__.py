"""The data room: DATA in, batches on the device out.

The path reads in one direction, source -> dataset pair -> cpu or gpu batch pipeline -> prefetcher:

  sources.py      DataSpec (what the path reads, made from the flags by utils.flags.specs.data_spec),
                  source_kind, and build_data, which runs the path below
  backend.py      choose_backend: --data-backend / --jpeg-decoder for a source and device, and the
                  start-up words that say why
  folder.py       ImageFolder source: layout checks, a class-folder scan that names what it skips,
                  SafeImageFolder
  hf.py           Hugging Face datasets source (hf:NAME, hf:DIR, save_to_disk folders)
  digits.py       the built-in digits demo, written once as an ImageFolder
  synthetic.py    random batches made on the device (no pipeline)
  crops.py        the crop box and flip of every sample, shared by both backends; the transforms
  image_files.py  reading files: JPEG header routing, the CPU decoders
  batches.py      the batch path: seeded samples, sharded sampler, collate, the device prefetcher,
                  the gpu backend's assembly, and Data (what the scripts iterate)
  gpu/            the gpu backend: workers send bytes, the main process decodes and crops on the GPU
"""
