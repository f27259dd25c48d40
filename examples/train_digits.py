"""Data-parallel training of a small MLP on scikit-learn's digits, on a 4-rank worker group.

What it shows:

* A ``daskwg.Worker`` subclass, ``DigitsTrainer``, whose registered methods become group
  methods: ``init_model`` (``ONE_TO_ALL``) joins ``torch.distributed`` from the
  environment the group set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
  ``gloo`` on CPU, ``nccl`` on GPUs) and builds the same model on every rank;
  ``train_step`` (``DP_COMPUTE_METRIC``) gets one shard of each minibatch, all-reduces
  the gradients and steps; ``evaluate`` (``DP_COMPUTE_METRIC``) counts correct
  predictions on a shard of the held-out split; ``weights_checksum`` (``ONE_TO_ALL``)
  lets the driver check that all ranks hold bit-identical weights.
* The single controller: this script (the driver) holds the data, shuffles it every
  epoch, and calls ``wg.train_step(batch)`` as if the group were one model.
* Uneven batches: the driver pads a minibatch to a multiple of the world size with rows
  of weight 0, so the gradient is the exact mean over the real rows.

Run it on a local cluster (started for you)::

    python examples/train_digits.py

or on a cluster you started with the ``dask`` command line::

    dask scheduler --port 8786 &
    dask worker tcp://127.0.0.1:8786 --nworkers 4 --nthreads 1 &
    python examples/train_digits.py --scheduler tcp://127.0.0.1:8786

It prints the final test accuracy, exits with status 1 if it is below ``--min-accuracy``
or if the ranks' weights differ, and writes a plot of the loss and test-accuracy curves
to ``--out``. The digits data ship with scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import daskwg
from daskwg import DataProto, Dispatch, register


class DigitsTrainer(daskwg.Worker):
    """One data-parallel rank: a 64-128-10 MLP and its optimizer."""

    def __init__(self, hidden: int = 128, lr: float = 3e-3, seed: int = 0):
        super().__init__()
        # Ranks usually share a machine's cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(1)
        self.hidden = hidden
        self.lr = lr
        self.seed = seed
        self.model: nn.Module | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> str:
        """Join the process group and build the model and optimizer; returns the backend."""
        if torch.cuda.is_available():
            # dask-cuda gives every worker its own GPU as the first visible device.
            backend, self.device = "nccl", torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        else:
            backend, self.device = "gloo", torch.device("cpu")
        # env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, set by the group.
        dist.init_process_group(backend)
        torch.manual_seed(self.seed)  # same seed, same initial weights on every rank
        self.model = nn.Sequential(nn.Linear(64, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 10))
        self.model.to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.lr)
        return backend

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def train_step(self, batch: DataProto) -> dict[str, float]:
        """One optimizer step on this rank's shard of the minibatch.

        ``batch`` holds ``x`` [b, 64] float32, ``y`` [b] int64 and ``w`` [b] float32 (1 for
        real rows, 0 for padding). The gradient of the summed loss is all-reduced with the
        row count in one collective, so every rank steps with the mean gradient over the
        real rows of the whole minibatch and the weights stay identical.

        Returns:
            ``{"loss_sum": float, "rows": float}`` for this rank's real rows.
        """
        x, y, w = (batch.batch[k].to(self.device) for k in ("x", "y", "w"))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        loss_sum = (nn.functional.cross_entropy(self.model(x), y, reduction="none") * w).sum()
        loss_sum.backward()
        params = list(self.model.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [w.sum().reshape(1)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        total_rows = flat[-1]
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p) / total_rows)
            offset += n
        self.optimizer.step()
        return {"loss_sum": float(loss_sum.detach()), "rows": float(w.sum())}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @torch.no_grad()
    def evaluate(self, batch: DataProto) -> dict[str, int]:
        """Count correct predictions among this rank's real rows of the held-out split."""
        x, y, w = (batch.batch[k].to(self.device) for k in ("x", "y", "w"))
        self.model.eval()
        real = w > 0
        correct = (self.model(x).argmax(dim=1) == y) & real
        return {"correct": int(correct.sum()), "total": int(real.sum())}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights_checksum(self) -> str:
        """sha256 of the flattened parameters' bytes."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).cpu()
        return hashlib.sha256(flat.numpy().tobytes()).hexdigest()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def destroy_process_group(self) -> None:
        """Leave the process group (the group's ``shutdown()`` then destroys this object)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def plural(n: int, noun: str) -> str:
    """``"1 rank"``, ``"4 ranks"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def load_split(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The 1797 8x8 digits, pixels scaled to [0, 1], split 80/20 (stratified, seeded)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.2, random_state=seed, stratify=y
    )

    def tensors(x, y):
        return {"x": torch.tensor(x, dtype=torch.float32), "y": torch.tensor(y, dtype=torch.int64)}

    return tensors(x_train, y_train), tensors(x_test, y_test)


def make_batch(data: dict[str, torch.Tensor], rows: torch.Tensor, world_size: int) -> DataProto:
    """A DataProto of ``rows`` padded to a multiple of ``world_size`` with weight-0 rows."""
    batch = DataProto.from_dict({"x": data["x"][rows], "y": data["y"][rows], "w": torch.ones(len(rows))})
    batch, pad = daskwg.pad_dataproto_to_divisor(batch, world_size)
    if pad:
        batch.batch["w"][len(batch) - pad :] = 0.0
    return batch


def train(client, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    train_data, test_data = load_split(args.seed)
    test_batch = make_batch(test_data, torch.arange(len(test_data["y"])), args.world_size)
    n_train = len(train_data["y"])
    steps_per_epoch = -(-n_train // args.batch_size)
    generator = torch.Generator().manual_seed(args.seed)

    losses: list[float] = []  # per step: mean loss over the minibatch
    accuracies: list[float] = []  # per epoch: test accuracy
    trainer = daskwg.ClassWithInitArgs(DigitsTrainer, hidden=args.hidden, lr=args.lr, seed=args.seed)
    with daskwg.WorkerGroup(client, trainer, world_size=args.world_size) as wg:
        backends = wg.init_model()
        print(
            f"{plural(wg.world_size, 'rank')} on {plural(len(set(wg.workers)), 'Dask worker')}, backend {backends[0]}"
        )
        # In a log (not a terminal) refresh rarely, so the bar does not flood it.
        refresh_s = 0.1 if sys.stderr.isatty() else 5.0
        bar = tqdm(total=args.epochs * steps_per_epoch, unit="step", file=sys.stderr, mininterval=refresh_s)
        with bar:
            for epoch in range(args.epochs):
                order = torch.randperm(n_train, generator=generator)
                running_loss, running_rows = 0.0, 0.0
                for rows in order.split(args.batch_size):
                    metrics = wg.train_step(make_batch(train_data, rows, args.world_size))
                    loss_sum = sum(m["loss_sum"] for m in metrics)
                    batch_rows = sum(m["rows"] for m in metrics)
                    losses.append(loss_sum / batch_rows)
                    running_loss += loss_sum
                    running_rows += batch_rows
                    bar.set_postfix(epoch=epoch + 1, loss=f"{running_loss / running_rows:.4f}", refresh=False)
                    bar.update()
                counts = wg.evaluate(test_batch)
                accuracies.append(sum(c["correct"] for c in counts) / sum(c["total"] for c in counts))
                bar.set_postfix(
                    epoch=epoch + 1,
                    loss=f"{running_loss / running_rows:.4f}",
                    test_acc=f"{accuracies[-1]:.3f}",
                )
        checksums = wg.weights_checksum()
        wg.destroy_process_group()

    plot(losses, accuracies, steps_per_epoch, args.min_accuracy, args.out)
    accuracy = accuracies[-1]
    print(f"final test accuracy: {accuracy:.4f} ({len(test_data['y'])} held-out digits)")
    print(f"plot written to {args.out}")
    if len(set(checksums)) != 1:
        shown = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(checksums))
        print(f"ERROR: the ranks' weights differ after training:\n{shown}", file=sys.stderr)
        return 1
    print(f"weights identical on all {plural(len(checksums), 'rank')} (sha256 {checksums[0][:16]}...)")
    if accuracy < args.min_accuracy:
        print(f"ERROR: test accuracy {accuracy:.4f} is below {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


def plot(
    losses: list[float], accuracies: list[float], steps_per_epoch: int, min_accuracy: float, out: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [i / steps_per_epoch for i in range(1, len(losses) + 1)]
    ax_loss.plot(steps, losses, lw=0.6, alpha=0.6, label="per minibatch")
    epoch_means = [
        sum(losses[i : i + steps_per_epoch]) / len(losses[i : i + steps_per_epoch])
        for i in range(0, len(losses), steps_per_epoch)
    ]
    ax_loss.plot(range(1, len(epoch_means) + 1), epoch_means, marker="o", label="epoch mean")
    ax_loss.legend()
    ax_loss.set(xlabel="epoch", ylabel="training loss (cross-entropy)", yscale="log", title="training loss")
    epochs = list(range(1, len(accuracies) + 1))
    ax_acc.plot(epochs, accuracies, marker="o")
    ax_acc.axhline(min_accuracy, color="gray", ls="--", lw=1, label=f"required ({min_accuracy})")
    ax_acc.legend(loc="lower right")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title=f"test accuracy (final {accuracies[-1]:.3f})")
    ax_acc.set_ylim(min(0.8, min(accuracies)), 1.0)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="attach to this Dask scheduler instead of starting a local cluster (e.g. tcp://127.0.0.1:8786)",
    )
    parser.add_argument("--world-size", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--epochs", type=int, default=15, help="default 15")
    parser.add_argument("--batch-size", type=int, default=64, help="global minibatch size (default 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the split, the shuffling and the weights")
    parser.add_argument("--min-accuracy", type=float, default=0.95, help="exit 1 below this test accuracy")
    parser.add_argument(
        "--out",
        default=os.path.join("examples", "out", "train_digits.png"),
        help="where to write the PNG plot (default examples/out/train_digits.png)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dask.distributed import Client

    start = time.perf_counter()
    if args.scheduler:
        with Client(args.scheduler) as client:
            client.wait_for_workers(args.world_size, timeout=60)
            status = train(client, args)
    else:
        with daskwg.local_cluster(n_workers=args.world_size) as cluster, Client(cluster) as client:
            status = train(client, args)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
