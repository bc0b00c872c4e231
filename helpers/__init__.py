"""Reusable launch and training code for the multigpu-notebooks course.

Importing this package sets two environment variables, for fork-safety and for
honest labels: it asks torch to answer ``torch.cuda.is_available()`` through
NVML, as ``device_count()`` already does, so that neither creates a CUDA context
in the notebook and a later fork of training ranks stays safe (see
``helpers.launch``); and it numbers CUDA's GPUs in PCI bus order, as NVML does
(``CUDA_DEVICE_ORDER=PCI_BUS_ID``), unless the environment already chose.
"""

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# NVML numbers GPUs by PCI bus, CUDA by default puts the fastest first: on a box with mixed GPU models the
# cuda:i that NVML's names and memory are read for would be another GPU. One order for both, set before CUDA starts.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def smoke_test() -> bool:
    """True when SMOKE_TEST=1 asks every notebook to shrink its sizes (CI does).

    Introduced in notebooks/00-check-environment.ipynb.
    """
    return os.environ.get("SMOKE_TEST", "0").strip().lower() in {"1", "true", "yes"}


class Stopped(Exception):
    """A run was stopped on request (a panel's Stop button); ``partial`` holds what was done so far.

    Introduced in notebooks/01-single-gpu.ipynb.
    """

    def __init__(self, message: str = "stopped on request", partial=None):
        super().__init__(message)
        self.partial = partial
