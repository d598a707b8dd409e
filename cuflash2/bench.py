"""Benchmark primitives: FLOP counts (FA2's convention), CUDA-event timing, and the board's SM
clock and power (NVML) during sustained runs."""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import statistics
import threading
import time

#: Dense bf16/fp16 tensor-core peak, TFLOP/s, by GPU name fragment (datasheet figures).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 6000 Ada": 364.0,
    "RTX A6000": 155.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}

MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of (query, key) pairs attended to (bottom-right aligned causal mask)."""
    if not causal:
        return seqlen_q * seqlen_k
    shift = seqlen_k - seqlen_q
    return sum(min(seqlen_k, max(0, i + shift + 1)) for i in range(seqlen_q))


def attention_flops(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, head_dim: int, causal: bool,
                    mode: str = "fwd") -> float:
    """FA2's convention: forward 4*b*h*d per visible pair (two GEMMs), backward 2.5x, both 3.5x.

    For causal square problems FA2 halves the full count; counting visible pairs gives
    s*(s+1)/2, which differs from that by under 1/s.
    """
    if causal and seqlen_q == seqlen_k:
        pairs = seqlen_q * seqlen_k / 2
    else:
        pairs = visible_pairs(seqlen_q, seqlen_k, causal)
    return 4.0 * batch * nheads * head_dim * pairs * MODE_FACTOR[mode]


def peak_tflops(gpu_name: str) -> tuple[float | None, str]:
    """(peak, source) for a GPU name; (None, reason) when unknown."""
    for fragment, peak in PEAK_TFLOPS.items():
        if fragment.lower() in gpu_name.lower():
            return peak, f"datasheet dense bf16 for {fragment}"
    return None, f"unknown GPU {gpu_name!r}"


def time_cuda_ms(fn, warmup: int = 5, repeats: int = 20, flush_l2_bytes: int = 0, calls: int = 5) -> float:
    """Median milliseconds per fn() measured with CUDA events on CuPy's current stream.

    Each of the `repeats` samples times `calls` back-to-back calls between two events, as a training
    loop issues them (the CPU queues the next call while the GPU runs the last, so per-call Python
    work is hidden unless it exceeds the GPU time; torch.utils.benchmark, which FA2's benchmarks use,
    measures the same way). With flush_l2_bytes, each sample is one call after overwriting the L2.
    """
    import cupy as cp

    scratch = cp.empty(flush_l2_bytes, dtype=cp.uint8) if flush_l2_bytes else None
    flush = (lambda: scratch.fill(1)) if scratch is not None else None
    for _ in range(warmup):
        fn()
    return statistics.median(sample_times_ms(fn, repeats, 1 if flush else max(1, calls), before_sample=flush))


def sample_times_ms(fn, repeats: int, calls: int, before_sample=None, after_sample=None) -> list[float]:
    """Milliseconds per fn() in each of `repeats` samples of `calls` back-to-back calls between two
    CUDA events on CuPy's current stream, each sample waited for; `before_sample()` and
    `after_sample()`, if given, run outside the timed span of each."""
    import cupy as cp

    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(repeats):
        if before_sample is not None:
            before_sample()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(calls):
            fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / calls)
        if after_sample is not None:
            after_sample()
    return times


#: Implementations timed at the end of every round: cuDNN runs the GPU at its highest power, and the
#: clock follows the power draw with some lag, so whatever runs right after it measures slower
#: (up to 13% in one process). Last in each round, it precedes only the next round's first.
TIMED_LAST = ("torch-cudnn", "cudnn")


def round_order(names: list, round_index: int) -> list:
    """The order to time `names` in round `round_index`: the others rotate from round to round
    (each starts one round), TIMED_LAST come at the end. Pure."""
    rotating = [n for n in names if n not in TIMED_LAST]
    last = [n for n in names if n in TIMED_LAST]
    shift = round_index % len(rotating) if rotating else 0
    return rotating[shift:] + rotating[:shift] + last


def time_sustained_ms(fn, seconds: float, warmup: int = 5, batch: int = 10) -> tuple[float, float, float]:
    """(milliseconds per fn(), wall-clock start, end) over back-to-back calls for `seconds`.

    A training step keeps the GPU busy for much longer than the few milliseconds of a
    time_cuda_ms sample: within about a second an H200 reaches its board power limit and its SM
    clock drops (1.43-1.81 GHz under attention instead of up to 1.98 GHz), so short samples and
    sustained runs can rank two kernels differently. The queue is kept two batches deep (no idle
    gap between batches); the window is time.monotonic(), as BoardMonitor's samples.
    """
    import cupy as cp

    stream = cp.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    in_flight = collections.deque()
    start.record(stream)
    t0, calls = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        for _ in range(batch):
            fn()
        calls += batch
        marker = cp.cuda.Event(disable_timing=True)
        marker.record(stream)
        in_flight.append(marker)
        if len(in_flight) > 2:
            in_flight.popleft().synchronize()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / calls, t0, time.monotonic()


NVML_CLOCK_SM = 1
NVML_SUCCESS = 0


class BoardMonitor:
    """SM clock (MHz) and board power (W) of one GPU, sampled every `period` seconds by a daemon
    thread through NVML (the driver's libnvidia-ml, through ctypes: no Python package needed).
    `available` is False where the library or the device cannot be opened; mean() then gives NaN."""

    def __init__(self, pci_bus_id: str, period: float = 0.02, library: str = "libnvidia-ml.so.1"):
        self.samples = collections.deque(maxlen=100_000)  # (time.monotonic(), MHz, W)
        self.available = False
        self._nvml = None  # the opened library, once NVML and the device answer
        try:
            nvml = ctypes.CDLL(library)
            handle = ctypes.c_void_p()
            if nvml.nvmlInit_v2() != NVML_SUCCESS or nvml.nvmlDeviceGetHandleByPciBusId_v2(
                    pci_bus_id.encode(), ctypes.byref(handle)) != NVML_SUCCESS:
                return
        except (OSError, AttributeError):
            return
        self._nvml, self._handle, self._period = nvml, handle, period
        self.available = self.read_now() is not None
        if self.available:
            threading.Thread(target=self._sample_forever, name="cuflash2-board-monitor", daemon=True).start()

    def read_now(self) -> tuple[float, float] | None:
        """(SM clock in MHz, board power in W) read now, None where NVML cannot be read."""
        if self._nvml is None:
            return None
        clock, milliwatts = ctypes.c_uint(), ctypes.c_uint()
        if (self._nvml.nvmlDeviceGetClockInfo(self._handle, NVML_CLOCK_SM, ctypes.byref(clock)) != NVML_SUCCESS
                or self._nvml.nvmlDeviceGetPowerUsage(self._handle, ctypes.byref(milliwatts)) != NVML_SUCCESS):
            return None
        return float(clock.value), milliwatts.value / 1000.0

    def _sample_forever(self) -> None:
        while True:
            reading = self.read_now()
            if reading is not None:
                self.samples.append((time.monotonic(), *reading))
            time.sleep(self._period)

    def mean(self, t0: float, t1: float) -> tuple[float, float]:
        """(mean SM clock in MHz, mean board power in W) of the samples taken in [t0, t1]; NaN
        for both when there are none."""
        window = [s for s in list(self.samples) if t0 <= s[0] <= t1]
        if not window:
            return math.nan, math.nan
        return statistics.fmean(s[1] for s in window), statistics.fmean(s[2] for s in window)


@functools.lru_cache(maxsize=None)
def board_monitor(pci_bus_id: str) -> BoardMonitor:
    """One monitor (and sampling thread) per GPU for the process."""
    return BoardMonitor(pci_bus_id)


#: Seconds at the start of a sustained run left out of its clock and power means: the clock
#: follows the power draw with some lag.
SETTLE_S = 0.5


def sustained_run(fn, seconds: float, pci_bus_id: str, warmup: int = 5) -> tuple[float, float | None, float | None]:
    """(milliseconds per fn(), mean SM clock in MHz, mean board power in W) of a time_sustained_ms
    run on the GPU at `pci_bus_id`; clock and power past the run's first SETTLE_S, None where NVML
    cannot be read."""
    monitor = board_monitor(pci_bus_id)  # sampling from before the run
    ms, t0, t1 = time_sustained_ms(fn, seconds, warmup)
    clock, power = monitor.mean(t0 + SETTLE_S, t1)
    if math.isnan(clock):
        return ms, None, None
    return ms, clock, power
