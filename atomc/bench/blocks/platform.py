"""Platform checks around the sweep: INF-6 (kernel log scan) and INF-7 (GPU metrics poll).

Both bracket the sweep: `start_*(spec, ctx)` is called just before the first cell and returns a
handle whose `stop()` (after the last cell) gives the BlockResult.

- dmesg_scan reads the kernel log (`dmesg`, never through sudo) at start and at stop and scans
  only the lines logged in between for the error patterns below: GPU resets and hangs, kernel
  oopses, GPU page faults, driver queue failures, RAS / hardware errors, NIC links going down,
  NVIDIA Xid events, the OOM killer. Where the log is not readable (containers, kernel.dmesg_restrict)
  the block SKIPs with the reason.
- gpu_metrics_poll samples every GPU on a thread (`interval_s`, default 1 s): NVML
  (`nvidia-ml-py`, imported only here) on NVIDIA, else `amd-smi`, else `rocm-smi` on AMD; SKIP on a
  machine with none of them. Samples go to `BlockResult.samples`, peaks and means to `metrics`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable

from atomc.bench.blocks import BlockResult, SuiteContext

# category -> pattern (case-insensitive) of a kernel log line that means trouble
DMESG_PATTERNS = {
    "gpu_reset": r"GPU reset begin|GPU hang|ring \S+ timeout|cp might be in an unrecoverable state"
    r"|fence wait loop timeout expired",
    "crash": r"Call Trace|cut here|kernel BUG|BUG:|amdgpu: Fatal error",
    "fault": r"no-retry page fault|\bpage fault\b.*amdgpu|Illegal register access|PROTECTION_FAULT_STATUS",
    "driver": r"Queue preemption failed for queue|Failed to evict process queues",
    "hardware": r"hardware error|hardware fail|ras error|uncorrectable|correctable err",
    "link_down": r"NIC Link is Down|link is down",
    "nvidia_xid": r"NVRM: Xid",
    "oom": r"Out of memory: Killed process|oom-kill",
}
_COMPILED = {k: re.compile(v, re.I) for k, v in DMESG_PATTERNS.items()}
_TIMESTAMP = re.compile(r"^\[\s*(\d+\.\d+)\]")


def read_kernel_log() -> list[str]:
    """The kernel log's lines; raises PermissionError (with dmesg's words) when it is not readable."""
    if shutil.which("dmesg") is None:
        raise PermissionError("no dmesg command on this machine")
    proc = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise PermissionError((proc.stderr or proc.stdout).strip() or f"dmesg exited {proc.returncode}")
    return proc.stdout.splitlines()


def scan_lines(lines: list[str]) -> list[dict]:
    hits = []
    for line in lines:
        for category, pattern in _COMPILED.items():
            if pattern.search(line):
                hits.append({"category": category, "line": line[:300]})
                break
    return hits


def new_lines(before: list[str], after: list[str]) -> list[str]:
    """The lines of `after` logged since `before` was read: by timestamp when lines carry one, else
    by position (the ring buffer may have dropped old lines, so a shared tail is looked for)."""
    last = next((m.group(1) for m in map(_TIMESTAMP.match, reversed(before)) if m), None)
    if last is not None:
        bound = float(last)
        return [ln for ln in after if (m := _TIMESTAMP.match(ln)) and float(m.group(1)) > bound]
    if before and before[-1] in after:
        return after[len(after) - after[::-1].index(before[-1]) :]
    return after[len(before) :]


class DmesgScan:
    def __init__(self, reader: Callable[[], list[str]] = read_kernel_log):
        self.reader = reader
        try:
            self.before: list[str] | None = reader()
            self.skip_reason = ""
        except (OSError, subprocess.SubprocessError) as exc:
            self.before, self.skip_reason = None, str(exc)

    def stop(self) -> BlockResult:
        name = "platform.dmesg_scan"
        if self.before is None:
            return BlockResult(name, "SKIP", f"the kernel log is not readable: {self.skip_reason}")
        try:
            lines = new_lines(self.before, self.reader())
        except (OSError, subprocess.SubprocessError) as exc:
            return BlockResult(name, "SKIP", f"the kernel log is not readable: {exc}")
        hits = scan_lines(lines)
        metrics = {"lines_scanned": float(len(lines)), "error_lines": float(len(hits))}
        if hits:
            kinds = sorted({h["category"] for h in hits})
            return BlockResult(name, "FAIL", f"{len(hits)} error lines ({', '.join(kinds)})", metrics, hits[:200])
        return BlockResult(name, "PASS", f"{len(lines)} new kernel log lines, no error pattern", metrics)


def start_dmesg_scan(spec: dict, ctx: SuiteContext) -> DmesgScan:
    return DmesgScan()


# --- GPU metrics ------------------------------------------------------------------------------


def nvml_sampler() -> Callable[[], list[dict]] | None:
    """A function returning one reading per NVIDIA GPU, or None without NVML or a GPU."""
    try:
        import pynvml  # nvidia-ml-py; optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError:
        return None
    if not handles:
        return None

    def read() -> list[dict]:
        out = []
        for i, h in enumerate(handles):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(
                {
                    "gpu": i,
                    "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                    "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                    "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                    "memory_used_mb": mem.used / 2**20,
                    "memory_total_mb": mem.total / 2**20,
                    "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                    "utilization_pct": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                }
            )
        return out

    return read


def _number(text) -> float | None:
    m = re.search(r"-?\d+(\.\d+)?", str(text))
    return float(m.group(0)) if m else None


# substrings of rocm-smi's JSON field names -> our field
_ROCM_FIELDS = (
    ("sclk clock speed", "sm_clock_mhz"),
    ("mclk clock speed", "mem_clock_mhz"),
    ("average graphics package power", "power_w"),
    ("current socket graphics package power", "power_w"),
    ("temperature (sensor junction)", "temperature_c"),
    ("vram total used memory", "memory_used_mb"),
    ("vram total memory", "memory_total_mb"),
    ("gpu use (%)", "utilization_pct"),
)


def parse_rocm_smi(text: str) -> list[dict]:
    """rocm-smi --json: {"card0": {"<field name> (unit)": "value", ...}, ...}; memory is in bytes."""
    out = []
    for card, fields in sorted(json.loads(text).items()):
        if not card.startswith("card") or not isinstance(fields, dict):
            continue
        reading: dict = {"gpu": int(_number(card) or 0)}
        for name, value in fields.items():
            low = name.lower()
            for needle, ours in _ROCM_FIELDS:
                if needle in low and ours not in reading and (x := _number(value)) is not None:
                    reading[ours] = x / 2**20 if ours.startswith("memory") else x
        out.append(reading)
    return out


def parse_amd_smi(text: str) -> list[dict]:
    """amd-smi metric --json: a list of {"gpu": i, "power": {...}, "clock": {...}, "temperature": {...},
    "mem_usage": {...}, "usage": {...}} whose leaves are {"value", "unit"} or plain numbers."""

    def leaf(obj, *path):
        for p in path:
            if not isinstance(obj, dict) or p not in obj:
                return None
            obj = obj[p]
        return _number(obj.get("value")) if isinstance(obj, dict) else _number(obj)

    data = json.loads(text)
    gpus = data if isinstance(data, list) else data.get("gpu_data", [])
    out = []
    for g in gpus:
        reading = {
            "gpu": int(g.get("gpu", len(out))),
            "sm_clock_mhz": leaf(g, "clock", "gfx_0", "clk"),
            "mem_clock_mhz": leaf(g, "clock", "mem_0", "clk"),
            "power_w": leaf(g, "power", "socket_power"),
            "temperature_c": leaf(g, "temperature", "hotspot"),
            "memory_used_mb": leaf(g, "mem_usage", "used_vram"),
            "memory_total_mb": leaf(g, "mem_usage", "total_vram"),
            "utilization_pct": leaf(g, "usage", "gfx_activity"),
        }
        out.append({k: v for k, v in reading.items() if v is not None})
    return out


def smi_sampler() -> Callable[[], list[dict]] | None:
    if shutil.which("amd-smi"):
        cmd, parse = ["amd-smi", "metric", "--json"], parse_amd_smi
    elif shutil.which("rocm-smi"):
        cmd = ["rocm-smi", "--showtemp", "--showpower", "--showclocks", "--showmeminfo", "vram", "--showuse", "--json"]
        parse = parse_rocm_smi
    else:
        return None

    def read() -> list[dict]:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
        return parse(proc.stdout)

    return read


def summarize(samples: list[dict]) -> dict[str, float]:
    def values(key):
        return [s[key] for s in samples if isinstance(s.get(key), int | float)]

    out = {}
    for key, how in (("memory_used_mb", max), ("temperature_c", max), ("power_w", max), ("sm_clock_mhz", min)):
        if v := values(key):
            out[f"{'peak' if how is max else 'min'}_{key}"] = float(how(v))
    for key in ("power_w", "utilization_pct", "sm_clock_mhz"):
        if v := values(key):
            out[f"mean_{key}"] = sum(v) / len(v)
    return out


class GpuPoller:
    NAME = "platform.gpu_metrics_poll"

    def __init__(self, read: Callable[[], list[dict]] | None, source: str, interval_s: float = 1.0):
        self.read, self.source, self.interval_s = read, source, interval_s
        self.samples: list[dict] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = None
        if read is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-metrics-poll", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            t = round(time.monotonic() - self._t0, 3)
            try:
                self.samples.extend({"t": t, **r} for r in self.read())
            except Exception as exc:  # one failed poll is noted; the sweep goes on
                if len(self.errors) < 20:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> BlockResult:
        if self._thread is None:
            return BlockResult(
                self.NAME, "SKIP", "no GPU metrics source: neither NVML (nvidia-ml-py) nor amd-smi / rocm-smi"
            )
        self._stop.set()
        self._thread.join(timeout=max(30.0, self.interval_s * 2))
        rows = [{"error": e} for e in self.errors]
        if not self.samples:
            return BlockResult(self.NAME, "ERROR", f"{self.source}: no sample read", rows=rows)
        reason = f"{len(self.samples)} samples from {self.source}"
        return BlockResult(self.NAME, "PASS", reason, summarize(self.samples), rows, self.samples)


def start_gpu_metrics_poll(spec: dict, ctx: SuiteContext) -> GpuPoller:
    interval = float(spec.get("interval_s", 1.0))
    if interval <= 0:
        raise ValueError(f"platform.gpu_metrics_poll.interval_s must be > 0, got {interval}")
    for source, make in (("NVML", nvml_sampler), ("amd-smi/rocm-smi", smi_sampler)):
        read = make()
        if read is not None:
            return GpuPoller(read, source, interval)
    return GpuPoller(None, "none", interval)
