"""The child's side of ``helpers.launch``: what a forked rank does before and after ``fn``."""

from __future__ import annotations

import ctypes
import faulthandler
import io
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from .devices import gpu_count, shm_gib

_QUEUE = None  # set in a launched rank: where report() and prints go
_RANK = None
_DEVICE = None
# The process group's own timeout is launch's plus this margin, so launch's clock always runs out first: a rank
# left waiting in a collective is then reported as stuck (RankTimeout, with every rank's stack) instead of racing
# to fail on its own with a bare "Timed out waiting ... for recv" (RankFailed).
GROUP_TIMEOUT_MARGIN_S = 60


def rank_device() -> torch.device:
    """The device this rank should use: the plan's under ``launch``, else from LOCAL_RANK.

    Under torchrun (no plan), rank r gets cuda:r when that GPU exists, else the CPU.
    Introduced in notebooks/00-check-environment.ipynb.
    """
    if _DEVICE is not None:
        return _DEVICE
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local < gpu_count():
        return torch.device("cuda", local)
    return torch.device("cpu")


def report(**metrics) -> None:
    """Send numbers (step, total, loss, samples_per_s, ...) from a rank to the notebook.

    ``step`` counts what is done, 1 … ``total`` (report after the step), which is what rank 0's progress bar shows.

    The parent receives them as ``on_event(rank, metrics)`` and draws; a rank
    itself never touches widgets or plots. Outside a ``launch`` (under
    torchrun, say) this does nothing, so the same function runs in both.
    Introduced in notebooks/04-ddp.ipynb.
    """
    if _QUEUE is None:
        return
    clean = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
    clean.setdefault("t", time.time())
    _QUEUE.put(("event", _RANK, clean))


class _QueueWriter(io.TextIOBase):
    """stdout/stderr of a rank: whole lines go to the parent, which prefixes them."""

    def __init__(self, queue, rank):
        self.queue, self.rank, self.buf = queue, rank, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self.queue.put(("print", self.rank, line))
        return len(text)

    def flush(self) -> None:
        if self.buf:
            self.queue.put(("print", self.rank, self.buf))
            self.buf = ""


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this rank if the notebook's kernel dies first."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's kill_all is the only guard
    if os.getppid() != parent_pid:
        os._exit(1)


def _loopback() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, torch.nn.Module):
        return obj.cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


# What a rank's error says → the fix, for the failures learners meet most (first match wins). Each pattern is a
# piece of the message torch itself prints.
HINTS = [
    (("re-initialize CUDA in forked subprocess",),
     "restart the kernel and keep every CUDA call inside the launched function."),
    # a child forked after the parent's CUDA driver woke up: cudaGetDeviceCount fails (c10/cuda/CUDAFunctions.cpp),
    # or the first CUDA call does; on a GPU machine, a parent's backward also left autograd's device threads
    # behind (torch/csrc/autograd/engine.cpp, Engine::start_device_threads), and a child's backward refuses
    (("CUDA error: initialization error", "CUDA driver initialization failed, you might not have a CUDA gpu",
      "Unable to handle autograd's threading in combination with fork-based multiprocessing"),
     "the notebook's process probably ran a backward pass (autograd) before forking, which leaves forked children "
     "unable to start CUDA, or to run backward on a machine with GPUs. Restart the kernel and run all training "
     "inside the launched function (launch(fn, 1) for one process)."),
    (("driver version is insufficient",),
     "the NVIDIA driver is older than torch's CUDA build; see helpers.devices.driver_check()."),
    (("Duplicate GPU",), "NCCL needs one GPU per rank; use backend='gloo' or fewer ranks."),
    (("EADDRINUSE", "address already in use"),
     "another program took the port that launch had picked before rank 0 could open it; run the cell again "
     "(launch picks a new free port each time)."),
    (("default process group has not been initialized",),
     "launch with init=True (the default), or call init_process_group in fn."),
    (("CUDA out of memory", "OutOfMemoryError"),
     "the GPU ran out of memory: use a smaller batch per rank, or fewer ranks per GPU (ranks sharing a GPU each "
     "hold their own model, optimizer state, activations and CUDA context)."),
    (("out of shared memory", "Bus error"),
     "a DataLoader worker ran out of shared memory (/dev/shm, {shm}; Docker gives a container 64 MB): start the "
     "container with --shm-size=2g (or --ipc=host), or use fewer DataLoader workers (num_workers=0 uses none)."),
    (("unhandled system error", "NCCL error"),
     "NCCL failed below torch: rerun with NCCL_DEBUG=INFO to see why; on consumer GPUs without peer-to-peer "
     "links set NCCL_P2P_DISABLE=1; in a container give it more shared memory (--shm-size=2g or --ipc=host)."),
    (("Watchdog caught collective operation timeout",),
     "a collective (all_reduce, barrier) waited past its timeout: usually some rank skipped it, took another "
     "branch or died. Rerun with NCCL_DEBUG=INFO and TORCH_DISTRIBUTED_DEBUG=INFO to see which."),
    # bf16 on a GPU below compute capability 8.0 (T4, V100) never gets here: torch skips cuDNN for bf16
    # convolutions there (ConvParams::use_cudnn, aten/src/ATen/native/Convolution.cpp, asks
    # supportsBFloat16ConvolutionWithCuDNNv8, true from 8.0) and runs its own kernels, slowly
    (("unable to find an engine to execute this computation", "CUDNN_STATUS_NOT_SUPPORTED"),
     "cuDNN has no kernel for this convolution with these sizes, memory layout and precision: try another "
     "precision (fp32, or fp16 with torch.amp.GradScaler), or set torch.backends.cudnn.enabled = False in the rank "
     "function to run torch's own kernels (slower). bf16 on a GPU before Ampere (T4, V100) does not fail this way: "
     "it runs, slowly, without cuDNN; those GPUs train faster in fp16."),
    (("were not used in producing loss",),
     "some parameters took no part in the loss, so DDP waited for their gradients: make every parameter take "
     "part in each step, or wrap with DDP(model, find_unused_parameters=True) (slower); "
     "TORCH_DISTRIBUTED_DEBUG=INFO names them."),
]


