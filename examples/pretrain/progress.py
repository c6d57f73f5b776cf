"""What the job shows and records: metrics.jsonl, events.jsonl, the progress bar, the loss plot.

Only rank 0 writes. ``metrics.jsonl`` holds one JSON object per optimizer step; on resume the
lines after the checkpoint's step are dropped first, so the file always reads as one run.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    break  # a line cut by a crash: everything before it is good
    return out


def truncate_metrics(path: str, last_step: int) -> None:
    """Keep only the steps <= ``last_step`` (rewritten atomically)."""
    rows = [r for r in read_jsonl(path) if r.get("step", 0) <= last_step]
    tmp = path + ".part"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


class JsonLines:
    """Append-only JSON lines, flushed per line."""

    def __init__(self, path: str):
        self.path = path
        self.f = open(path, "a")

    def write(self, obj: dict) -> None:
        self.f.write(json.dumps(obj) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class Events(JsonLines):
    """Run events (start, resume, save, signal, export, end) with a wall-clock time."""

    def write(self, obj: dict) -> None:  # noqa: D102
        super().write({"time": round(time.time(), 3), **obj})


class Bar:
    """A tqdm bar on rank 0 (no-op elsewhere): loss, tokens/s, step time, memory."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            mininterval=0.5, file=sys.stderr, smoothing=0.1)

    def update(self, loss: float, tok_s: float, step_s: float, mem_gb: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"loss {loss:.4f} | {tok_s:,.0f} tok/s | {step_s * 1e3:.0f} ms/step | {mem_gb:.2f} GB", refresh=False)
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_loss(metrics_path: str, png_path: str, title: str = "", final_val: tuple | None = None) -> bool:
    """The loss curve (and the learning rate) of ``metrics.jsonl`` as a PNG. False if nothing to plot."""
    rows = read_jsonl(metrics_path)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, loss, color="tab:blue", lw=0.8, alpha=0.45, label="train loss")
    k = max(1, len(loss) // 30)
    if k > 1:  # a moving average
        smooth = [sum(loss[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(loss))]
        ax.plot(steps, smooth, color="tab:blue", lw=1.8, label=f"mean of {k}")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if final_val is not None and final_val[1] is not None and (not val or val[-1][0] != final_val[0]):
        val.append(final_val)
    if val:
        ax.plot(*zip(*val), "o-", color="tab:red", ms=4, label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    if "lr" in rows[0]:
        ax2 = ax.twinx()
        ax2.plot(steps, [r["lr"] for r in rows], color="tab:gray", lw=1, ls="--", label="lr")
        ax2.set_ylabel("learning rate", color="tab:gray")
    ax.legend(loc="upper right")
    ax.set_title(title or "pretraining loss")
    fig.tight_layout()
    tmp = png_path + ".part.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png_path)
    return True


def fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def fmt_time(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"
