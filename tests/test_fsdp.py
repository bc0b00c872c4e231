"""helpers.fsdp: notebook 15's exported FSDP2 code (the meta-device build, shards, the step) and its machinery.

The FSDP lesson itself is written in notebooks/15-fsdp.ipynb, whose asserts check it.
Training runs in launched ranks only (a backward pass in this process would break later GPU forks).
"""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers import fsdp
from conftest import QUIET
from helpers.launch import launch


def test_global_batches_are_disjoint_and_seeded():
    with pytest.raises(ValueError, match="samples"):
        fsdp.global_batches(10, 3, 4)
    b = fsdp.global_batches(10, 2, 4, seed=1)
    assert b.shape == (2, 4) and len(set(b.flatten().tolist())) == 8
    assert torch.equal(b, fsdp.global_batches(10, 2, 4, seed=1))


def _held_rank(rank, world_size, *, reshard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    if reshard is not None:  # None: a plain model, no FSDP
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    held = fsdp.params_after_forward(model, x, y)
    grads_zeroed = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    return held, grads_zeroed


def test_params_after_forward_sees_what_resharding_frees():
    whole = (8 * 16 + 16 + 16 * 4 + 4) * 4
    plain = launch(functools.partial(_held_rank, reshard=None), 1, **QUIET)[0]
    kept = launch(functools.partial(_held_rank, reshard=False), 2, **QUIET)[0]
    freed = launch(functools.partial(_held_rank, reshard=True), 2, **QUIET)[0]
    assert plain == (whole, True) and kept == (whole, True)
    assert freed[0] < whole and freed[1]


def _sharded_rank(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = fsdp.sharded_model(8, 2, mesh, torch.device("cpu"), param_dtype=torch.bfloat16)
    shards = {n: (p.placements[0].dim, p.to_local().shape[0], p.shape[0], p.dtype) for n, p in model.named_parameters()}
    images, labels = torch.randn(4, 784), torch.randint(0, 10, (4,))
    loss = fsdp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), images, labels)
    return shards, float(loss)


def test_sharded_model_is_built_on_meta_and_holds_slices_of_dim_0():
    shards, loss = launch(_sharded_rank, 2, **QUIET)[0]
    assert loss > 0
    for name, (dim, local, full, dtype) in shards.items():
        assert dim == 0 and local == -(-full // 2) and dtype == torch.float32, name  # bf16 only for compute


def test_rank_slice_cuts_a_global_batch_into_equal_parts():
    images, labels = torch.arange(12.0).view(6, 2), torch.arange(6)
    dataset = torch.utils.data.TensorDataset(images, labels)
    batches = torch.tensor([[5, 4, 3, 2]])
    x, y = fsdp.rank_slice(dataset, batches, 0, 1, 2, torch.device("cpu"))
    assert y.tolist() == [3, 2] and torch.equal(x, images[[3, 2]])


# ---- the plan each notebook's launches get on a machine with GPUs (mocked): CPU ranks must get gloo ----

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# in a child, for each number of usable GPUs as helpers.devices counts them (NVML and its checks stand aside, the
# data stays unloaded): notebook {nb}'s parameters cell, then the plan each of its launches gets with its arguments
PLANS_ON_GPUS = """
import json, helpers.data, helpers.devices as devices
helpers.data.get_datasets = lambda *args, **kwargs: (None, None)
cells = json.load(open({nb!r}))["cells"]
cell = "".join(next(c["source"] for c in cells if c["cell_type"] == "code" and "ON_CPU =" in "".join(c["source"])))
for n in (1, 2, 3):
    devices._usable = lambda: (n, None)
    ns = {{}}
    exec(cell, ns)
    sizes = {{ns["W"], 1}} if "W" in ns else {{ns["SAVE_W"], *ns["LOAD_WS"]}}
    print(json.dumps({{"gpus": n, "on_cpu": ns["ON_CPU"], "plain": devices.plan(2).backend,
                      "backends": sorted({{devices.plan(w, backend=ns["QUIET"].get("backend")).backend for w in sizes}})}}))
"""


def plans_on_gpus(notebook: Path) -> list[dict]:
    env = dict(os.environ, SMOKE_TEST="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PLANS_ON_GPUS.format(nb=str(notebook))], env=env,
                         cwd=ROOT / "notebooks", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("notebook", ["15-fsdp", "16-distributed-checkpoints"])
def test_cpu_ranks_get_gloo_whatever_the_number_of_gpus(notebook):
    """On 2 GPUs notebook 16 runs its ranks on the CPU (3 ranks would share one), yet a plain launch of 2 would plan
    NCCL: init_device_mesh("cpu", ...) then sits on an NCCL-only group and the first CPU collective fails ("No backend
    type associated with device type cpu"). Every launch must pass backend="gloo" whenever ON_CPU."""
    plans = plans_on_gpus(ROOT / "notebooks" / f"{notebook}.ipynb")
    assert [p["gpus"] for p in plans] == [1, 2, 3]
    for p in plans:
        assert p["plain"] == ("nccl" if p["gpus"] >= 2 else "gloo"), p  # the mocked GPUs are seen
        assert p["backends"] == ["gloo" if p["on_cpu"] else "nccl"], p  # CPU ranks: gloo; a GPU per rank: NCCL
