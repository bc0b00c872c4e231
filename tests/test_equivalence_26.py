"""Notebook 26's equivalence check, rerun with its rounding perturbed (tests/perturb.py).

Cell 17 compares two DDP ranks running the guide's Keras model (``model(x)``, Dropout off, SGD) with one process on
the global batch. Keras on torch computes float64 as float32 (``keras.backend.result_type``), so the check is the
one-step form of the course's rule: one float32 step, weights within 1e-4 (ten times below the step itself) and the
first loss within 1e-5. It runs here with the notebook's ``keras_steps`` for every rounding in ``ROUNDINGS``.

``nudge_first_forward`` reaches a Keras model: under the torch backend the functional model is a
``torch.nn.Module`` whose ``__call__`` runs torch's forward pre-hooks first (checked below, in-process, without a
backward pass), and its variables are the module's parameters. The last test shows the bounds can fail: a doubled
step (gradients summed, not averaged) and per-rank BatchNormalization statistics exceed them.
"""

import pytest
from perturb import ROUNDINGS, nudge_first_forward, perturbed, run_check

WEIGHTS_TOL, LOSS_TOL = 1e-4, 1e-5  # notebook 26, cell 17
BATCH, LR = 64, 0.05  # notebook 26's BATCH and SGD_LR


def check_one_step(threads, ulps, training=None, ref_lr=LR):
    import functools
    import statistics

    from helpers import data
    from helpers import keras_ddp as K
    from helpers.launch import launch
    from helpers.models import max_param_diff

    keras = K.keras_torch()  # before the launches: the ranks' functions `import keras` as this process chose it
    train_set, _ = data.get_datasets("fashion", smoke=True)
    keras_train = K.channels_last(train_set)
    quiet = dict(quiet=True, progress=False)
    mode = functools.partial(K.keras_steps, training=training, dropout=0.0, optimizer="sgd")
    two = launch(perturbed(mode, threads, 0), 2, keras_train, 1, BATCH, LR, **quiet)
    one = launch(perturbed(functools.partial(mode, use_ddp=False), threads, ulps), 1, keras_train, 1, 2 * BATCH,
                 ref_lr, **quiet)[0]
    with keras.device("cpu"):
        start = K.weights(K.get_model(0.0), True)
    return {"diff": max_param_diff(two[0]["params"], one["params"]), "step": max_param_diff(one["params"], start),
            "loss_gap": abs(statistics.mean(r["losses"][0] for r in two) - one["losses"][0])}


def check_what_the_bounds_catch(threads, ulps):
    return {"doubled step": check_one_step(threads, ulps, ref_lr=2 * LR)["diff"],
            "training=True": check_one_step(threads, ulps, training=True)["diff"],
            "model(x)": check_one_step(threads, ulps)["diff"]}


def test_nudge_first_forward_moves_a_keras_models_variables_one_ulp():
    import torch

    from helpers import keras_ddp as K

    keras = K.keras_torch()
    with keras.device("cpu"), torch.no_grad():
        model = K.get_model(0.0)
        before = K.weights(model, True)
        with nudge_first_forward(1):
            model(torch.zeros(2, 28, 28, 1))
        after = K.weights(model, True)
    for path, w in before.items():
        assert torch.equal(after[path], torch.nextafter(w, torch.full_like(w, float("inf")))), path


@pytest.mark.parametrize("threads,ulps", ROUNDINGS)
def test_two_keras_ranks_take_one_processs_step(threads, ulps):
    out = run_check(__file__, "check_one_step", threads, ulps)
    print(f"{threads} thread(s), {ulps} ulp: " + ", ".join(f"{k} {v:.1e}" for k, v in out.items()))
    assert out["diff"] < WEIGHTS_TOL < out["step"] / 10 and out["loss_gap"] < LOSS_TOL


def test_the_bounds_fail_for_a_doubled_step_and_per_rank_batch_statistics():
    out = run_check(__file__, "check_what_the_bounds_catch", 1, 0)
    print(out)
    assert out["doubled step"] > WEIGHTS_TOL, "gradients summed, not averaged: a whole extra step"
    assert out["training=True"] > 100 * max(out["model(x)"], 1e-8), "cell 17's bn_diff: another computation"
