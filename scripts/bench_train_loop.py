"""Throughput of helpers.train's loop against a hand-written loop, same model, data and batches.

One run prints samples/s for each and their ratio (target: helpers / hand-written >= 0.98).
    python scripts/bench_train_loop.py [--samples 10000] [--device cpu]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from helpers import data, devices, models, train


def hand_written(model, loader, optimizer, device):
    """The loop most tutorials write: .item() every step for the running figures."""
    model.train()
    running_loss, correct, seen = 0.0, 0, 0
    train.sync(device)
    start = time.perf_counter()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
        running_loss += loss.item() * len(y)
        correct += (out.argmax(1) == y).sum().item()
        seen += len(y)
    train.sync(device)
    return seen / (time.perf_counter() - start)


def helpers_loop(model, loader, optimizer, device):
    return train.train_one_epoch(model, loader, optimizer, device).samples_per_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--device", default=str(devices.pick_device(0)))
    args = parser.parse_args()
    device = torch.device(args.device)
    x, y = data.load_split("fashion", "train", limit=args.samples)
    loader = data.make_loader(torch.utils.data.TensorDataset(x, y), batch_size=100, seed=0)
    warm_loader = data.make_loader(torch.utils.data.TensorDataset(x[:1000], y[:1000]), batch_size=100)
    loops = [("hand-written", hand_written), ("helpers", helpers_loop)]
    rates = {name: [] for name, _ in loops}
    for i in range(args.repeats):
        # alternate who goes first, and warm each fresh model up untimed: both showed a first-run penalty
        for name, loop in loops if i % 2 == 0 else loops[::-1]:
            torch.manual_seed(0)
            model = models.ConvNet().to(device)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            loop(model, warm_loader, opt, device)
            rates[name].append(loop(model, loader, opt, device))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, rate in medians.items():
        print(f"{name:>13}: {rate:8.0f} samples/s (median of {args.repeats} epochs of {args.samples})")
    print(f"helpers / hand-written: {medians['helpers'] / medians['hand-written']:.3f} on {device} (target >= 0.98)")


if __name__ == "__main__":
    main()
