"""launch's CUDA canary runs a kernel: a GPU that allocates but has no kernel image for torch's build is caught."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.procs import cuda_canary

NO_IMAGE = "CUDA error: no kernel image is available for execution on the device"


class AllocatesButRunsNoKernel(TorchDispatchMode):
    """A device as a V100 is to the CUDA 13 wheels: memory can be allocated, and every kernel fails."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
            return func(*args, **(kwargs or {}))  # an allocation runs no kernel
        raise RuntimeError(NO_IMAGE)


def test_the_canary_fails_on_a_device_that_allocates_but_has_no_kernel_image():
    cpu = torch.device("cpu")  # the canary binds no CUDA device for it; the mode stands in for the missing images
    assert cuda_canary(cpu) is None
    with AllocatesButRunsNoKernel():  # the forked canary inherits the mode, as it would inherit the GPU's lack
        said = cuda_canary(cpu)
    assert said == f"RuntimeError: {NO_IMAGE}", said
