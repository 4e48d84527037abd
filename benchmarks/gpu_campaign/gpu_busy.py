"""The GPU's busy share while a load runs: NVML's utilisation (the share of time a kernel ran)
sampled every 0.2 s on a thread, through pynvml where it is installed, else `nvidia-smi`; None
("n/a") on a CPU or where neither answers."""
from __future__ import annotations

import shutil
import subprocess
import threading

INTERVAL_S = 0.2


def _reader(device: str):
    """A function returning one utilisation sample in percent, or None when nothing can read it."""
    if not device.startswith("cuda"):
        return None
    index = int(device.partition(":")[2] or 0)
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - no NVML binding or no driver: try the command line
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None

    def read() -> float | None:
        out = subprocess.run([smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", str(index)],
                             capture_output=True, text=True, timeout=5)
        return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 and out.stdout.strip() else None

    return read


class BusySampler:
    """`with BusySampler(device) as b: ...` then `b.share` (0-1) or None."""

    def __init__(self, device: str) -> None:
        self.read = _reader(device)
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-busy", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                v = self.read() if self.read else None
            except Exception:  # noqa: BLE001 - a failed read is a missing sample, not a failed run
                v = None
            if v is not None:
                self.samples.append(v)

    def __enter__(self) -> "BusySampler":
        if self.read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def share(self) -> float | None:
        return sum(self.samples) / len(self.samples) / 100.0 if self.samples else None
