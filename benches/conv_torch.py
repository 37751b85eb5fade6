"""cuDNN anchor for benches/conv.rs, through PyTorch: channels-last 1-D, 2-D and 3-D convolution
forward, backward-data and backward-weight (aten.convolution_backward with one output each),
with cudnn.benchmark on and TF32 off, on the shapes given as arguments ("N,C,H,W,K,R,S,stride,pad"
for 2-D, "N,C,D1xD2..,K,R1xR2..,stride,pad" for any rank). Times with CUDA events, median of
repeats; `--dtypes f16,bf16` first limits the dtypes; `--tf32` first turns TF32 on (kiln's
KILN_ALLOW_TF32 counterpart). Prints one JSON object:
{"SHAPE dtype pass": seconds, ...}."""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

torch.backends.cudnn.benchmark = True
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
REPEATS = 20


def timed(fn):
    for _ in range(3):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(REPEATS)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(REPEATS)]
    for i in range(REPEATS):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end)) / 1e3


def parse(shape):
    """(n, c, spatial, k, kernel, stride, pad, groups) from "N,C,H,W,K,R,S,stride,pad" (2-D)
    or "N,C,D1xD2..,K,R1xR2..,stride,pad" (any rank), either followed by ",gG" for G groups."""
    f = shape.split(",")
    groups = 1
    if f[-1].startswith("g"):
        groups = int(f.pop()[1:])
    if len(f) == 9:
        n, c, h, w, k, r, s, stride, pad = map(int, f)
        return n, c, [h, w], k, [r, s], stride, pad, groups
    n, c, sp, k, kr, stride, pad = f
    dims = lambda t: [int(v) for v in t.split("x")]
    return int(n), int(c), dims(sp), int(k), dims(kr), int(stride), int(pad), groups


def channels_last(t):
    """The same values laid out with channels innermost (kiln's layout)."""
    if t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return t.contiguous(memory_format=torch.channels_last_3d)
    return t.transpose(1, 2).contiguous().transpose(1, 2)


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

args = sys.argv[1:]
if args[:1] == ["--tf32"]:
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    args = args[1:]
if args[:1] == ["--dtypes"]:
    DTYPES = {d: DTYPES[d] for d in args[1].split(",")}
    args = args[2:]
out = {
    "torch": torch.__version__,
    "cudnn": torch.backends.cudnn.version(),
    "tf32": torch.backends.cudnn.allow_tf32,
}
for shape in args:
    n, c, spatial, k, kernel, stride, pad, groups = parse(shape)
    rank = len(spatial)
    conv = CONV[rank]
    for name, dt in DTYPES.items():
        x = channels_last(torch.randn(n, c, *spatial, device="cuda", dtype=dt))
        wt = channels_last(torch.randn(k, c // groups, *kernel, device="cuda", dtype=dt))
        y = conv(x, wt, stride=stride, padding=pad, groups=groups)
        gy = channels_last(torch.randn_like(y))

        def backward(mask):
            return lambda: torch.ops.aten.convolution_backward(
                gy, x, wt, None, [stride] * rank, [pad] * rank, [1] * rank, False,
                [0] * rank, groups, mask
            )

        key = f"{shape} {name}"
        out[f"{key} forward"] = timed(lambda: conv(x, wt, stride=stride, padding=pad, groups=groups))
        out[f"{key} backward_data"] = timed(backward([True, False, False]))
        out[f"{key} backward_weight"] = timed(backward([False, True, False]))
        del x, wt, y, gy
print(json.dumps(out))
