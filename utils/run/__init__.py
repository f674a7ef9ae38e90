"""The run room: what keeps a run safe to stop, resume and rerun. The map:

  checkpoint.py   checkpoint.pth.tar / model_best.pth.tar: fp32 weights saved atomically, the
                  --keep-checkpoints copies, and loads that say what is wrong with a file
  files.py        atomic writes (temp file, fsync, rename): a crash or kill never leaves half a
                  file; a failed write becomes a WriteError naming the file
  directory.py    the output directory before any work: created, writable, no other run's files
                  replaced without --overwrite, a killed save's temp files removed (RunDir)
  lock.py         train.lock: one run owns its output directory while it runs; a dead owner's
                  lock taken over (its pid gone on this host, or unrefreshed from another)
  preemption.py   SIGTERM/SIGINT stop at a step boundary, every process at the same step, so the
                  run resumes where it stopped
  errors.py       UsageError, WriteError, Diverged and the exit codes (0, 1, 2, 3, 4, 130, 143):
                  one line on stderr, the same code from every process
"""
