"""Notebook 05, section 2: what breaks a forked rank, checked on the CPU.

- A backward pass in the parent: the autograd engine, the first time it runs, counts the devices it gives a thread
  each (not the CPU); where it finds one it registers a fork handler, and a child forked after that refuses its own
  backward (``Engine::start_device_threads`` / ``initialize_device_threads_pool`` in torch/csrc/autograd/engine.cpp).
  A machine without GPUs has no such device, so the notebook can show only the harmless case; here a stand-in
  device (torch's Python PrivateUse1 backend, reporting one device) gives the engine one on the CPU.
- torch's CPU thread pool: once the parent has computed with two threads, a forked child that computes with two
  waits forever for pool threads it does not have; with one thread (what the notebook's ``rank_main`` and
  ``launch`` set) it finishes.

Each case runs in a fresh Python: the stand-in device cannot be unregistered, and a hung child must not hang pytest.
"""

import subprocess
import sys

import pytest

AUTOGRAD = """
import multiprocessing as mp
import sys

import torch

if sys.argv[1] == "device":
    from torch.utils import backend_registration as br

    class OneDevice(br._DummyDeviceGuard):  # an accelerator with one device, as a GPU machine has
        def deviceCount(self):
            return 1

        def getDevice(self):
            return 0

        def setDevice(self, index):
            pass

        def uncheckedSetDevice(self, index):
            pass

        def exchangeDevice(self, index):
            return 0

    br._setup_privateuseone_for_python_backend(device_guard=OneDevice())


def backward():
    w = torch.ones(3, requires_grad=True)
    (2 * w).sum().backward()
    return w.grad.tolist()


def child(answers):
    try:
        answers.put(backward())
    except RuntimeError as e:
        answers.put(str(e))


if sys.argv[2] == "backward":
    backward()  # in the parent, before the fork
ctx = mp.get_context("fork")
answers = ctx.Queue()
proc = ctx.Process(target=child, args=(answers,))
proc.start()
print(answers.get(timeout=60))
proc.join(10)
"""

REFUSED = "Unable to handle autograd's threading in combination with fork-based multiprocessing"


@pytest.mark.parametrize("device, parent, refused", [
    ("device", "backward", True),  # a GPU machine: the notebook's "backward in the parent" mistake
    ("device", "no-backward", False),  # the same machine, no backward before the fork: fine
    ("none", "backward", False),  # a machine without GPUs (CI, notebook 05's CPU route): fine
])
def test_a_parent_s_backward_breaks_a_forked_child_s_backward_only_where_autograd_found_a_device(
        device, parent, refused):
    out = subprocess.run([sys.executable, "-c", AUTOGRAD, device, parent], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout.strip().splitlines()[-1]
    assert (REFUSED in said) == refused, said
    if not refused:
        assert said == "[2.0, 2.0, 2.0]"


THREADS = """
import multiprocessing as mp
import queue
import sys

import torch

parent_used_pool = sys.argv[1] == "pool"
if parent_used_pool:
    torch.set_num_threads(2)
    torch.ones(2_000_000).exp().sum()  # the parent's OpenMP pool now has a second thread


def child(answers, threads):
    torch.set_num_threads(threads)
    answers.put(torch.ones(2_000_000).exp().sum().item())


ctx = mp.get_context("fork")
answers = ctx.Queue()
proc = ctx.Process(target=child, args=(answers, int(sys.argv[2])))
proc.start()
try:
    print(answers.get(timeout=float(sys.argv[3])))
except queue.Empty:
    print("hung")
proc.kill()
proc.join()
"""


@pytest.mark.parametrize("parent, threads, hangs", [
    ("pool", 2, True),  # notebook 05's cell: the parent used two threads, the rank computes with two
    ("pool", 1, False),  # rank_main's (and launch's) one thread
    ("fresh", 2, False),  # the parent never used its pool: a child may use two
])
def test_a_child_forked_after_the_parent_used_its_thread_pool_hangs_with_more_than_one_thread(parent, threads, hangs):
    out = subprocess.run([sys.executable, "-c", THREADS, parent, str(threads), "6"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout.strip().splitlines()[-1]
    assert (said == "hung") == hangs, said
    if not hangs:
        assert float(said) > 0
