"""Notebook 11's equivalence checks, rerun with their rounding perturbed (tests/perturb.py).

Every check of notebook 11 compares with one process's unsplit GPT in float64 and asserts < 1e-10: pipelined SGD
steps (``pp_train``) with ``ScheduleGPipe`` and ``Schedule1F1B`` (two stages), and four stages of one block on two
ranks with ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` and, from torch 2.15, ``ScheduleZBVZeroBubble``;
exercise 1's traced stages (gradients), exercise 2's ``scale_grads=False`` (one step at lr / 4 against one at lr), and
exercise 4's DDP over two-stage GPTs with two and three ranks (``hybrid_steps`` against one process with the
world's batch). They run here with the notebook's own functions (the cells' launched functions are copied below, the
exported ones imported) and smoke sizes, for every rounding in ``ROUNDINGS``; the nudge lands on the one-process side.
The last test shows the bound can fail: float32's rounding alone, and gradients left summed over the micro-batches,
exceed it.
"""

import pytest
from perturb import ROUNDINGS, perturbed, run_check

TOLERANCE = 1e-10  # notebook 11, every equivalence check
SPLIT, SEED, BATCH, STEPS, LR, N_MICRO = 2, 0, 8, 3, 0.05, 4  # notebook 11's parameters cell, smoke sizes
SIZES = dict(n_layer=4, n_head=2, d_model=32, seq_len=32)
QUIET = dict(quiet=True, progress=False)


def _cfg_and_batches():
    import torch

    from helpers.gpt import GPTConfig

    cfg = GPTConfig(**SIZES)
    g = torch.Generator().manual_seed(SEED)
    windows = torch.randint(0, cfg.vocab_size, (STEPS, BATCH, cfg.seq_len + 1), generator=g)
    return cfg, [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in windows], g


def _schedules():
    import torch

    return ["gpipe", "1f1b", "interleaved", "zero-bubble"] + (["zbv"] if torch.__version__ >= "2.15" else [])


def _unsplit_train(rank, world_size, cfg, batches, lr, dtype):  # notebook 11's unsplit_train (the CPU's device)
    import torch
    import torch.nn.functional as F

    from helpers.gpt import GPT

    torch.manual_seed(SEED)
    model = GPT(cfg).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for xb, yb in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb).flatten(0, 1), yb.flatten()).backward()
        opt.step()
    return {k: p.detach().cpu() for k, p in model.named_parameters()}


def check_training(threads, ulps, dtype="float64", schedules=None, scale_grads=True):
    """Max |weights| after STEPS pipelined SGD steps (each schedule) vs the same steps in one process."""
    import functools

    import torch

    from helpers.launch import launch
    from helpers.models import max_param_diff
    from helpers.pipeline import pp_train

    dt = getattr(torch, dtype)
    cfg, batches, _ = _cfg_and_batches()
    ref = launch(functools.partial(perturbed(_unsplit_train, threads, ulps), dtype=dt), 1, cfg, batches, LR, **QUIET)[0]
    out = {}
    for schedule in schedules or _schedules():
        split = SPLIT if schedule in ("gpipe", "1f1b") else None
        run = functools.partial(perturbed(pp_train, threads, 0), schedule=schedule, split=split, seed=SEED, dtype=dt,
                                scale_grads=scale_grads)
        ranks = launch(run, 2, cfg, batches, LR, **QUIET)
        out[schedule] = max_param_diff(ref, {**ranks[0], **ranks[1]})
    return out


