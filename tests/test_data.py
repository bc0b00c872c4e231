import gzip

import numpy as np
import pytest
import torch

from helpers import data


def write_idx(path, array, compress):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    body = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(body))
    else:
        path.write_bytes(body)
    return path


def make_dataset(folder, n_train=12, n_test=6, compress=True):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(folder / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), compress)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, (n,)), compress)
    return folder


@pytest.fixture(autouse=True)
def no_outside_data(monkeypatch, tmp_path):
    """Look only where each test says: not in the project, Debian's folder or the network."""
    monkeypatch.setattr(data, "PROJECT_DATA", tmp_path / "project-data")
    monkeypatch.setattr(data, "DEBIAN_DIRS", {"fashion": tmp_path / "debian"})
    monkeypatch.delenv(data.DATA_ENV, raising=False)

    def offline(name, target):
        raise OSError("network unreachable")
    monkeypatch.setattr(data, "_download", offline)


@pytest.mark.parametrize("compress", [True, False])
def test_read_idx_gz_and_raw(tmp_path, compress):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = write_idx(tmp_path / "x-idx3-ubyte", array, compress)
    np.testing.assert_array_equal(data.read_idx(path), array)


def test_read_idx_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00\x00\x0d\x01\x00\x00\x00\x02ab")
    with pytest.raises(ValueError, match="IDX"):
        data.read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1]) + (5).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="header says"):
        data.read_idx(short)


@pytest.mark.parametrize("compress", [True, False])
def test_load_split_shapes_and_normalisation(tmp_path, compress):
    make_dataset(tmp_path / "d", compress=compress)
    x, y = data.load_split("fashion", "train", root=tmp_path / "d")
    assert x.shape == (12, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (12,) and y.dtype == torch.int64
    assert abs(x.mean().item()) < 3 and 0 <= y.min() and y.max() < 10
    x_small, _ = data.load_split("fashion", "test", root=tmp_path / "d", limit=4)
    assert len(x_small) == 4


def test_search_order(tmp_path, monkeypatch):
    debian = make_dataset(tmp_path / "debian")
    assert data.find_dataset("fashion") == debian
    project = make_dataset(tmp_path / "project-data" / "FashionMNIST" / "raw")  # torchvision's layout
    assert data.find_dataset("fashion") == project
    env = make_dataset(tmp_path / "env")
    monkeypatch.setenv(data.DATA_ENV, str(env))
    assert data.find_dataset("fashion") == env
    explicit = make_dataset(tmp_path / "explicit")
    assert data.find_dataset("fashion", root=explicit) == explicit


def test_debian_folder_is_only_for_fashion(tmp_path):
    make_dataset(tmp_path / "debian")
    with pytest.raises(data.DatasetNotFound):
        data.find_dataset("mnist")


def test_not_found_lists_every_place_and_the_fix(tmp_path):
    with pytest.raises(data.DatasetNotFound) as info:
        data.find_dataset("fashion", root=tmp_path / "mine")
    text = str(info.value)
    for place in (tmp_path / "mine", tmp_path / "project-data", tmp_path / "debian"):
        assert str(place) in text
    assert "network unreachable" in text and data.DATA_ENV in text and "apt install" in text


def test_get_datasets_smoke_keeps_a_prefix(tmp_path, monkeypatch):
    make_dataset(tmp_path / "d", n_train=12, n_test=6)
    monkeypatch.setattr(data, "SMOKE_SIZES", {"train": 5, "test": 3})
    train_set, test_set = data.get_datasets(root=tmp_path / "d", smoke=True)
    assert (len(train_set), len(test_set)) == (5, 3)


def test_device_loader_covers_every_example_once():
    x = torch.arange(10).float().view(10, 1)
    loader = data.DeviceLoader((x, torch.arange(10)), batch_size=4, seed=1)
    assert len(loader) == 3
    seen = torch.cat([yb for _, yb in loader])
    assert sorted(seen.tolist()) == list(range(10))
    loader.set_epoch(0)
    first = torch.cat([yb for _, yb in loader])
    loader.set_epoch(0)
    assert torch.equal(first, torch.cat([yb for _, yb in loader])), "same epoch, same order"
    loader.set_epoch(1)
    assert not torch.equal(first, torch.cat([yb for _, yb in loader])), "new epoch, new order"
    dropping = data.DeviceLoader((x, torch.arange(10)), batch_size=4, drop_last=True)
    assert len(dropping) == 2 and sum(len(b) for b, _ in dropping) == 8


def test_make_loader_is_seeded():
    ds = torch.utils.data.TensorDataset(torch.arange(20).float(), torch.arange(20))
    order = [torch.cat([y for _, y in data.make_loader(ds, 5, seed=3)]) for _ in range(2)]
    assert torch.equal(*order)
