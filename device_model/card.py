"""The description of one Spyre card: every number the model uses, with its source.

Defaults come from ``../shared/CARD.md``. "public" numbers are IBM's or torch-spyre's own;
"derived" numbers are computed from public ones and "assumption" marks a modelling choice
that no public source pins down. Derived and assumed numbers are parameters like every other,
so a user can change them and see what moves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CardSpec", "DEFAULT_CARD"]

GB = 10**9
MiB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class CardSpec:
    """The card, as the simulator sees it. Frozen and keyword-only; use :meth:`replace`.

    Attributes (defaults and sources):
        num_cores: 32 active AI cores. Public (IBM research blog; torch-spyre
            ``architecture/spyre_accelerator.md``).
        corelets_per_core: 2 corelets sharing one scratchpad. Public (torch-spyre docs).
        pe_rows, pe_cols: each corelet's PE array is 8 x 8. Public (IBM blog "Lifting the cover
            on the IBM Spyre accelerator").
        pe_simd: 8-wide SIMD per PE. Public (same).
        clock_hz: 1.5 GHz. Derived: 98.304 TFLOPS = 32 x 2 x 8x8 x 8 x 2 flop x 1.5 GHz.
        scratchpad_bytes: 2 MiB SRAM ("LX") per core. Public.
        scratchpad_usable_frac: 0.8; 20% is reserved for the backend compiler. Public
            (torch-spyre ``DXP_LX_FRAC_AVAIL``).
        stick_bytes: data moves in 128-byte sticks. Public (``BYTES_IN_STICK``).
        device_memory_bytes: 128 GB LPDDR5. Public (``dataflow_architecture.md``).
        device_memory_ecc_bytes: 16 GB of it holds ECC, leaving 112 GB usable. Public.
        device_memory_bw: 204.8 GB/s aggregate peak. Public (``_HBM_BW_GBS``).
        ring_bytes_per_cycle: 128 B per cycle per direction on the bidirectional ring. Public.
            The rate of the operand forwarding inside a kernel (a uniform shift, a multicast, an
            all-to-all pattern: each the busiest link's bytes at this rate).
        ring_fixed_s: 5 ns per ring transfer step of a kernel, torch-spyre's fitted ring term
            (public, calibrated on 1535 kernels: "below measurement noise, about 5 ns"). The
            calibration notes' stand-alone ring kernels (a shift, 58 us fixed; an all-to-all,
            7.3 us fixed at 36 GB/s; CARD.md, secondary) are data-movement kernels of their own,
            which no JAX or torch op lowers to here; the model follows torch-spyre for the
            forwarding inside kernels, which every published matmul (forwarding at each step,
            within 10% of the model) bears out (``spyre-jax bench calibrate`` lists them).
        max_span_bytes: 256 MiB, the largest contiguous span one core addresses. Public
            (``MAX_SPAN_BYTES``).
        pcie_bw: 64 GB/s, PCIe gen5 x16 per direction (32 GT/s x 16 lanes, 128b/130b coding
            rounds to ~63 GB/s). Derived from the public "PCIe gen5 x16".
        sfu_elems_per_cycle: 64 elements per cycle per corelet for the 1D special-function unit.
            Assumption: one 128-byte fp16 stick per cycle; not published. Calibrated in the
            timing-model work against the measured softmax.
        sfu_ops_per_elem_transcendental: 4 SFU passes for exp/log/tanh/erf/logistic/rsqrt/...
            Assumption (not published).
        memory_bw_one_way: 150 GB/s, the device-memory rate a kernel that only reads
            sustains. Public, calibrated: torch-spyre's cost model, fitted on 1535 kernel
            configurations measured on the card (``compiler/cost_model.md``; CARD.md). Sets the
            external bound (:attr:`bound_flops`, ``cost_analysis()["bound_us"]``).
        memory_bw_write_only: 132.5 GB/s, the device-memory rate a kernel that only writes
            sustains: the middle of the 125-140 GB/s measured (CARD.md, calibration notes,
            secondary).
        memory_bw_balanced: 104 GB/s, the rate when reads and writes are balanced: an
            elementwise neg measured 104 GB/s, a gelu 100 (calibration notes, secondary);
            torch-spyre's fit on 1535 kernels gives 105 (public). Between the three rates the
            time of a stage's traffic is :meth:`memory_seconds`: its reads at the read rate, its
            writes at the write rate, and the bytes that alternate (the smaller of the two) pay
            a turnaround that makes an even mix run at this rate.
        reduction_read_bw: 82.9 GB/s, the rate a stage that reduces along a row reads at (the
            SFUs reduce each stick to one element, then across the sticks of a row). Fitted by
            ``spyre-jax bench calibrate`` on the reduction family (four kernels: softmax at three
            shapes, RMSNorm's statistics), with ``reduction_fixed_s``.
        reduction_fixed_s: 2.16 us per reduction in a stage (a softmax has two: the maximum and
            the sum), the synchronization of the partial results across a row's sticks and
            corelets. Fitted with ``reduction_read_bw`` (same four kernels).
        kernel_fixed_s: 0.86 us, the fixed device time of a kernel: at least one tile of its
            loop, which the calibration notes measure at about 860 ns per tile (CARD.md,
            secondary). Added to every kernel's time and to its bound.
        pe_macs_per_ns_per_core: 1140 multiply-accumulates per ns per core, the PE rate matmuls
            sustain (the datasheet's 1536 is called about 33% optimistic). Public, calibrated
            (same source). The timing model's PE rate (:attr:`pe_flops_sustained_per_core`, at
            most the array's nominal rate) and the external bound's, 72.96 TFLOPS on 32 cores.
        bmm_batch_outer_macs_per_ns_per_core: 616 multiply-accumulates per ns per core for a
            batched matmul with the batch dimension outermost in every operand, as our layouts
            keep it. Fitted by ``spyre-jax bench calibrate`` on the measured B = 2, 4, 8 cases
            of a [B, 1024, 2048] x [B, 2048, 1024] matmul (228 / 458 / 917 us: CARD.md,
            calibration notes). torch-spyre's fit gives 160 per ns for the compiler's default
            layout and "up to 8.3x faster" batch-outer (an upper bound, 1328, above the
            sustained 1140); the default layout, which our schedules never choose, is not
            modelled.
        relayout_bw: 116 GB/s, the device-memory rate of a re-layout (restickify: a transpose
            that moves the stick dim, a reshape across sticks). Public, calibrated (same
            source). The timing model runs such stages at this rate (reads and writes together),
            not the mix rates of :meth:`memory_seconds`.
            The same fit's broadcast (118 GB/s) and cross-row reduction (113 GB/s) rates are not
            used: no kernel time of CARD.md pins them (a reduction along the rows has its own
            rate, ``reduction_read_bw``).
        link_bw: 64 GB/s per direction, the card-to-card link tensor parallelism's collectives
            run on: PCIe gen5 x16 peer-to-peer (the card's bus; CARD.md). Assumption: no
            card-to-card bandwidth is published (CARD.md, "Serving configurations"), so the
            bus's per-direction rate stands in; a switch or host bridge between the cards would
            lower it.
        link_latency_s: 2 us per hop of a collective (one peer-to-peer transfer's setup and
            flight). Assumption: not published for the card; typical of PCIe peer-to-peer DMA
            between accelerators (1-3 us in public GPU measurements such as NVIDIA's
            ``p2pBandwidthLatencyTest``).
        host_launch_s: 70 us, the host's CPU time to launch one compiled kernel. Public
            (CARD.md: "host launch of one compiled kernel on the new stack: about 0.07 ms of
            CPU time"). Charged where the stream waits for the host: between the enqueued
            iterations of a loop whose body kernel is shorter, and after each value the host
            reads back to decide (``device_model.hostprog``).
        host_round_trip_s: 10 us for the host to learn that a kernel finished and read a scalar
            it wrote (a loop's predicate, a branch's index), besides the ``copy_out`` of its
            bytes over PCIe. Assumption: CARD.md has no figure for it; a completion interrupt
            and a PCIe read take some microseconds on other accelerators. Each read back costs
            this plus ``host_launch_s``.
        streams_per_priority: 32 streams of each priority besides the default stream 0: ids
            1-32 are low priority, 33-64 high. Public (torch-spyre streams; CARD.md).
        dl16_rounding: False. When True, every store of an fp16/bf16 tensor first rounds to
            DL16 (IBM DLFloat16: 6 exponent, 9 fraction bits, ties away from zero; see
            ``device_model.numerics``), the 16-bit format the card's units work in, then to the
            tensor's dtype. A modelling switch, not a hardware fact.
    """

    num_cores: int = 32
    corelets_per_core: int = 2
    pe_rows: int = 8
    pe_cols: int = 8
    pe_simd: int = 8
    clock_hz: float = 1.5e9
    scratchpad_bytes: int = 2 * MiB
    scratchpad_usable_frac: float = 0.8
    stick_bytes: int = 128
    device_memory_bytes: int = 128 * GB
    device_memory_ecc_bytes: int = 16 * GB
    device_memory_bw: float = 204.8e9
    ring_bytes_per_cycle: int = 128
    ring_fixed_s: float = 5e-9
    max_span_bytes: int = 256 * MiB
    pcie_bw: float = 64e9
    sfu_elems_per_cycle: int = 64
    sfu_ops_per_elem_transcendental: int = 4
    memory_bw_one_way: float = 150e9
    memory_bw_write_only: float = 132.5e9
    memory_bw_balanced: float = 104e9
    reduction_read_bw: float = 82.9e9
    reduction_fixed_s: float = 2.16e-6
    kernel_fixed_s: float = 0.86e-6
    pe_macs_per_ns_per_core: float = 1140.0
    bmm_batch_outer_macs_per_ns_per_core: float = 616.0
    relayout_bw: float = 116e9
    link_bw: float = 64e9
    link_latency_s: float = 2e-6
    host_launch_s: float = 70e-6
    host_round_trip_s: float = 10e-6
    streams_per_priority: int = 32
    dl16_rounding: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "dl16_rounding":
                if not isinstance(v, bool):
                    raise ValueError(f"CardSpec.dl16_rounding must be a bool, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
                raise ValueError(f"CardSpec.{f.name} must be a positive number, got {v!r}")
        if not max(self.memory_bw_one_way, self.memory_bw_write_only) <= self.device_memory_bw:
            raise ValueError(
                "CardSpec: memory_bw_one_way and memory_bw_write_only must not exceed "
                "device_memory_bw"
            )
        harmonic = 2 / (1 / self.memory_bw_one_way + 1 / self.memory_bw_write_only)
        if self.memory_bw_balanced > harmonic * (1 + 1e-12):
            raise ValueError(
                "CardSpec: memory_bw_balanced must not exceed the harmonic mean of the read and "
                f"write rates ({harmonic / 1e9:.1f} GB/s): an even mix is never faster than "
                "reading and writing one after the other"
            )
        if self.scratchpad_usable_frac > 1:
            raise ValueError("CardSpec.scratchpad_usable_frac must be at most 1")
        if self.device_memory_ecc_bytes >= self.device_memory_bytes:
            raise ValueError("CardSpec: ECC share must be smaller than device memory")

    # ---- derived figures (properties, so they follow the parameters) ----
    @property
    def scratchpad_usable_bytes(self) -> int:
        """Bytes of scratchpad a program may plan per core (about 1.6 MiB), stick-aligned."""
        usable = int(self.scratchpad_bytes * self.scratchpad_usable_frac)
        return usable - usable % self.stick_bytes

    @property
    def device_memory_usable_bytes(self) -> int:
        """Device memory the allocator hands out: total less the ECC share (112 GB)."""
        return self.device_memory_bytes - self.device_memory_ecc_bytes

    @property
    def pe_flops_per_cycle_per_core(self) -> int:
        """fp16 flops per cycle per core: corelets x PE rows x cols x SIMD x 2 (multiply-add)."""
        return self.corelets_per_core * self.pe_rows * self.pe_cols * self.pe_simd * 2

    @property
    def peak_flops(self) -> float:
        """Peak fp16 flops of the card (98.304 TFLOPS with the defaults)."""
        return self.pe_flops_per_cycle_per_core * self.num_cores * self.clock_hz

    @property
    def pe_flops_sustained_per_core(self) -> float:
        """The fp16 flops per second one core's PEs sustain on a matmul: the PE array's rate
        scaled by the published sustained MAC rate over the array's nominal one (1140 of
        1536 MAC/ns: 2.28 TFLOPS of the 3.07 the array peaks at with the defaults)."""
        nominal = self.pe_flops_per_cycle_per_core * self.clock_hz
        return min(nominal, 2 * self.pe_macs_per_ns_per_core * 1e9)

    @property
    def pe_flops_batched_per_core(self) -> float:
        """The fp16 flops per second one core's PEs sustain on a batched matmul in our layouts
        (the batch dim outermost): ``bmm_batch_outer_macs_per_ns_per_core`` MAC per ns, at most
        :attr:`pe_flops_sustained_per_core`."""
        outer = 2 * self.bmm_batch_outer_macs_per_ns_per_core * 1e9
        return min(self.pe_flops_sustained_per_core, outer)

    @property
    def bound_flops(self) -> float:
        """The sustained fp16 flops of the card's PEs (72.96 TFLOPS with the defaults): twice
        ``pe_macs_per_ns_per_core`` per ns, times the cores."""
        return 2 * self.pe_macs_per_ns_per_core * 1e9 * self.num_cores

    def memory_seconds(
        self, reads: Any, writes: Any, read_bw: float | None = None, *, mixed: bool = True
    ) -> Any:
        """Seconds of device-memory traffic of ``reads`` and ``writes`` bytes: the reads at
        ``read_bw`` (default ``memory_bw_one_way``), the writes at ``memory_bw_write_only``,
        and (``mixed``: the two in flight together) a turnaround on the bytes that alternate
        (the smaller of the two), which makes an even mix run at ``memory_bw_balanced``."""
        r_bw = self.memory_bw_one_way if read_bw is None else read_bw
        turn = 2 / self.memory_bw_balanced - 1 / self.memory_bw_one_way
        turn -= 1 / self.memory_bw_write_only
        # (per-step arrays of bytes too: device_model.timing)
        alternating = np.minimum(reads, writes) if mixed else 0.0
        return reads / r_bw + writes / self.memory_bw_write_only + alternating * turn

    def memory_bw(self, read_fraction: float, read_bw: float | None = None) -> float:
        """The device-memory bandwidth a stage achieves when ``read_fraction`` of its bytes are
        reads (:meth:`memory_seconds` of one byte so split): ``memory_bw_one_way`` for reads
        only, ``memory_bw_write_only`` for writes only, ``memory_bw_balanced`` for an even mix."""
        f = min(max(read_fraction, 0.0), 1.0)
        return 1.0 / self.memory_seconds(f, 1.0 - f, read_bw)

    def bound_seconds(
        self, flops: float, min_bytes: float, flops_per_s: float | None = None
    ) -> float:
        """The external bound of a kernel's work: ``max(min_bytes / memory_bw_one_way, flops /
        bound_flops)``, its minimal device traffic (each input read once, each output written
        once) at the measured read rate, or its flops at the sustained PE rate (CARD.md,
        "Roofline of the card"); ``flops_per_s``: another PE roof (a batched matmul's). A
        kernel's bound adds ``kernel_fixed_s`` (``device_model.timing.kernel_cost``)."""
        rate = self.bound_flops if flops_per_s is None else flops_per_s
        return max(min_bytes / self.memory_bw_one_way, flops / rate)

    @property
    def ring_bw_per_direction(self) -> float:
        """Bytes per second per ring direction (192 GB/s with the defaults)."""
        return self.ring_bytes_per_cycle * self.clock_hz

    def elems_per_stick(self, itemsize: int) -> int:
        """Elements of a dtype with ``itemsize`` bytes in one stick (64 fp16, 32 fp32)."""
        return self.stick_bytes // itemsize

    def replace(self, **changes: object) -> CardSpec:
        """A copy with some fields changed (the spec itself is frozen)."""
        return dataclasses.replace(self, **changes)


DEFAULT_CARD = CardSpec()
