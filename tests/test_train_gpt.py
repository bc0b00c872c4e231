"""scripts/train_gpt.py under torchrun: 8 workers as pp=2 x dp=2 x tp=2 (1F1B stages, 19's sequence-parallel plan,
FSDP2, clipping), periodic async DCP checkpoints, an exact resume on other meshes (AdamW's state loaded bit for bit,
the losses after it equal in float64), its sizing from the device, and helpers.mfu's peaks and arithmetic
(notebooks/21-gpt-capstone.ipynb)."""

from __future__ import annotations

import functools
import importlib.util
import json
import types
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers import mfu, torchrun

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_gpt.py"
TINY = ["--size", "smoke", "--n-layer", "2", "--d-model", "32", "--seq-len", "32", "--batch", "8", "--steps", "8",
        "--eval-batches", "1", "--dtype", "float64", "--micro", "2", "--max-norm", "0.5"]
SAVE_EVERY, SAVE_AT = 2, 4


def _script():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args, nproc, env=None) -> tuple[dict, torchrun.Finished]:
    events = {}

    def on_line(name, line, procs):
        if line.startswith("{"):
            event = json.loads(line)
            events.setdefault(event["event"], []).append(event)

    cmd = torchrun.torchrun_command([str(a) for a in args], nproc=nproc, script=SCRIPT)
    out = torchrun.run({"torchrun": cmd}, timeout=300, echo=False, on_line=on_line, env=env, check=False)["torchrun"]
    return events, out