def _hint(err: BaseException) -> str:
    """A one-line fix after the traceback, for the failures in HINTS; empty for anything else.

    The whole chain of causes is read: a DataLoader says only "worker exited unexpectedly", and its cause says
    "killed by signal: Bus error".
    """
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    text = "\n".join(chain)
    for patterns, fix in HINTS:
        if any(p.lower() in text.lower() for p in patterns):
            if "{shm}" in fix:
                shm = shm_gib()
                fix = fix.format(shm=f"{shm:g} GiB here" if shm is not None else "size unknown here")
            return "\nFix: " + fix
    return ""


def child_main(fn, rank, world_size, args, plan, port, queue, stack_file, result_file, init, timeout, parent_pid):
    """Body of a forked rank: isolate, set up, run ``fn``, send back its result or error."""
    global _QUEUE, _RANK, _DEVICE
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not the parent's handler of the moment (deferred)
    os.setpgrp()  # its own process group, so the parent can kill it with its DataLoader workers
    _die_with_parent(parent_pid)
    _QUEUE, _RANK = queue, rank
    torch.set_num_threads(1)  # see launch's docstring: more threads can hang after fork
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME=_loopback(), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    sys.stdout = sys.stderr = _QueueWriter(queue, rank)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    code = 0
    try:
        device = _DEVICE = plan.devices[rank]  # rank_device() answers it, with or without init
        # a rank planned onto the CPU (devices.plan_launch's CPU plan, a CPU machine) calls nothing in torch.cuda:
        # no set_device, no context (tests/test_gpu_routes.py counts its CUDA calls with GPUs mocked)
        if init and device.type == "cuda":  # init=False: fn binds its own device, as a torchrun script does
            torch.cuda.set_device(device)
        if init:
            # NCCL wants to know its device up front (else barrier() warns and guesses)
            bound = {"device_id": device} if plan.backend == "nccl" else {}
            dist.init_process_group(plan.backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout + GROUP_TIMEOUT_MARGIN_S), **bound)
        result = fn(rank, world_size, *args)
        if dist.is_initialized():  # fn may have torn the group down itself, as scripts do
            dist.barrier()
            dist.destroy_process_group()
        # into the rank's own file, not the queue: a rank killed in the middle of a large pipe write would leave
        # the parent waiting for the rest of the message. torch.save, so that the parent can load every tensor,
        # however deeply nested, onto the CPU (map_location) without starting CUDA in the notebook.
        torch.save(_to_cpu(result), result_file)
        result_file.flush()
        sys.stdout.flush()
        queue.put(("result", rank))
    except BaseException as err:  # everything, KeyboardInterrupt included, goes to the parent
        sys.stdout.flush()
        queue.put(("error", rank, f"{type(err).__name__}: {err}", traceback.format_exc() + _hint(err)))
        code = 1
    queue.close()
    queue.join_thread()
    os._exit(code)
