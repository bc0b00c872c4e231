"""helpers.fsdp: notebook 17's exported FSDP2 recipe (``shard``), which notebook 18 and the tests shard the GPT with.

The FSDP lesson itself is written in notebooks/16-fsdp.ipynb and 17-fsdp-in-production.ipynb, whose asserts check it.
Training runs in launched ranks only (a backward pass in this process would break later GPU forks).
"""

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from helpers import fsdp
from conftest import QUIET
from helpers.launch import launch


def _recipe_rank(rank, world_size, *, param_dtype=None, checkpointing=False):
    from helpers.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=8, n_layer=2, n_head=2, d_model=8))
    names = [n for n, _ in model.named_parameters()]
    fsdp.shard(model, init_device_mesh("cpu", (world_size,)), param_dtype=param_dtype, checkpointing=checkpointing,
               prefetch=True)
    saved = []
    x = torch.randint(0, 256, (2, 8))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logits = model(x)
    logits.float().sum().backward()
    shards = {n: (p.placements[0].dim, p.to_local().shape[0], p.shape[0], p.dtype, p.grad.dtype)
              for n, p in model.named_parameters()}
    return names, shards, logits.dtype, sum(saved)


def test_shard_keeps_names_shards_dim_0_and_follows_its_options():
    plain = launch(_recipe_rank, 2, **QUIET)[0]
    recipe = launch(functools.partial(_recipe_rank, param_dtype=torch.bfloat16, checkpointing=True), 2, **QUIET)[0]
    for names, shards, _, _ in (plain, recipe):
        assert list(shards) == names  # checkpointing wraps forward only: the state dict's names stay
        for name, (dim, local, full, dtype, grad_dtype) in shards.items():
            assert dim == 0 and local == -(-full // 2) and dtype == grad_dtype == torch.float32, name
    assert plain[2] == torch.float32 and recipe[2] == torch.float32  # bf16 compute, float32 logits at the root
    assert recipe[3] < plain[3] / 2  # checkpointed blocks keep their input only


def _plain_rank(rank, world_size):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.debug import CommDebugMode

    from helpers.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=8, n_layer=3, n_head=2, d_model=8))
    fsdp.shard(model, init_device_mesh("cpu", (world_size,)))
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    with CommDebugMode() as comm:
        model(torch.randint(0, 256, (2, 8))).sum().backward()
    return units, {str(op).split(".")[-1].strip("_"): n for op, n in comm.get_comm_counts().items()}


def test_shard_without_options_is_notebook_15_s_fully_shard_per_block_and_at_the_root():
    units, comms = launch(_plain_rank, 2, **QUIET)[0]
    assert units == ["", "blocks.0", "blocks.1", "blocks.2"]  # the root and one unit per block
    assert comms == {"allgather_base": 2 * 3 + 1, "reduce_scatter_base": 3 + 1}  # blocks gathered twice, root once


# ---- the plan each notebook's launches get on a machine with GPUs (mocked): CPU ranks must get gloo ----

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# in a child, for each number of usable GPUs as helpers.devices counts them (NVML and its checks stand aside, the
# data stays unloaded): notebook {nb}'s parameters cell, then the plan each of its launches gets from the cell's own
# launch options (QUIET's plan: devices.plan_launch, chosen per launch)
PLANS_ON_GPUS = """
import json, math, helpers.data, helpers.devices as devices
helpers.data.get_datasets = lambda *args, **kwargs: (None, None)
cells = json.load(open({nb!r}))["cells"]
cell = "".join(next(c["source"] for c in cells
                    if c["cell_type"] == "code" and "plan=devices.plan_launch" in "".join(c["source"])))
for n in (1, 2, 3):
    devices._usable = lambda: (n, None)
    ns = {{}}
    exec(cell, ns)
    sizes = {{ns["W"], 1, math.prod(ns.get("HSDP", ()))}} if "W" in ns else {{ns["SAVE_W"], *ns["LOAD_WS"]}}
    plans = {{w: ns["QUIET"]["plan"](w) for w in sorted(sizes)}}
    print(json.dumps({{"gpus": n, "plain": devices.plan(2).backend, "launches": {{
        str(w): [p.devices[0].type, p.backend, len({{str(d) for d in p.devices}})] for w, p in plans.items()}}}}))
"""


def plans_on_gpus(notebook: Path) -> list[dict]:
    env = dict(os.environ, SMOKE_TEST="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PLANS_ON_GPUS.format(nb=str(notebook))], env=env,
                         cwd=ROOT / "notebooks", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("notebook", ["16-fsdp", "17-fsdp-in-production", "18-distributed-checkpoints"])
def test_cpu_ranks_get_gloo_whatever_the_number_of_gpus(notebook):
    """Each launch of 15, 17 and 18 is planned on its own (devices.plan_launch): a launch that fits the usable GPUs puts one
    rank on each over NCCL; one that needs more ranks than GPUs runs every rank on the CPU over gloo, never a CPU rank
    on an NCCL group (init_device_mesh("cpu", ...) on NCCL fails: "No backend type associated with device type cpu")
    and never two ranks on one GPU."""
    plans = plans_on_gpus(ROOT / "notebooks" / f"{notebook}.ipynb")
    assert [p["gpus"] for p in plans] == [1, 2, 3]
    for p in plans:
        assert p["plain"] == ("nccl" if p["gpus"] >= 2 else "gloo"), p  # the mocked GPUs are seen
        for w, launch in p["launches"].items():
            fits = int(w) <= p["gpus"]
            assert launch == (["cuda", "nccl", int(w)] if fits else ["cpu", "gloo", 1]), (w, p)
    assert any(launch[0] == "cuda" for p in plans for launch in p["launches"].values())  # a GPU route is reached
