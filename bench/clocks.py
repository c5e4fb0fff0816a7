"""The GPU's SM clock, power draw and software power-cap flag while a benchmark times, read through NVML (the
library behind nvidia-smi, loaded by ctypes: no extra package).

The H200 runs under a power cap that moves timings by up to ~15% (docs/lab/log.md, "The ceiling under a sustained
load"), and an A/B whose two ways draw different power can differ by the clock alone ("Operand values and GEMM
speed"). A timing that records the clock it ran at can be read without guessing:

    sampler = clocks.Sampler()
    ms = bench.time_ms(fn, during=sampler)
    sampler.summary()  # {"sm_mhz": median, "power_w": median, "power_capped": fraction of samples}

The clock and the cap flag are current values; the power is NVML's average over the last second on Hopper, so
it lags a timing shorter than that (the first ceiling timed after an idle spell reads ~200 W). Samples come every
10 ms: a timing of 30 ms has about 4. Off a GPU, or where libnvidia-ml cannot be loaded, every value is NaN.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import threading

import torch

__all__ = ["COLUMNS", "Sampler", "read"]

COLUMNS = ("sm_mhz", "power_w", "power_capped")  # Sampler.summary()'s keys: the clock columns of benchmark rows

_CLOCK_SM = 1  # nvmlClockType_t NVML_CLOCK_SM
_SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap: the clock is held down to stay under the power limit
_nvml = None  # (library, device handle, clock-reasons function) once loaded; False when it cannot be


def _device():
    """(libnvidia-ml, the NVML handle of the current CUDA device, its clock-reasons function), or None."""
    global _nvml
    if _nvml is None:
        _nvml = False
        if torch.cuda.is_available():
            try:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
                try:  # NVML's index of the CUDA device (CUDA_VISIBLE_DEVICES, UUIDs): torch's own mapping
                    index = torch.cuda._get_nvml_device_index(torch.cuda.current_device())
                except Exception:  # a private helper of torch: fall back to the CUDA index
                    index = torch.cuda.current_device()
                handle = ctypes.c_void_p()
                reasons = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                    lib.nvmlDeviceGetCurrentClocksThrottleReasons  # the name before CUDA 12.2's driver
                if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0:
                    _nvml = (lib, handle, reasons)
            except (OSError, AttributeError):  # no libnvidia-ml, or one without these functions
                pass
    return _nvml or None


def read() -> tuple[float, float, float]:
    """(SM clock in MHz, power draw in W, 1.0 if the software power cap holds the clock down else 0.0), now."""
    device = _device()
    if device is None:
        return math.nan, math.nan, math.nan
    lib, handle, reasons_fn = device
    mhz, milliwatts, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
    ok = (lib.nvmlDeviceGetClockInfo(handle, _CLOCK_SM, ctypes.byref(mhz)) == 0,
          lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(milliwatts)) == 0,
          reasons_fn(handle, ctypes.byref(reasons)) == 0)
    return (float(mhz.value) if ok[0] else math.nan, milliwatts.value / 1e3 if ok[1] else math.nan,
            float(bool(reasons.value & _SW_POWER_CAP)) if ok[2] else math.nan)


class Sampler:
    """A context manager that reads the clock every `period_ms` from a background thread (NVML calls release the
    GIL) from entry to exit, and at both ends; `summary()` then gives the medians and the capped fraction over
    every block it bracketed (one sampler across the dense ceiling's several GEMMs sums up all of them)."""

    def __init__(self, period_ms: float = 10.0):
        self.period_s = period_ms / 1e3
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(read())

    def __enter__(self) -> "Sampler":
        self.samples.append(read())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(read())

    def summary(self) -> dict:
        """COLUMNS -> the median clock and power of the readings, and the fraction capped (NaN: none)."""
        def median(i):
            values = [s[i] for s in self.samples if not math.isnan(s[i])]
            return statistics.median(values) if values else math.nan

        capped = [s[2] for s in self.samples if not math.isnan(s[2])]
        return dict(zip(COLUMNS, (median(0), median(1), sum(capped) / len(capped) if capped else math.nan)))
