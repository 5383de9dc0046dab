"""Real process groups for tests, examples and benchmarks of `cann_attn.distributed`
(docs/guides/context_parallel.md): `run_group(world, fn, *args)` spawns `world` processes (torch.multiprocessing,
127.0.0.1, a free port), initialises gloo (or NCCL with one GPU per rank), calls `fn(rank, world, device, *args)`
in each and returns every rank's result.

One process group at a time on this machine: spawns take an exclusive file lock, so parallel test workers
(pytest-xdist) queue instead of oversubscribing the CPU or racing for ports.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import pickle
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOCK_PATH = Path(tempfile.gettempdir()) / "cann_attn_process_group.lock"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_group_at_a_time():
    """An exclusive lock held while a process group runs."""
    with open(LOCK_PATH, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _worker(rank: int, world: int, port: int, backend: str, group_timeout: float, out_dir: str, fn, args) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout))
    try:
        result = fn(rank, world, device, *args)
    except BaseException as exc:  # reported to the parent, which raises
        result = {"__error__": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as handle:
        pickle.dump(result, handle)
    # A failure test leaves a broken group behind (a peer gone, a timed-out wait): leave at once instead of
    # tearing the group down.
    os._exit(0)


def run_group(world: int, fn, *args, backend: str = "gloo", group_timeout: float = 60.0,
              deadline: float = 600.0) -> list:
    """Every rank's return value of `fn(rank, world, device, *args)` (fn: a module-level function)."""
    with one_group_at_a_time(), tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world, free_port(), backend, group_timeout, out_dir, fn, args),
                                     nprocs=world, join=False, start_method="spawn")
        end = time.monotonic() + deadline
        while not context.join(timeout=1.0):
            if time.monotonic() > end:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"process group of {world} ranks did not finish within {deadline} s")
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited without a result")
            with open(path, "rb") as handle:
                results.append(pickle.load(handle))
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "__error__" in result:
            raise RuntimeError(f"rank {rank}: {result['__error__']}")
    return results
