"""PyTorch anchor for benches/norm.rs: F.layer_norm forward and backward (aten's
native_layer_norm_backward: dx, dweight, dbias) and F.rms_norm forward and backward (autograd's
backward of a retained graph: dx, dweight), plus a device-to-device copy, on the shapes given as arguments ("rows,d" pairs). Times with CUDA events, median of
repeats, rotating four input sets so that L2 holds none of them. Prints one JSON object:
{"copy_gbs": ..., "rows x d dtype op": seconds, ...}."""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
SETS, REPEATS = 4, 30


def timed(fn):
    for i in range(3):
        fn(i)
    start = [torch.cuda.Event(enable_timing=True) for _ in range(REPEATS)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(REPEATS)]
    for i in range(REPEATS):
        start[i].record()
        fn(i)
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end)) / 1e3


out = {"torch": torch.__version__}
n = 1 << 28
src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
out["copy_gbs"] = 2 * n / timed(lambda i: dst.copy_(src)) / 1e9

for shape in sys.argv[1:]:
    rows, d = map(int, shape.split(","))
    for name, dt in DTYPES.items():
        xs = [torch.randn(rows, d, device="cuda", dtype=dt) for _ in range(SETS)]
        gs = [torch.randn(rows, d, device="cuda", dtype=dt) for _ in range(SETS)]
        w = torch.randn(d, device="cuda", dtype=dt)
        b = torch.randn(d, device="cuda", dtype=dt)
        key = f"{rows}x{d} {name}"
        out[f"{key} layer_norm"] = timed(lambda i: F.layer_norm(xs[i % SETS], (d,), w, b, 1e-5))
        out[f"{key} rms_norm"] = timed(lambda i: F.rms_norm(xs[i % SETS], (d,), w, 1e-5))
        stats = [torch.ops.aten.native_layer_norm(x, [d], w, b, 1e-5) for x in xs]
        out[f"{key} layer_norm_vjp"] = timed(
            lambda i: torch.ops.aten.native_layer_norm_backward(
                gs[i % SETS], xs[i % SETS], [d], stats[i % SETS][1], stats[i % SETS][2], w, b, [True, True, True]
            )
        )
        # RMSNorm's backward as a training step runs it: the graph of one forward per input set,
        # kept, and only the backward timed.
        xr = [x.detach().requires_grad_(True) for x in xs]
        wr = w.detach().requires_grad_(True)
        ys = [F.rms_norm(x, (d,), wr, 1e-5) for x in xr]
        out[f"{key} rms_norm_vjp"] = timed(
            lambda i: torch.autograd.grad(ys[i % SETS], (xr[i % SETS], wr), gs[i % SETS], retain_graph=True)
        )
        del xs, gs, stats, xr, ys
print(json.dumps(out))
