"""cuDNN anchor for benches/conv.rs, through PyTorch: channels-last 2-D convolution forward,
backward-data and backward-weight (aten.convolution_backward with one output each), with
cudnn.benchmark on and TF32 off, on the shapes given as arguments
("N,C,H,W,K,R,S,stride,pad"). Times with CUDA events, median of repeats. Prints one JSON object:
{"N,C,H,W,K,R,S,stride,pad dtype pass": seconds, ...}."""
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


out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
for shape in sys.argv[1:]:
    n, c, h, w, k, r, s, stride, pad = map(int, shape.split(","))
    for name, dt in DTYPES.items():
        cl = torch.channels_last
        x = torch.randn(n, c, h, w, device="cuda", dtype=dt).to(memory_format=cl)
        wt = torch.randn(k, c, r, s, device="cuda", dtype=dt).to(memory_format=cl)
        y = F.conv2d(x, wt, stride=stride, padding=pad)
        gy = torch.randn_like(y).to(memory_format=cl)

        def backward(mask):
            return lambda: torch.ops.aten.convolution_backward(
                gy, x, wt, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, mask
            )

        key = f"{shape} {name}"
        out[f"{key} forward"] = timed(lambda: F.conv2d(x, wt, stride=stride, padding=pad))
        out[f"{key} backward_data"] = timed(backward([True, False, False]))
        out[f"{key} backward_weight"] = timed(backward([False, True, False]))
        del x, wt, y, gy
print(json.dumps(out))
