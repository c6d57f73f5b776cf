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
    """A tqdm bar on rank 0 (no-op elsewhere): loss, tokens/s (total and per device), MFU, step
    time, memory."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            mininterval=0.5, file=sys.stderr, smoothing=0.1)

    def update(self, loss: float, tok_s: float, step_s: float, mem_gb: float, tok_s_dev: float | None = None,
               mfu: float | None = None) -> None:
        if self.bar is not None:
            per_dev = f" ({tok_s_dev:,.0f}/dev)" if tok_s_dev is not None else ""
            self.bar.set_postfix_str(
                f"loss {loss:.4f} | {tok_s:,.0f} tok/s{per_dev} | MFU {fmt_mfu(mfu)} | {step_s * 1e3:.0f} ms/step | "
                f"{mem_gb:.2f} GB", refresh=False)
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------- MFU
# [Note: model FLOPs utilisation]
# MFU = the FLOPs the model needs per second / the device's peak, per device (PaLM, appendix B;
# torchtitan and nanoGPT count the same way). Per token, forward + backward: 6 x the parameters
# that do matmuls (all but the input embedding, a lookup) + 12 x layers x hidden x seq for the
# attention scores and their weighted sum (QK^T and AV, each 2 FLOPs per multiply-add, x3 for the
# backward). Activation checkpointing's recomputation is not counted (hardware FLOPs would).
# The peak is the dense bf16 tensor-core figure of known GPUs, or --peak-tflops; CPUs have no
# agreed peak, so without that flag MFU is "n/a" there.
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def flops_per_token(n_params: int, n_embedding: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token; see [Note: model FLOPs utilisation]."""
    return 6.0 * (n_params - n_embedding) + 12.0 * layers * hidden * seq_len


def peak_tflops(device: torch.device, bf16: bool, given: float | None) -> tuple[float | None, str]:
    """(peak TFLOP/s per device or None, where it came from)."""
    if given:
        return given, f"--peak-tflops {given:g}"
    if device.type == "cuda" and bf16:
        name = torch.cuda.get_device_name(device)
        for key, tf in PEAK_TFLOPS_BF16.items():
            if key in name:
                return tf, f"{name} dense bf16 peak {tf:g} TFLOP/s"
        return None, f"no known peak for {name!r}; pass --peak-tflops"
    what = "fp32 on CUDA" if device.type == "cuda" else "CPU"
    return None, f"no agreed peak for {what}; pass --peak-tflops to get MFU"


def fmt_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


def loss_windows(before: list[float], session: list[float], first_step: int, last_step: int,
                 width: int = 20) -> str:
    """The summary's loss comparison with windowed means, not two single noisy steps: the mean of
    the last ``width`` steps before this invocation (a resumed run; ``before``) against the mean of
    its last ``width`` steps. A fresh run starts from its first step (the loss of the initial
    weights, not noise)."""
    w = max(1, min(width, len(session) // 2 or 1))
    end = f"{sum(session[-w:]) / w:.4f} (mean of steps {last_step - w + 1}-{last_step}; last step {session[-1]:.4f})"
    if before:
        b = before[-width:]
        return f"{sum(b) / len(b):.4f} (mean of steps {first_step - len(b) + 1}-{first_step}) -> {end}"
    return f"{session[0]:.4f} (step {first_step + 1}) -> {end}"


class TensorBoard:
    """Scalars to a TensorBoard log directory (rank 0), if the ``tensorboard`` package is installed;
    otherwise a no-op, after ``problem`` says why."""

    def __init__(self, logdir: str | None, enabled: bool):
        self.writer = None
        self.problem = None
        if not logdir or not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            self.problem = (f"--tensorboard {logdir!r}: not logging, the tensorboard package is not installed "
                            f"({e}); pip install tensorboard, or leave the flag out (metrics.jsonl has every value)")
            return
        self.writer = SummaryWriter(logdir)

    def write(self, row: dict) -> None:
        if self.writer is None:
            return
        for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "mfu",
                    "step_time_s", "mem_gb"):
            if row.get(key) is not None:
                self.writer.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", row[key], row["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def validation_points(metrics_rows: list[dict], events_path: str | None, final_val: tuple | None) -> list[tuple]:
    """(step, val_loss) of every validation this run has recorded: the --eval-every points in
    metrics.jsonl, the end-of-run ones of earlier invocations in events.jsonl ("end" events), and
    this invocation's ``final_val``. Points of a continuation set aside by a rewind (a ``rewind``
    event after them) and points past the last metrics step are dropped; one point per step, the
    latest recorded."""
    last = metrics_rows[-1]["step"] if metrics_rows else 0
    ends = {}
    for e in read_jsonl(events_path) if events_path else []:
        if e.get("event") == "end" and e.get("val_loss") is not None and e.get("step") is not None:
            ends[e["step"]] = e["val_loss"]
        elif e.get("event") == "rewind":
            ends = {s: v for s, v in ends.items() if s <= e["step"]}
    val = {r["step"]: r["val_loss"] for r in metrics_rows if r.get("val_loss") is not None}
    val.update(ends)
    if final_val is not None and final_val[1] is not None:
        val[final_val[0]] = final_val[1]
    return sorted((s, v) for s, v in val.items() if s <= last)


def plot_loss(metrics_path: str, png_path: str, title: str = "", final_val: tuple | None = None,
              events_path: str | None = None) -> list[str]:
    """The loss curve, the validation points and the learning rate of ``metrics.jsonl`` as a PNG.
    Returns the legend's labels ([] and no file if there is nothing to plot)."""
    rows = read_jsonl(metrics_path)
    if not rows:
        return []
    # A bare Figure (no pyplot: no backend chosen, no figure manager, ~0.2 s less at every job's end); savefig
    # renders with Agg for a .png
    from matplotlib.figure import Figure

    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.add_subplot()
    ax.plot(steps, loss, color="tab:blue", lw=0.8, alpha=0.45, label="train loss")
    k = max(1, len(loss) // 30)
    if k > 1:  # a moving average
        smooth = [sum(loss[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(loss))]
        ax.plot(steps, smooth, color="tab:blue", lw=1.8, label=f"mean of {k}")
    val = validation_points(rows, events_path, final_val)
    if val:
        ax.plot(*zip(*val), "o-", color="tab:red", ms=4, label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if "lr" in rows[0]:
        ax2 = ax.twinx()
        (lr_line,) = ax2.plot(steps, [r["lr"] for r in rows], color="tab:gray", lw=1, ls="--", label="learning rate")
        ax2.set_ylabel("learning rate", color="tab:gray")
        handles, labels = handles + [lr_line], labels + ["learning rate (right axis)"]
    ax.legend(handles, labels, loc="upper right")
    ax.set_title(title or "pretraining loss")
    fig.tight_layout()
    tmp = png_path + ".part.png"
    fig.savefig(tmp)
    os.replace(tmp, png_path)
    return labels


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
