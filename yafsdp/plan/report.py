"""The memory plan of a model, wrapped or not: bytes per rank by role (see ``yafsdp/plan/__init__.py``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


from .. import formats
from ..engine.placement import placement_class
from .activations import ActivationEstimate
from ..layout.sizing import GiB, BufferSpec, itemsize

@dataclass
class UnitRow:
    name: str
    numel: int
    padded_numel: int
    shard_numel: int
    weight_slot: str
    grad_slot: str
    outsized: bool
    weight_free_bw: bool = False  # ZeRO-3 skips its backward re-gather (runtime.py [Note: weight-free backward])
    # Bytes one gather of the unit brings to each rank (the all-gather outputs: param_dtype values, or
    # the gathered records of compact groups) and the name of the gather format of its trainable group
    # when it is gathered compact ("fp8", "int8"; None: param_dtype values), as the option gather_dtype
    # names it
    gather_bytes: int = 0
    gather_dtype: str | None = None
    # secondary_shard: bytes of its secondary shard on each rank (0: it keeps none, its backward gather,
    # if any, spans the shard group). See [Note: the secondary shard] in yafsdp/engine/secondary.py.
    secondary_bytes: int = 0

    @property
    def compact(self) -> bool:
        """Its trainable group is gathered as records of a gather format (any: ``gather_dtype``)."""
        return self.gather_dtype is not None


@dataclass
class MemoryPlan:
    world_size: int
    rank: int
    zero_stage: int
    param_dtype: str
    reduce_dtype: str
    optimizer: str
    num_params: int  # Psi: parameters of the model, tied ones once, unpadded
    shard_numel: int  # this rank's shard elements over all flat units (padded)
    largest_unit: int  # L: padded elements of the largest unit in the alternating pair
    units: list[UnitRow]
    slots: list[BufferSpec]
    master: int
    grad: int
    compute_copy: int
    optimizer_state: int
    frozen: int = 0  # frozen groups' shards, in param_dtype (no master, grad or optimizer state)
    nf4: int = 0  # NF4 groups' shards: packed 4-bit codes + block scales (quantize_frozen="nf4")
    quantize_frozen: str | None = None
    # async_save=True: host bytes of an asynchronous save's staging copy (yafsdp/plan/staging.py);
    # host memory on top of the engine's allocations, so not in engine_bytes()
    checkpoint_staging: int = 0
    # offload="optimizer": master, grad shard and optimizer state on the host, plus the host side of
    # the compute copy (compute_host; 0 in fp32, where it is the master) and the reduced grads'
    # landing (grad_landing). See [Note: host and device tensors] in yafsdp/engine/alloc.py.
    offload: str | None = None
    compute_host: int = 0
    grad_landing: int = 0
    # records of the trainable groups gathered compact (gather_dtype="fp8" / "int8"): the role named
    # after the format in engine_bytes(). See [Note: gather formats] in yafsdp/formats/base.py.
    records: int = 0
    # offload with a compact gather_dtype: the records' host side (what the optimizer writes), the role
    # "<format>_host" in engine_bytes()
    gather_host: int = 0
    gather_dtype: str | None = None
    # "fp32": the reduce_dtype pieces are summed in fp32 (reduce_accum_dtype; yafsdp/comm/reduce_accum.py)
    reduce_accum_dtype: str | None = None
    activations: ActivationEstimate | None = None
    notes: list[str] = field(default_factory=list)
    # host bytes the streaming HF loader adds at its peak (yafsdp.integrations.hf_stream.load_host_bytes)
    load_host: int = 0
    export_unit: int = 0  # bytes of the largest unit gathered whole (yafsdp.hf.export_hf streams units)
    # secondary_shard=N (0: off): the size of the subgroups the backward gathers run in, and the bytes
    # of the units' secondary shards (the role "secondary"; per unit: UnitRow.secondary_bytes)
    secondary_shard: int = 0
    secondary: int = 0
    # world 1: the grad shards (``grad`` bytes) are allocated during backward and freed by
    # zero_grad(set_to_none=True): counted in the step's peak (``total``), not between steps
    # (``engine_bytes()["grad"]`` 0). See [Note: the grad shard's lifetime at world 1] in layout/sizing.py.
    grad_in_step: bool = False
    # world 1: units gathered by casting their fp32 master into a buffer, without a compute copy
    # ([Note: the world-1 cast gather] in layout/sizing.py)
    cast_units: int = 0
    # the units gathered ahead of the one computing (ZeRO-3): with buffers in use only (world 1), how many
    # regular buffers are held beside the outsized one at the start of backward
    prefetch: int = 1

    # Bytes by role -----------------------------------------------------------------------
    def _slot_bytes(self, role: str, kind: str | None = None) -> int:
        return sum(s.nbytes for s in self.slots if s.role == role and (kind is None or s.kind == kind))

    @property
    def weight_buffers(self) -> int:
        return self._slot_bytes("buffers", "weight")

    @property
    def grad_buffers(self) -> int:
        return self._slot_bytes("buffers", "grad")

    @property
    def small_group(self) -> int:
        return self._slot_bytes("small")

    @property
    def outsized_buffers(self) -> int:
        return self._slot_bytes("outsized")

    @property
    def engine_total(self) -> int:
        """Every byte the engine itself allocates on this rank."""
        return sum(self.engine_bytes().values())

    @property
    def model_state(self) -> int:
        """Sharded state + optimizer state: what the ZeRO paper calls model states."""
        return (self.master + self.grad + self.compute_copy + self.frozen + self.nf4 + self.records
                + self.optimizer_state)

    @property
    def _gather_host_row(self) -> str:
        return f"{(self.gather_dtype or '').upper()} records host staging"

    @property
    def total(self) -> int:
        """Every byte, host and device (see ``device_total`` / ``host_total`` for the split)."""
        act = self.activations.total if self.activations is not None else 0
        return self.engine_total + self.optimizer_state + self.step_bytes(act) + self.checkpoint_staging

    def step_bytes(self, activations: int, saved: int | None = None) -> int:
        """What a step adds at its peak on top of the state between steps, for an activation peak of
        ``activations`` bytes: those; at world 1, where the grad shards are made during backward, the larger
        of those (the start of backward, before any grad shard) and every grad shard with the last unit's
        gradients (the end of backward: [Note: the grad shard's lifetime at world 1] in layout/sizing.py);
        and where the weight buffers are held in use only (world 1, ZeRO-3: [Note: world-1 buffers in
        use only]), the larger of that and everything saved for backward (``saved``; default: the
        plan's estimate's) beside the buffers of the start of backward (``in_use_peak``). The activation
        peak is at the start of backward, where the head's re-gathered weights meet its gradient's
        transients, which by then have freed the head's saved log-softmax: the estimate's transient (two
        tensors of that size) covers the head's buffer at the sizes measured (benchmarks/bench_world1.py)."""
        peak = activations
        in_use = self.in_use_peak
        if in_use:
            if saved is None:
                saved = self.activations.saved if self.activations is not None else 0
            peak = max(peak, saved + in_use)
        if self.grad_in_step:
            last = self.activations.unit_grad_bytes if self.activations is not None else 0
            regular = max((s.nbytes for s in self.slots if s.in_use and s.role == "buffers"), default=0)
            peak = max(peak, self.grad + last + regular)
        return peak

    @property
    def in_use_peak(self) -> int:
        """Bytes of the weight buffers held in use only (world 1, ZeRO-3) at their most: the outsized
        unit's with the ``prefetch`` regular buffers gathered ahead of it in backward, or every regular
        buffer (a block's backward with its prefetches); 0 when every buffer is held for the run."""
        regular = [s.nbytes for s in self.slots if s.in_use and s.role == "buffers"]
        big = sum(s.nbytes for s in self.slots if s.in_use and s.role == "outsized")
        if not regular and not big:
            return 0
        return max(big + min(self.prefetch, len(regular)) * max(regular, default=0), sum(regular))

    @property
    def step_grads(self) -> int:
        """Bytes the grad shards add to the step's peak beyond the activations' (world 1), else 0."""
        act = self.activations.total if self.activations is not None else 0
        return self.step_bytes(act) - act

    def placement(self) -> dict[str, str]:
        """Where each role of :meth:`engine_bytes` lives ("host" / "device"), as ``YaFSDP.placement()``;
        the optimizer state is where the master shards are."""
        return {k: self._place.where_role(k) for k in self.engine_bytes()}

    @property
    def _place(self):
        """The placement's rules for ``offload`` (engine/placement.py): where each role lives."""
        return placement_class(self.offload)

    @property
    def host_bytes(self) -> int:
        """Engine bytes on the host (``sum(YaFSDP.allocated_bytes("host").values())``)."""
        where = self.placement()
        return sum(v for k, v in self.engine_bytes().items() if where[k] == "host")

    @property
    def device_bytes(self) -> int:
        """Engine bytes on the device (``sum(YaFSDP.allocated_bytes("device").values())``)."""
        return self.engine_total - self.host_bytes

    @property
    def device_total(self) -> int:
        """Per GPU: the engine's device tensors, the optimizer state unless offloaded, activations."""
        act = self.activations.total if self.activations is not None else 0
        return self.device_bytes + (0 if self._place.optimizer_on_host else self.optimizer_state) + self.step_bytes(act)

    @property
    def host_total(self) -> int:
        """Per rank on the host: with offload the master, grad, compute staging, landing and the
        optimizer state (pinned); with ``async_save`` the checkpoint's staging copy (pageable)."""
        return (self.host_bytes + (self.optimizer_state if self._place.optimizer_on_host else 0)
                + self.checkpoint_staging)

    def host_phases(self) -> dict[str, int]:
        """Host bytes per rank in each phase of a job: ``training`` (``host_total``: what offload and
        async_save keep there), ``load`` (that + the streaming loader's peak, ``load_host``), ``export``
        (that + the writer's conversion chunks; the gathered unit is on the device, in host memory
        only on a CPU engine). Not counted: the interpreter, torch and CUDA's own host memory."""
        from ..integrations.export import CHUNK_BYTES

        return dict(load=self.host_total + self.load_host, training=self.host_total,
                    export=self.host_total + 2 * CHUNK_BYTES)

    def engine_bytes(self) -> dict[str, int]:
        """The same keys and values as ``YaFSDP.allocated_bytes()`` returns once wrapped."""
        out = {"master": self.master, "grad": 0 if self.grad_in_step else self.grad, "compute_copy": self.compute_copy,
               "frozen": self.frozen,
               "nf4": self.nf4}
        for fmt in formats.gather_formats():  # one role per gather format, as YaFSDP.allocated_bytes()
            out[fmt.name] = self.records if fmt.name == self.gather_dtype else 0
        if self._place.optimizer_on_host:
            out.update(compute_host=self.compute_host, grad_landing=self.grad_landing)
        if self._place.optimizer_on_host and self.gather_dtype is not None:  # as YaFSDP.allocated_bytes(), 0 included
            out[f"{self.gather_dtype}_host"] = self.gather_host
        if self.secondary:
            out["secondary"] = self.secondary
        for s in self.slots:
            if s.kind == "weight":  # in use only: no memory between steps ([Note: world-1 buffers in use only])
                out[s.name] = 0 if s.in_use else s.capacity * itemsize(s.dtype)
                if s.staging_bytes:
                    out[s.name + "_staging"] = s.staging_bytes
                if s.landing_bytes:
                    out[s.name + "_landing"] = s.landing_bytes
        for s in self.slots:
            if s.kind == "grad":
                out[s.name] = s.capacity * itemsize(s.dtype)
                out[s.name + "_staging"] = s.shard_capacity * itemsize(s.dtype)
                if s.accum_capacity:
                    out[s.name + "_accum"] = 4 * s.accum_capacity
                if s.quant_bytes:
                    out[s.name + "_quant"] = s.quant_bytes
        return out

    def rows(self) -> list[tuple[str, int]]:
        """(role, bytes) in the order the table prints them."""
        rows = [
            ("master shard (fp32)", self.master),
            ("grad shards (fp32; world 1: in backward, freed by zero_grad)" if self.grad_in_step
             else "grad shard (fp32)", self.grad),
            (f"optimizer state ({self.optimizer})", self.optimizer_state),
            *([(f"compute copy host staging ({self.param_dtype})", self.compute_host),
               (f"reduced-grad landing ({self.reduce_dtype})", self.grad_landing)] if self._place.optimizer_on_host
              else []),
            (f"compute copy ({self.param_dtype})" + (f" (none for {self.cast_units} units: cast into buffers)"
                                                      if self.cast_units else ""), self.compute_copy),
            (f"frozen shard ({self.param_dtype})", self.frozen),
            *([(self._nf4_row, self.nf4)] if self.quantize_frozen else []),
            *([(f"compute copy, {self.gather_dtype.upper()} records ({formats.get(self.gather_dtype).label})",
                self.records)] if self.gather_dtype else []),
            *([(self._gather_host_row, self.gather_host)] if self.gather_host else []),
            ("weight buffers" + (" (none: world 1 aliases the shards)" if self.world_size == 1
                                                   and not self.weight_buffers else " (per unit, ZeRO-2)" if self.zero_stage == 2 else
                                                   f" (x{sum(s.kind == 'weight' and s.role == 'buffers' for s in self.slots)})")
             # none at world 1 without offload, where the records expand where they lie ([Note: world-1 records in place])
             + (" + NF4 staging" if self.quantize_frozen and any(s.kind == "weight" and s.staging_bytes for s in self.slots)
                else "")
             + (" + frozen landing" if self._place.host_frozen else "")
             + (self._in_use_label if any(s.in_use and s.role == "buffers" for s in self.slots) else ""),
             self.weight_buffers),
            *([(f"secondary shards (1/{self.secondary_shard} of each unit re-gathered in backward)",
                self.secondary)] if self.secondary_shard else []),
            ("grad buffers (x2, + staging)", self.grad_buffers),
            ("small group (weight + grad)", self.small_group),
            ("outsized-unit buffers" + (self._in_use_label if any(s.in_use and s.role == "outsized" for s in self.slots)
                                        else ""), self.outsized_buffers),
        ]
        if self.activations is not None:
            a = self.activations
            ck = (", checkpointed" if len(a.checkpointed) == a.blocks else
                  f", {len(a.checkpointed)}/{a.blocks} blocks checkpointed") if a.checkpointing else ""
            rows.append((f"activations (b={a.batch}, s={a.seq}{ck}, saved)", a.saved))
            rows.append(("backward transient (estimate)", a.transient))
        if self.checkpoint_staging:
            rows.append((self._staging_row, self.checkpoint_staging))
        rows.append(("total", self.total))
        return rows

    _staging_row = "async-save staging copy (host, kept between saves)"
    _in_use_label = " (world 1: held in use only, in the step's peak)"

    def _host_rows(self) -> list[str]:
        if not self._place.optimizer_on_host:
            return [self._staging_row] if self.checkpoint_staging else []
        return [self._staging_row, "master shard (fp32)", "grad shard (fp32)", f"optimizer state ({self.optimizer})",
                f"compute copy host staging ({self.param_dtype})", f"reduced-grad landing ({self.reduce_dtype})",
                *([self._gather_host_row] if self.gather_host else []),
                *([f"frozen shard ({self.param_dtype})", self._nf4_row] if self._place.host_frozen else [])]

    @property
    def _nf4_row(self) -> str:
        return f"frozen NF4 shard (4-bit codes + {self.param_dtype} block scales)"

    def zero_formula(self) -> dict[str, float]:
        """The ZeRO paper's model-state formula (Rajbhandari et al. 2020, mixed-precision Adam,
        K = 12) next to ours, in bytes per rank."""
        psi, n = self.num_params, self.world_size
        if self.zero_stage == 3:
            zero = 16 * psi / n  # (2 + 2 + K) Psi / N
        else:
            zero = 2 * psi + 14 * psi / n  # 2 Psi + (2 + K) Psi / N
        ours = self.model_state + (self.weight_buffers if self.zero_stage == 2 else 0)
        return {"zero_paper": zero, "yafsdp": float(ours), "ratio": ours / zero if zero else float("nan")}

    def format(self) -> str:
        lines = [
            f"yafsdp memory plan: world_size={self.world_size} rank={self.rank} zero_stage={self.zero_stage} "
            f"param_dtype={self.param_dtype} reduce_dtype={self.reduce_dtype}"
            + (f" reduce_accum_dtype={self.reduce_accum_dtype}" if self.reduce_accum_dtype else ""),
            f"  parameters Psi={self.num_params:,}  local shard={self.shard_numel:,} elements  "
            f"largest regular unit L={self.largest_unit:,} elements  units={len(self.units)}",
        ]
        big = [u.name for u in self.units if u.outsized]
        if big:
            chunked = any(" chunks" in u.grad_slot for u in self.units if u.outsized)
            lines.append(f"  outsized units (own shared {'weight ' if chunked else ''}buffer"
                         f"{'; gradients reduced in chunks through the grad pair' if chunked else ''}): {', '.join(big)}")
        free = [u.name for u in self.units if u.weight_free_bw]
        if free and self.zero_stage == 3:
            lines.append(f"  not re-gathered for backward (weight-free backward): {', '.join(free)}")
        if self.secondary_shard:
            kept = [u.name for u in self.units if u.secondary_bytes]
            named = ", ".join(kept) if len(kept) <= 4 else f"{len(kept)} units ({kept[0]} ... {kept[-1]})"
            lines.append(f"  secondary shard: backward gathers within groups of {self.secondary_shard} ranks for "
                         f"{named or 'no unit'}; the others keep none (weight-free backward, or alone in their "
                         "weight buffer: not re-gathered)")
        w = max(len(r) for r, _ in self.rows())
        host_rows = set(self._host_rows())
        split = self._place.optimizer_on_host or self.checkpoint_staging  # rows on both sides: say where
        lines.append(f"  {'role':<{w}}  {'bytes':>16}  {'GiB':>9}"
                     + ("  where" if split else ""))
        for role, b in self.rows():
            if role == "total":
                lines.append("  " + "-" * (w + 29))
            where = ("  host" if role in host_rows else "  device" if role != "total" else "") if split else ""
            lines.append(f"  {role:<{w}}  {b:>16,}  {b / GiB:>9.3f}{where}")
        if split:
            lines.append(f"  {'per GPU (device)':<{w}}  {self.device_total:>16,}  {self.device_total / GiB:>9.3f}")
            host = "per rank on the host" + (" (pinned: offload)" if self._place.optimizer_on_host else "")
            lines.append(f"  {host:<{w}}  {self.host_total:>16,}  "
                         f"{self.host_total / GiB:>9.3f}")
        lines.append(f"  {'host at load (hf streaming)':<{w}}  {self.load_host:>16,}  "
                     f"{self.load_host / GiB:>9.3f}")
        h = self.host_phases()
        lines.append(f"  host per rank, engine + I/O (add the interpreter's own): at load {h['load'] / GiB:.3f} GiB,"
                     f" training {h['training'] / GiB:.3f} GiB, export {h['export'] / GiB:.3f} GiB")
        z = self.zero_formula()
        stage = "16 Psi/N" if self.zero_stage == 3 else "2 Psi + 14 Psi/N"
        lines.append(
            f"  model state vs ZeRO paper ({stage}, mixed-precision Adam K=12): "
            f"{z['yafsdp'] / GiB:.3f} GiB vs {z['zero_paper'] / GiB:.3f} GiB (x{z['ratio']:.3f}; "
            "yafsdp keeps an fp32 grad shard where ZeRO counts a 16-bit one, +2 Psi/N)"
        )
        if self.grad_in_step:
            lines.append("  world 1: the grad shards are made unit by unit during backward (as the activations are "
                         "freed) and freed by zero_grad(set_to_none=True); the total counts the larger of the "
                         "activations and every grad shard with the last unit's gradients")
        if self.in_use_peak:
            lines.append("  world 1: the weight buffers hold memory only from a unit's gather to its release (none between "
                         "steps); the total counts the larger of the activation peak and what is saved for backward "
                         f"with {self.in_use_peak / GiB:.3f} GiB of them (the head's and the prefetched layer's)")
        if self.export_unit:
            lines.append("  " + self.export_line())
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)

    def export_line(self, max_shard_size="5GB") -> str:
        """What the writing rank holds during ``yafsdp.hf.export_hf`` / ``export_merged``; see
        [Note: streaming export] in yafsdp/integrations/export.py."""
        from ..integrations.export import CHUNK_BYTES, parse_size

        shard, chunks = parse_size(max_shard_size), 2 * CHUNK_BYTES
        return (f"export (writing rank): the largest unit gathered {self.export_unit / GiB:.3f} GiB (on the device; "
                f"host memory in a CPU run) + conversion chunks {chunks / GiB:.3f} GiB host; no output shard is "
                f"held (each tensor is written as it arrives): within the goal's one shard ({shard / 1e9:g} GB) + "
                f"the largest unit + 1 GiB = {(shard + self.export_unit + GiB) / GiB:.3f} GiB")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slots"] = [dict(asdict(s), dtype=str(s.dtype).replace("torch.", ""), nbytes=s.nbytes) for s in self.slots]
        d["activations"] = asdict(self.activations) if self.activations is not None else None
        d["roles"] = dict(self.rows())
        d["engine_bytes"] = self.engine_bytes()
        d["placement"] = self.placement()
        d["device_total"], d["host_total"] = self.device_total, self.host_total
        d["host_phases"] = self.host_phases()
        d["zero_formula"] = self.zero_formula()
        return d