def _left_over(path) -> list:
    found = []
    for proc in psutil.process_iter():
        try:
            if str(path) in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def _whole_state(folder: Path) -> dict:
    """A DCP checkpoint read whole by this one process: the whole GPT's weights and AdamW state by parameter name."""
    whole = folder.with_name(folder.name + ".pt")
    dcp_to_torch_save(folder, whole)  # every worker's slices, put together (no process group)
    return torch.load(whole, map_location="cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted run: 8 workers, pp=2 x dp=2 x tp=2, float64, async DCP checkpoints every SAVE_EVERY steps."""
    root = tmp_path_factory.mktemp("gpt")
    events, out = _run(TINY + ["--pp", 2, "--tp", 2, "--checkpoint-dir", root / "ckpt", "--save-every", SAVE_EVERY,
                               "--async-save", "--dump-state", root / "dump", "--eval-every", 4], 8)
    assert out.returncode == 0, out.text[-3000:]
    return events, root


def test_the_script_trains_on_a_3d_mesh_and_ends_its_processes(saved):
    events, root = saved
    start = events["start"][0]
    assert (start["world"], start["pp"], start["dp"], start["tp"], start["dtype"]) == (8, 2, 2, 2, "float64")
    losses = [e["loss"] for e in events["step"]]
    assert [e["step"] for e in events["step"]] == list(range(1, 9))
    assert losses[-1] < losses[0]  # it learns
    assert any(e["grad_norm"] > 0.5 for e in events["step"])  # clipping acts
    assert [(e["step"], e["blocking"]) for e in events["save"]] == [(s, False) for s in (2, 4, 6, 8)]  # async
    assert [e["step"] for e in events["eval"]] == [0, 4, 8]
    assert sorted(p.name for p in (root / "ckpt" / f"step-{SAVE_AT}").iterdir()) == \
        [".metadata"] + [f"__{r}_0.distcp" for r in range(8)] + ["course.json"]
    final = _whole_state(root / "ckpt" / "step-8")  # both stages' names: the whole GPT's
    assert {n.split(".")[0] for n in final["model"]} == {"tok", "pos", "blocks", "norm", "head"}
    assert not _left_over(root)


@pytest.mark.parametrize("pp,tp,nproc,threads", [(1, 1, 4, 1), (2, 1, 2, 2)],
                         ids=["pp1xdp4xtp1", "pp2xdp1xtp1-2threads"])
def test_a_resume_on_another_mesh_is_exact(saved, pp, tp, nproc, threads):
    """Saved by pp=2 x dp=2 x tp=2, resumed by fewer workers split another way (another summation order): the
    loaded model and AdamW state equal the saved ones bit for bit, and the 3 losses after the resume are the
    uninterrupted run's. float64: ~1e-16 apart by rounding; a wrong slice or a lost AdamW moment moves them by
    >= 1e-4."""
    events, root = saved
    dump = root / f"dump-{pp}-{tp}"
    resumed, out = _run(TINY + ["--pp", pp, "--tp", tp, "--resume", root / "ckpt" / f"step-{SAVE_AT}",
                                "--stop-at", SAVE_AT + 3, "--dump-state", dump], nproc,
                        env={"OMP_NUM_THREADS": str(threads)})
    assert out.returncode == 0, out.text[-3000:]
    first = resumed["start"][0]
    assert (first["pp"], first["dp"], first["tp"]) == (pp, nproc // (pp * tp), tp)
    before, after = _whole_state(root / "dump" / f"saved-{SAVE_AT}"), _whole_state(dump / f"loaded-{SAVE_AT}")
    assert {n.split(".")[0] for n in before["model"]} == {"tok", "pos", "blocks", "norm", "head"}  # read whole
    for part in ("model", "optim"):
        assert before[part].keys() == after[part].keys()
        for key, value in before[part].items():
            same = torch.equal(value, after[part][key]) if torch.is_tensor(value) else value == after[part][key]
            assert same, key
    assert sum(k.endswith(("exp_avg", "exp_avg_sq", "step")) for k in before["optim"]) == 3 * len(before["model"])
    main = {e["step"]: e["loss"] for e in events["step"]}
    gaps = [abs(e["loss"] - main[e["step"]]) / main[e["step"]] for e in resumed["step"]]
    assert [e["step"] for e in resumed["step"]] == [SAVE_AT + 1, SAVE_AT + 2, SAVE_AT + 3]
    print(f"pp={pp} x tp={tp}, {threads} thread(s): relative gaps {gaps}")
    assert max(gaps) < 1e-10, gaps
    assert not _left_over(root)


def test_a_foreign_checkpoint_is_refused(saved):
    _, root = saved
    args = [a if a != "32" else "48" for a in TINY]  # another width and window
    _, out = _run(args + ["--pp", 1, "--tp", 1, "--resume", root / "ckpt" / f"step-{SAVE_AT}"], 1)
    assert out.returncode != 0 and "was written with" in out.text


def test_sizes_are_chosen_from_the_device(monkeypatch):
    assert mfu.choose_size("cpu") == "cpu" and mfu.choose_size("cuda", 80, smoke=True) == "smoke"
    assert mfu.choose_size("cuda", 15.6) == "gpu-16g" and mfu.choose_size("cuda", 23.7) == "gpu-16g"
    assert mfu.choose_size("cuda", 79.2) == "gpu-40g" and mfu.choose_size("cuda", 139.8) == "gpu-40g"
    with pytest.raises(ValueError, match="mps"):
        mfu.choose_size("mps")
    for name, size in mfu.SIZES.items():  # every size splits over pp=2 stages, tp=2 heads and dp=2 x 2 micro-batches
        assert size["d_model"] % size["n_head"] == 0 and size["n_head"] % 2 == 0 and size["batch"] % 4 == 0, name
        assert size["n_layer"] % 2 == 0 and size["seq_len"] % 2 == 0, name
    script = _script()
    args = script.parse_args(["--size", "auto"])
    peak_of = functools.partial(mfu.run_peak, given=args.peak_flops)  # the script's call
    for memory, want in ((16 * 2**30, "gpu-16g"), (80 * 2**30, "gpu-40g")):  # a mocked GPU of that memory
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, m=memory: types.SimpleNamespace(
            total_memory=m))
        cfg, size = script.sizes(args, torch.device("cuda", 0))
        assert size["name"] == want and cfg.d_model == mfu.SIZES[want]["d_model"]
    cfg, size = script.sizes(script.parse_args(["--size", "auto", "--d-model", "96"]), torch.device("cpu"))
    assert size["name"] == "cpu" and cfg.d_model == 96  # an override wins
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    peak, label = peak_of(gpu, 1, torch.bfloat16)
    assert peak == 989e12 and label == "datasheet dense bf16 x 1"
    assert peak_of(torch.device("cpu"), 8, torch.float64) == (None, "not given")
    assert peak_of(gpu, 4, torch.bfloat16)[0] == 4 * 989e12  # the global batch on 4 GPUs
    # float32 is divided by the peak of what runs: plain FP32 (torch's default), not the bf16 tensor cores' figure
    assert peak_of(gpu, 1, torch.float32) == (67e12, "datasheet dense fp32 x 1")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Tesla T4")
    assert peak_of(gpu, 2, torch.float32) == (2 * 8.1e12, "datasheet dense fp32 x 2")
    assert peak_of(gpu, 1, torch.bfloat16)[0] is None  # a T4 has no BF16 figure: no MFU, not fp16's
    given = script.parse_args(["--peak-flops", "5e10"]).peak_flops
    assert mfu.run_peak(torch.device("cpu"), 4, torch.float32, given)[0] == 5e10  # CPU workers share one rate


def test_datasheet_peaks():
    assert mfu.datasheet_peak("NVIDIA H100 80GB HBM3")[:2] == (989e12, "bf16")
    assert mfu.datasheet_peak("NVIDIA H100 PCIe")[0] == 756e12
    assert mfu.datasheet_peak("NVIDIA H200")[0] == 989e12 and mfu.datasheet_peak("NVIDIA H200 NVL")[0] == 835e12
    assert mfu.datasheet_peak("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert mfu.datasheet_peak("NVIDIA L4")[0] == 121e12 and mfu.datasheet_peak("NVIDIA L40S")[0] == 362.05e12
    assert mfu.datasheet_peak("NVIDIA L40")[0] == 181.05e12  # not the L4's 121: "L4" is a substring of "L40"
    assert mfu.datasheet_peak("Tesla T4", "fp16")[:2] == (65e12, "fp16") and mfu.datasheet_peak("Tesla T4") is None
    assert mfu.datasheet_peak("NVIDIA A10")[0] == 125e12
    assert mfu.datasheet_peak("NVIDIA GeForce RTX 4090")[0] == pytest.approx(165.2e12)
    assert mfu.datasheet_peak("NVIDIA A10G") is None  # no NVIDIA datasheet: not guessed
    assert mfu.datasheet_peak("Some Future GPU") is None
    assert all(source.startswith("https://") for *_, source in mfu.DATASHEET_TFLOPS)


def test_mfu_arithmetic():
    # 1,000 tokens/s x 6e9 FLOPs per token = 6 TFLOP/s of 60 TFLOP/s
    assert mfu.mfu(1000, 6e9, 60e12) == pytest.approx(0.1)
    assert mfu.mfu(0, 1, 1) == 0
    for bad in ((-1, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError):
            mfu.mfu(*bad)
    before = torch.get_num_threads()
    rate = mfu.cpu_matmul_rate(n=256, repeats=3, threads=1)
    assert 0 < rate.low <= rate.median <= rate.high and rate.threads == 1 and "measured" in str(rate)
    assert torch.get_num_threads() == before  # the caller's thread count is left as it was
