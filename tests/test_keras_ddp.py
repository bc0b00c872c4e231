"""helpers.keras_ddp: the guide's Keras model under DDP, its moving statistics, the atomic save, the guide's launch.

No test runs a backward pass in the pytest process (it would poison later GPU forks): every
training step runs in a launched or forked child.
"""

import functools
import os
import socket
import subprocess
import sys

import psutil
import pytest
import torch
import torch.multiprocessing as tmp
from torch.utils.data import TensorDataset

from helpers import keras_ddp as K
from helpers.launch import RankFailed, free_port, launch
from helpers.models import max_param_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
keras = K.keras_torch()


@pytest.fixture(autouse=True)
def no_children_left():
    yield
    assert psutil.Process().children(recursive=True) == []


@pytest.fixture(scope="module")
def images():
    """512 random 28x28x1 images in 13 classes, channels last, as the Keras model takes them."""
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 28, 28, 1, generator=gen), torch.randint(0, 10, (512,), generator=gen))


def run_python(code, **env):
    clean = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)


def test_keras_torch_refuses_a_backend_already_chosen(tmp_path):
    # Only the torch backend can import here (TensorFlow, JAX and scipy are absent), so a stand-in Keras that
    # was "imported with TensorFlow" plays the learner who imported Keras before setting the variable.
    code = ("import os, sys, types\n"
            "fake = types.ModuleType('keras'); fake.backend = types.SimpleNamespace(backend=lambda: 'tensorflow')\n"
            "sys.modules['keras'] = fake; os.environ['KERAS_BACKEND'] = 'torch'\n"
            "from helpers import keras_ddp\n"
            "try:\n    keras_ddp.keras_torch()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    out = run_python(code, KERAS_HOME=str(tmp_path))
    assert "refused:" in out.stdout and "'tensorflow' backend" in out.stdout, out.stdout + out.stderr


def test_keras_torch_refuses_another_backend_in_the_environment(tmp_path):
    code = "from helpers import keras_ddp\nkeras_ddp.keras_torch()\n"
    out = run_python(code, KERAS_BACKEND="jax", KERAS_HOME=str(tmp_path))
    assert out.returncode != 0 and "KERAS_BACKEND='jax'" in out.stderr


def test_the_model_is_a_torch_module_whose_moving_statistics_are_frozen_parameters():
    with keras.device("cpu"):
        model = K.get_model()
        out = model(torch.zeros(4, 28, 28, 1))
    assert isinstance(model, torch.nn.Module) and tuple(out.shape) == (4, 10)
    assert list(model.buffers()) == []
    frozen = {n.split(".")[-1] for n, p in model.named_parameters() if not p.requires_grad}
    moving = set(K.weights(model, trainable=False))
    assert moving and moving <= frozen and all("moving_" in name for name in moving)
    trainable = K.weights(model, trainable=True)
    assert sum(v.numel() for v in trainable.values()) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_the_same_seed_builds_the_same_model_and_another_seed_does_not():
    with keras.device("cpu"):
        a, b, c = K.get_model(seed=1), K.get_model(seed=1), K.get_model(seed=2)
    assert max_param_diff(K.weights(a, True), K.weights(b, True)) == 0
    assert max_param_diff(K.weights(a, True), K.weights(c, True)) > 0


def test_seed_all_seeds_what_keras_set_random_seed_seeds():
    import random

    import numpy as np
    from keras.src.utils.rng_utils import get_random_seed

    def draws():
        return (random.random(), float(np.random.rand()), torch.rand(1).item(),
                keras.random.normal((3,)).tolist(), get_random_seed())  # the last two: Keras's global seed

    keras.utils.set_random_seed(7)  # TensorFlow is not installed here, so this imports nothing more
    expected = draws()
    K.seed_all(7)
    assert draws() == expected
    K.seed_all(8)
    assert draws() != expected


def test_keras_computes_float64_as_float32_on_torch():
    # notebook 26, cell 17: why its check is one float32 step and not float64
    assert keras.backend.result_type("float64", "float64") == "float32"


def _stub_tensorflow(tmp_path):
    """A folder with a `tensorflow` package that raises when imported, as if importing it were forbidden."""
    (tmp_path / "stub" / "tensorflow").mkdir(parents=True)
    (tmp_path / "stub" / "tensorflow" / "__init__.py").write_text("raise RuntimeError('tensorflow was imported')\n")
    return str(tmp_path / "stub")


def test_keras_imports_tensorflow_to_seed_and_to_save_where_it_is_installed(tmp_path):
    # what Kaggle and Colab do with keras.utils.set_random_seed and model.save (rng_utils.py, serialization_lib.py)
    stub = _stub_tensorflow(tmp_path)
    for call in ("keras.utils.set_random_seed(0)",
                 "keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]).save(sys.argv[1])"):
        code = f"import sys, keras\n{call}\n"
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.keras")], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": stub,
                                                          "KERAS_HOME": str(tmp_path)})
        assert "tensorflow was imported" in out.stderr, (call, out.stdout + out.stderr)


