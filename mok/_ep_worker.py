"""Run a function on R local processes joined in one process group: the launcher of the EP
reference's tests and notebooks (`mok.comm.run_local_ep`).

Ranks start from a forkserver that has imported torch once (or are spawned where there is none).
Rendezvous through a FileStore in a fresh temporary directory (no TCP port to race for). Arguments
and results travel as torch.save files in that directory, so tensors need no shared-memory handles
that outlive their process. Nothing waits forever: the process group carries a timeout, the parent
a deadline, and the first rank that fails stops the others.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import tempfile
import time
import traceback

import torch


def _rank_main(fn, rank: int, world_size: int, tmp: str, backend: str, timeout_s: float,
               num_threads: int | None) -> None:
    """Entry point of one spawned rank: join the group, run fn(rank, world_size, *args), save."""
    import torch.distributed as dist

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=dist.FileStore(os.path.join(tmp, "store"), world_size),
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        args = torch.load(os.path.join(tmp, "args.pt"), weights_only=False)
        result = fn(rank, world_size, *args)
        part = os.path.join(tmp, f"result_{rank}.pt.part")
        torch.save(result, part)
        os.replace(part, os.path.join(tmp, f"result_{rank}.pt"))
    except BaseException:  # noqa: BLE001 (whatever it is, the parent must get it, not a hang)
        with open(os.path.join(tmp, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_ep(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0,
                 num_threads: int | None = 1, start_method: str | None = None) -> list:
    """Spawn world_size processes, run fn(rank, world_size, *args) on each inside a default process
    group, and return [result of rank 0, ..., result of rank R-1].

    fn must be importable by name (a module-level function). backend "gloo" runs on CPU; "nccl" gives
    rank r GPU r. num_threads sets torch's intra-op threads per rank (1 by default: R processes share
    the cores). start_method: "forkserver" where the platform has it (default: one server process
    imports torch once, every later world forks from it in a fraction of a second, where "spawn" pays
    the torch import in every rank of every world), else "spawn".
    Raises RuntimeError with the failing rank's traceback, TimeoutError past timeout_s."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    ctx = torch.multiprocessing.get_context(start_method)
    if start_method == "forkserver":  # takes effect when the server starts, i.e. on the first call
        ctx.set_forkserver_preload(["torch", "torch.distributed", "mok.comm", "mok.reference"])
    with tempfile.TemporaryDirectory(prefix="mok_ep_") as tmp:
        torch.save(args, os.path.join(tmp, "args.pt"))
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, r, world_size, tmp, backend, timeout_s, num_threads))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s + 30.0  # + start-up; the group timeout fires first
        while any(p.is_alive() for p in procs):
            failed = any(p.exitcode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        for p in procs:  # only our own children, by handle
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
            p.join()

        errors = []  # first failure first: the others are often its echo (a peer closed the link)
        paths = [os.path.join(tmp, f"error_{r}.txt") for r in range(world_size)]
        for r, path in sorted(((r, p) for r, p in enumerate(paths) if os.path.exists(p)),
                              key=lambda rp: os.stat(rp[1]).st_mtime_ns):
            with open(path) as f:
                errors.append(f"rank {r}:\n{f.read()}")
        if errors:
            raise RuntimeError(f"run_local_ep({getattr(fn, '__name__', fn)}, world_size={world_size}) "
                               "failed on " + "\n".join(errors))
        missing = [r for r in range(world_size) if not os.path.exists(os.path.join(tmp, f"result_{r}.pt"))]
        if missing:
            codes = [p.exitcode for p in procs]
            raise TimeoutError(f"run_local_ep: ranks {missing} returned nothing within {timeout_s} s "
                               f"(exit codes {codes})")
        return [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False)
                for r in range(world_size)]
