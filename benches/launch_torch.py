"""PyTorch anchor for benches/launch.rs: a chain of tiny in-place adds, eager and CUDA-graph
replay, microseconds per op (median of repeats). Prints one JSON object."""
import json
import statistics
import time

import torch

OPS, REPEATS = 1000, 20
x = torch.zeros(1, device="cuda")


def chain():
    for _ in range(OPS):
        x.add_(1.0)


def timed(fn):
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / OPS * 1e6)
    return statistics.median(times)


for _ in range(3):
    chain()
eager = timed(chain)
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    chain()
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g):
    chain()
g.replay()
graph = timed(g.replay)
print(json.dumps({"torch": torch.__version__, "eager_us": eager, "graph_replay_us": graph}))
