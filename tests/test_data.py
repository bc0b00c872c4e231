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


def corrupt_variants(tmp_path):
    """Every way an IDX file turned up damaged: name → file."""
    good = bytes([0, 0, 8, 1]) + (6).to_bytes(4, "big") + b"abcdef"
    gz = gzip.compress(good)
    files = {
        "bad gzip": (tmp_path / "a-idx1-ubyte.gz", b"PK\x03\x04 not gzip at all"),
        "wrong gzip method": (tmp_path / "b-idx1-ubyte.gz", gz[:2] + b"\x07" + gz[3:]),
        "truncated gzip": (tmp_path / "c-idx1-ubyte.gz", gz[: len(gz) // 2]),
        "damaged gzip body": (tmp_path / "d-idx1-ubyte.gz", gz[:12] + bytes(len(gz) - 20) + gz[-8:]),
        "empty": (tmp_path / "e-idx1-ubyte", b""),
        "empty gz": (tmp_path / "f-idx1-ubyte.gz", gzip.compress(b"")),
        "wrong magic": (tmp_path / "g-idx1-ubyte", b"\x89PNG\r\n\x1a\n" + good),
        "cut in the header": (tmp_path / "h-idx3-ubyte", bytes([0, 0, 8, 3]) + (6).to_bytes(4, "big")),
        "cut in the body": (tmp_path / "i-idx1-ubyte", good[:-2]),
    }
    for path, content in files.values():
        path.write_bytes(content)
    return {name: path for name, (path, _) in files.items()}


def test_every_corruption_names_the_file_and_the_fix(tmp_path):
    for what, path in corrupt_variants(tmp_path).items():
        with pytest.raises(data.CorruptFile) as info:
            data.read_idx(path)
        assert str(path) in str(info.value), what
        assert "Fix" in str(info.value), what
    with pytest.raises(data.CorruptFile, match="is a folder"):
        data.read_idx(tmp_path)


def test_swapped_or_mismatched_files_are_named(tmp_path):
    images = np.zeros((4, 28, 28), dtype=np.uint8)
    labels = np.zeros(4, dtype=np.uint8)
    for split in ("train", "t10k"):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte", labels, compress=False)  # swapped
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", labels, compress=False)
    with pytest.raises(data.CorruptFile, match="swapped"):
        data.load_split("fashion", "train", root=tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte", images[:3], compress=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels, compress=False)
    with pytest.raises(data.CorruptFile, match="3 train images but 4 labels"):
        data.load_split("fashion", "train", root=tmp_path)


def test_wrong_image_size_and_labels_out_of_range_are_refused(tmp_path):
    for split in ("train", "t10k"):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte", np.zeros((4, 32, 32)), compress=False)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", np.array([0, 1, 2, 3]), compress=False)
    with pytest.raises(data.CorruptFile, match="32x32 pixels"):
        data.load_split("fashion", "train", root=tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((4, 28, 28)), compress=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([0, 10, 255, 3]), compress=False)
    with pytest.raises(data.CorruptFile, match=r"2 train label\(s\) outside 0-9 \(largest 255\)"):
        data.load_split("fashion", "train", root=tmp_path)


@pytest.mark.parametrize("compress", [True, False])
def test_random_bytes_give_corrupt_file_or_an_array_never_another_error(tmp_path, compress):
    """Seeded garbage, some of it behind a valid IDX magic: read_idx must answer CorruptFile or (when the bytes
    happen to be a consistent file) an array; never an IndexError, a MemoryError or a numpy error."""
    import random
    path = tmp_path / ("x-idx1-ubyte.gz" if compress else "x-idx1-ubyte")
    for seed in range(300):
        rng = random.Random(seed)
        body = rng.randbytes(rng.randrange(0, 400))
        if seed % 2:  # half of them past the magic check, with a random dimension count and sizes
            body = bytes([0, 0, 8, rng.randrange(0, 5)]) + body
        path.write_bytes(gzip.compress(body) if compress else body)
        try:
            array = data.read_idx(path)
        except data.CorruptFile:
            continue
        assert array.dtype == np.uint8 and array.size == len(body) - 4 - 4 * body[3]


@pytest.mark.parametrize("kwargs, error", [
    (dict(batch_size=0), ValueError), (dict(batch_size=2.5), TypeError), (dict(batch_size="64"), TypeError),
    (dict(num_workers=-1), ValueError), (dict(batch_size=True), TypeError),
])
def test_loaders_refuse_bad_numbers_with_their_name(kwargs, error):
    dataset = torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.zeros(4))
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        data.make_loader(dataset, **kwargs)
    if name == "batch_size":
        with pytest.raises(error, match=name):
            data.DeviceLoader(dataset, kwargs[name])