@pytest.mark.parametrize("prelude", ["keras = K.keras_torch()\n",  # the tests' way
                                     "import os\nos.environ['KERAS_BACKEND'] = 'torch'\nimport keras\n"])  # 26's
def test_the_course_builds_trains_saves_and_loads_without_importing_tensorflow(tmp_path, prelude):
    stub = _stub_tensorflow(tmp_path)
    code = ("import sys, torch\n"
            "from torch.utils.data import TensorDataset\n"
            "from helpers import keras_ddp as K\n"
            + prelude +
            "data = TensorDataset(torch.randn(64, 28, 28, 1), torch.randint(0, 10, (64,)))\n"
            "out = K.keras_steps(0, 1, data, 1, 32, 0.01, use_ddp=False, save_to=sys.argv[1], device='cpu')\n"
            "keras.models.load_model(sys.argv[1])\n"
            "print('tensorflow' in sys.modules, out['saved'])\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.keras")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**{k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"},
                                                      "PYTHONPATH": stub, "KERAS_HOME": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.split()[0] == "False", out.stdout + out.stderr


def test_channels_last_moves_the_channel_axis():
    x = torch.arange(2 * 1 * 28 * 28, dtype=torch.float32).reshape(2, 1, 28, 28)
    out = K.channels_last(TensorDataset(x, torch.tensor([3, 4])))
    assert out.tensors[0].shape == (2, 28, 28, 1) and torch.equal(out.tensors[0][..., 0], x[:, 0])
    assert out.tensors[1].tolist() == [3, 4]


def test_save_atomic_writes_a_loadable_model_and_leaves_no_temporary_file(tmp_path):
    with keras.device("cpu"):
        model = K.get_model()
        path = K.save_atomic(model, tmp_path / "sub" / "m.keras")
        back = keras.models.load_model(path)
    assert max_param_diff(K.weights(model, True), K.weights(back, True)) == 0
    assert [p.name for p in path.parent.iterdir()] == ["m.keras"]


def test_save_atomic_keeps_the_old_file_when_saving_fails(tmp_path):
    path = tmp_path / "m.keras"
    path.write_bytes(b"old model")

    class Broken:
        def save(self, target):
            open(target, "wb").write(b"half a mod")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        K.save_atomic(Broken(), path)
    assert path.read_bytes() == b"old model" and [p.name for p in tmp_path.iterdir()] == ["m.keras"]


def test_save_atomic_refuses_another_suffix(tmp_path):
    with pytest.raises(ValueError, match=".keras"):
        K.save_atomic(object(), tmp_path / "m.h5")


def test_two_ranks_in_the_guides_mode_take_one_processs_step_on_the_global_batch(images):
    # notebook 26, cell 17: one float32 step (Keras on torch computes float64 as float32), weights within 1e-4
    fn = functools.partial(K.keras_steps, training=None, dropout=0.0, optimizer="sgd")
    out = launch(fn, 2, images, 1, 16, 0.05, quiet=True, progress=False)
    ref = launch(functools.partial(fn, use_ddp=False), 1, images, 1, 32, 0.05, quiet=True, progress=False)[0]
    assert max_param_diff(out[0]["params"], out[1]["params"]) == 0
    assert max_param_diff(out[0]["params"], ref["params"]) < 1e-4
    assert abs(sum(o["losses"][0] for o in out) / 2 - ref["losses"][0]) < 1e-5
    # model(x) without training=True: BatchNormalization never updates its moving statistics
    assert all((v == 0).all() for k, v in out[0]["moving"].items() if "moving_mean" in k)


def test_in_training_mode_weights_stay_equal_but_moving_statistics_part_and_rank_0_saves(images, tmp_path):
    path = tmp_path / "model.keras"
    out = launch(functools.partial(K.keras_steps, save_to=path), 2, images, 4, 16, 1e-3, quiet=True, progress=False)
    assert max_param_diff(out[0]["params"], out[1]["params"]) == 0
    assert max_param_diff(out[0]["moving"], out[1]["moving"]) > 1e-6
    assert out[0]["saved"] == str(path) and out[1]["saved"] is None
    with keras.device("cpu"):
        saved = keras.models.load_model(path)
    assert max_param_diff(K.weights(saved, False), out[0]["moving"]) == 0
    assert max_param_diff(K.weights(saved, True), out[0]["params"]) == 0


def test_keras_steps_refuses_bad_arguments(images):
    with pytest.raises(ValueError, match="more than one epoch"):
        K.keras_steps(0, 2, images, 100, 16, 1e-3)
    with pytest.raises(ValueError, match="world_size=1"):
        K.keras_steps(0, 2, images, 1, 16, 1e-3, use_ddp=False)
    with pytest.raises(ValueError, match="lr"):
        K.keras_steps(0, 1, images, 1, 16, -1.0)


def test_fit_under_ddp_does_not_all_reduce(images):
    out = launch(K.fit_rank, 2, images, 3, 16, 0.05, quiet=True, progress=False)
    assert out[0]["has_fit"] is False
    assert max_param_diff(out[0]["params"], out[1]["params"]) > 1e-6


def test_a_failing_rank_in_fit_rank_surfaces(images):
    with pytest.raises(RankFailed, match="more than one epoch"):
        launch(K.fit_rank, 2, images, 100, 16, 0.05, quiet=True, progress=False)


def test_the_guides_start_processes_way_trains_and_fails_cleanly(images):
    port = free_port()
    results = torch.zeros(2).share_memory_()
    tmp.start_processes(K.guide_rank, args=(2, images, port, results, 4, 16), nprocs=2, start_method="fork")
    assert (results > 0).all()
    with pytest.raises(tmp.ProcessRaisedException, match="rank 1 failed on purpose"):
        tmp.start_processes(K.guide_rank, args=(2, images, free_port(), results, 4, 16, 1),
                                nprocs=2, start_method="fork")


def test_the_guides_fixed_port_taken_fails_in_rank_0(images):
    results = torch.zeros(2).share_memory_()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(tmp.ProcessRaisedException, match="(?i)address already in use|EADDRINUSE"):
            tmp.start_processes(K.guide_rank, args=(2, images, s.getsockname()[1], results, 4, 16), nprocs=2,
                                start_method="fork")


def test_ddp_copies_rank_0s_moving_statistics_once_and_never_again(images):
    out = launch(K.broadcast_probe, 2, images, 16, quiet=True, progress=False)
    assert out[0]["wrapped"] == out[1]["wrapped"] == (1.0, 1.0)  # rank 1's 2.0 was overwritten by rank 0's
    moving, bias = zip(*(o["stepped"] for o in out))
    assert bias[0] == bias[1] and moving[0] != moving[1]


def test_a_hanging_rank_keeps_start_processes_waiting_until_killed(images):
    results = torch.zeros(2).share_memory_()
    context = tmp.start_processes(K.guide_rank, args=(2, images, free_port(), results, 4, 16, None, 1), nprocs=2,
                                  start_method="fork", join=False)
    try:
        assert context.join(timeout=2) is False
        assert all(p.is_alive() for p in context.processes)
    finally:
        for p in context.processes:
            p.kill()
            p.join()
