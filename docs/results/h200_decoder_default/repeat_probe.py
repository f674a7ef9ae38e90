"""Does torchvision's batched CUDA decode give the same pixels every time? Decode one batch of files
N times (synchronised), count images that differ from the first decode, and their max abs difference."""
import glob, sys, torch
from torchvision.io import decode_jpeg, ImageReadMode
root, count, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
files = sorted(glob.glob(f"{root}/train/*/*.*"))[:count]
data = [torch.frombuffer(bytearray(open(f, "rb").read()), dtype=torch.uint8) for f in files]
first = [x.clone() for x in decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")]
torch.cuda.synchronize()
bad, worst, noise = set(), 0, []
for r in range(repeats):
    noise.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(r * 37 % 251))  # dirty memory
    if len(noise) > 3:
        noise.pop(0)
    out = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(first, out)):
        if a.shape != b.shape or not torch.equal(a, b):
            bad.add(i)
            worst = max(worst, int((a.int() - b.int()).abs().max()) if a.shape == b.shape else 999)
shape = tuple(first[0].shape)
print(f"{root}: {len(files)} files (first {shape}), {repeats} repeats: {len(bad)} images ever differed, max abs diff {worst}")