def _traced_rank(rank, world_size, cfg, x, y, n_micro=N_MICRO):  # exercise 1's solution, on the CPU
    import torch
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    from helpers.gpt import GPT
    from helpers.stages import lm_loss

    torch.manual_seed(SEED)
    model = GPT(cfg).to(torch.float64)
    pipe = pipeline(model, (x.chunk(n_micro)[0],), split_spec={"blocks.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_micro, loss_fn=lm_loss)
    schedule.step(x) if rank == 0 else schedule.step(target=y)
    return {k: p.grad.detach().cpu() for k, p in stage.submod.named_parameters()}


def _unsplit_grads(rank, world_size, cfg, x, y):  # exercise 1's reference
    import torch

    from helpers.gpt import GPT
    from helpers.stages import lm_loss

    torch.manual_seed(SEED)
    model = GPT(cfg).to(torch.float64)
    lm_loss(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def check_exercises(threads, ulps):
    """Exercise 1 (traced stages), 2 (unscaled at lr / 4 vs scaled at lr), 4 (DDP over two stages, 2 and 3 ranks)."""
    import functools

    import torch
    from torch.utils.data import TensorDataset

    from helpers.launch import launch
    from helpers.models import max_param_diff
    from helpers.pipeline import hybrid_steps, pp_train

    cfg, batches, g = _cfg_and_batches()
    (x, y), out = batches[0], {}
    ref = launch(perturbed(_unsplit_grads, threads, ulps), 1, cfg, x, y, **QUIET)[0]
    traced = launch(perturbed(_traced_rank, threads, 0), 2, cfg, x, y, **QUIET)
    out["traced"] = max_param_diff(ref, {**traced[0], **traced[1]})
    scaled = launch(functools.partial(perturbed(pp_train, threads, ulps), split=SPLIT, seed=SEED), 2, cfg,
                    batches[:1], LR, **QUIET)
    quarter = launch(functools.partial(perturbed(pp_train, threads, 0), split=SPLIT, seed=SEED, scale_grads=False), 2,
                     cfg, batches[:1], LR / 4, **QUIET)
    out["unscaled"] = max_param_diff({**scaled[0], **scaled[1]}, {**quarter[0], **quarter[1]})
    for world in (2, 3):
        seqs = torch.randint(0, cfg.vocab_size, (STEPS * world * 4, cfg.seq_len + 1), generator=g)
        data = TensorDataset(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())
        run = functools.partial(perturbed(hybrid_steps, threads, 0), cfg=cfg, split=SPLIT, seed=SEED,
                                dtype=torch.float64)
        hybrid = launch(run, world, data, STEPS, 4, LR, init=False, **QUIET)
        big = [(data.tensors[0][i:i + world * 4], data.tensors[1][i:i + world * 4])
               for i in range(0, len(data), world * 4)]
        one = launch(functools.partial(perturbed(_unsplit_train, threads, ulps), dtype=torch.float64), 1, cfg, big, LR,
                     **QUIET)[0]
        out[f"hybrid_{world}"] = max_param_diff(one, hybrid[0]["params"])
    return out


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_pipelined_training_equals_one_process_in_float64_for_every_schedule(threads, ulps):
    out = run_check(__file__, "check_training", threads, ulps)
    print(f"training, {threads} thread(s), {ulps} ulp: {out}")
    assert max(out.values()) < TOLERANCE, out


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_the_exercises_checks_hold_in_float64(threads, ulps):
    out = run_check(__file__, "check_exercises", threads, ulps)
    print(f"exercises, {threads} thread(s), {ulps} ulp: {out}")
    assert max(out.values()) < TOLERANCE, out


def check_bound_fails(threads, ulps):
    out = {f"float32_{k}": v for k, v in check_training(threads, 1, "float32").items()}  # the one process 1 ulp off
    out["summed"] = check_training(threads, 0, "float64", schedules=["gpipe"], scale_grads=False)["gpipe"]
    return out


def test_the_bound_fails_for_float32_and_summed_micro_batch_gradients():
    out = run_check(__file__, "check_bound_fails", 1, 0)
    print(out)
    assert min(v for k, v in out.items() if k.startswith("float32")) > TOLERANCE, "float32 exceeds it"
    assert out["summed"] > 1e-4, "gradients summed over the micro-batches move the weights by (M − 1) × the step"
