"""PyTorch anchor for benches/nccl.rs: torch.distributed.all_reduce (sum, float32, in place) over
NCCL, one process per GPU on GPUs 0 and 1 (torch.multiprocessing.spawn), NVLink multicast off.

Arguments: "repeats=N", then "BYTES:ITERS" pairs. For each size: ITERS calls of warm-up, then N
batches of ITERS calls, each started after a 1-element all_reduce (so that both ranks start
together) and timed with CUDA events; a rank's figure is its median batch, and the slower rank's
is kept. Prints one JSON object: {"torch": version, "nccl": version, "BYTES": seconds per call}."""
import json
import os
import socket
import statistics
import sys

# Before torch and NCCL read them, here and in the spawned workers (which inherit them).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2


def worker(rank, port, repeats, cases, results):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    flag = torch.zeros(1, device="cuda")
    out = {}
    for nbytes, iters in cases:
        t = torch.zeros(nbytes // 4, dtype=torch.float32, device="cuda")
        for _ in range(iters):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            dist.all_reduce(flag)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                dist.all_reduce(t)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device="cuda")
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[str(nbytes)] = slowest.item()
        del t
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_version():
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


if __name__ == "__main__":
    repeats, cases = 7, []
    for arg in sys.argv[1:]:
        if arg.startswith("repeats="):
            repeats = int(arg.split("=", 1)[1])
        else:
            nbytes, iters = arg.split(":")
            cases.append((int(nbytes), int(iters)))
    if torch.cuda.device_count() < WORLD:
        sys.exit(f"nccl_torch.py: needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    # Keep stdout for the JSON alone: NCCL_DEBUG and the workers write to fd 1, now stderr.
    json_out = os.dup(1)
    os.dup2(2, 1)
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(free_port(), repeats, cases, results), nprocs=WORLD, join=True)
    out = {"torch": torch.__version__, "nccl": nccl_version(), **results.get()}
    os.write(json_out, (json.dumps(out) + "\n").encode())
