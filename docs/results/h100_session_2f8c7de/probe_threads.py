"""Device-only probe (not shipped): run profile.py with host timers around the gpu backend's stages.
usage: python3 devcalls/probe_threads.py OUTFILE profile.py-args..."""
import atexit, json, os, runpy, statistics, sys, threading, time
sys.path.insert(0, os.getcwd())
import torch.utils.data.dataloader as dl
import utils.gpu_batches as gb

out_path = sys.argv.pop(1)
log = []  # (stage, thread, start, end)

def timed(stage, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            log.append((stage, threading.current_thread().name, t, time.perf_counter()))
    return wrapper

gb.GpuBatchDecoder.decode_stage = timed("decode_stage", gb.GpuBatchDecoder.decode_stage)
gb.GpuBatchDecoder.resample_ahead = timed("resample_ahead", gb.GpuBatchDecoder.resample_ahead)
gb.GpuBatchDecoder._decode_jpegs = timed("decode_jpegs", gb.GpuBatchDecoder._decode_jpegs)
gb.GpuBatchDecoder.decode = timed("decode", gb.GpuBatchDecoder.decode)
if os.environ.get("PROBE_SWITCH"):
    sys.setswitchinterval(float(os.environ["PROBE_SWITCH"]))
    print("probe: switch interval", sys.getswitchinterval())
_dinit = gb.GpuBatchDecoder.__init__
def dinit(self, *a, **k):
    _dinit(self, *a, **k)
    import torch
    if self.cuda and os.environ.get("PROBE_RESAMPLE_PRIORITY"):
        self.stream = torch.cuda.Stream(self.device, priority=int(os.environ["PROBE_RESAMPLE_PRIORITY"]))
        print("probe: resample stream priority", self.stream.priority)
    if self.cuda and os.environ.get("PROBE_DECODE_PRIORITY"):
        self.decode_stream = torch.cuda.Stream(self.device, priority=int(os.environ["PROBE_DECODE_PRIORITY"]))
        print("probe: decode stream priority", self.decode_stream.priority)
gb.GpuBatchDecoder.__init__ = dinit
if os.environ.get("PROBE_HW_OPTIONS"):
    from nvidia import nvimgcodec
    _decoder = nvimgcodec.Decoder
    nvimgcodec.Decoder = lambda *a, **k: _decoder(*a, options=os.environ["PROBE_HW_OPTIONS"], **k)
    print("probe: nvImageCodec options", os.environ["PROBE_HW_OPTIONS"])
gb.GpuBatchDecoder.hand_over = staticmethod(timed("hand_over", gb.GpuBatchDecoder.hand_over))
dl._MultiProcessingDataLoaderIter.__next__ = timed("loader_next", dl._MultiProcessingDataLoaderIter.__next__)
_get = gb.queue.Queue.get
_put = gb.queue.Queue.put
gb.queue.Queue.get = lambda self, *a, **k: timed("queue_get", _get)(self, *a, **k)
gb.queue.Queue.put = lambda self, *a, **k: timed("queue_put", _put)(self, *a, **k)

if os.environ.get("PROBE_AHEAD"):
    gb.GpuBatches.AHEAD = int(os.environ["PROBE_AHEAD"])
    print("probe: GpuBatches.AHEAD =", gb.GpuBatches.AHEAD)
_init = gb.WorkAhead.__init__
def named_init(self, loader, decode, depth, *a, **k):
    _init(self, loader, decode, depth, *a, **k)
    self._thread.name = "decode" if depth == 1 else "resample"
gb.WorkAhead.__init__ = named_init

def dump():
    with open(out_path, "w") as f:
        json.dump(log, f)
    if not log:
        return
    taken = sorted(b for stage, _, b, _ in log if stage == "hand_over")
    if len(taken) < 60:
        return
    start, last = taken[-60], taken[-1]  # the profile window: its last 60 batches taken
    print(f"== thread stages over the window ({(last - start) / 59 * 1e3:.1f} ms a step): ms per call, share of the window busy")
    for stage, thread in sorted({(s, th) for s, th, *_ in log}):
        ds = [(min(e, last) - max(b, start)) * 1e3 for s, th, b, e in log
              if s == stage and th == thread and e >= start and b <= last]
        if ds:
            print(f"  {stage:<15}{thread:<11} n {len(ds):3d} mean {statistics.mean(ds):7.2f} median "
                  f"{statistics.median(ds):7.2f} max {max(ds):7.2f} busy {sum(ds) / 1e3 / (last - start) * 100:5.1f}%")
atexit.register(dump)
sys.argv = ["profile.py"] + sys.argv[1:]
runpy.run_path("profile.py", run_name="__main__")
