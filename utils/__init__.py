"""The package train.py, eval.py and profile.py share, one concern a module. The map:

    flags/            the command line: parser.py (every flag, its type and --help), precedence.py
                      (defaults < checkpoint < --config < typed), specs.py (the scripts' edge: flags
                      become each concern's frozen spec; nothing below reads `args`)
    precision.py      OPT_LEVELS, the literal opt-level table; PrecisionPlan and the Precision shim
    loss_scale.py     the loss scale and the non-finite check, on the device; the fp32-summed clip
    device.py         the Accelerator, determinism, CUDA work queues, what the device settles
    training_state.py model + precision + optimizer, built fresh or resumed, and the resume checks
    engine.py         train_one_epoch and validate, the LR schedule
    meters.py         what an epoch reports: device meters, EpochResult, the log line's figures
    ingredients.py    recipe ingredients: label smoothing, mixup/cutmix, EMA, optimizers, erasing, --aa
    models.py         torchvision and timm models, local pretrained weights
    compiled.py       torch.compile, once, after prepare
    logs.py           args.yaml, summary.csv, curves.png, trackers, the progress bar
    predictions.py    eval.py's per-image predictions CSV
    profiling.py      NVTX window, phase timing, the phase table, trace export
    benchmark.py      profile.py --benchmark's rows, table and CSV
    data/             DATA to device batches: sources, ImageFolder/HF/digits/synthetic, crops, the cpu
                      batch path; data/gpu/ the gpu backend (its own map)
    run/              what keeps a run safe: checkpoints, atomic files, the output directory,
                      preemption, errors and exit codes (its own map)
"""
