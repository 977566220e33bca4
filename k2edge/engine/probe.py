"""Cached probes of what this machine has: backends, CUDA devices, L4T release, DLA cores, jtop.

Paths are read under an injectable root so tests can lay out a fake Jetson tree.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from ..dla.boards import detect_board


def module_version(name: str) -> str | None:
    """The version of an importable module, or None when it is not installed (imports it)."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        mod = __import__(name)
    except Exception:  # present but broken (e.g. pycuda without a driver)
        return None
    return str(getattr(mod, "__version__", getattr(mod, "VERSION", "unknown")))


@lru_cache(maxsize=1)
def has_tensorrt() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def l4t_release(root: Path = Path("/")) -> str | None:
    """``R36.4.3``-style L4T release from /etc/nv_tegra_release, or None off a Jetson."""
    try:
        text = (root / "etc/nv_tegra_release").read_text()
    except OSError:
        return None
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"R{m.group(1)}.{m.group(2)}" if m else text.strip().splitlines()[0]


# JetPack releases by L4T release (NVIDIA's Jetson Linux release notes); older or unknown ones read as None.
JETPACK_BY_L4T = {"R36.4.4": "6.2.1", "R36.4.3": "6.2", "R36.4.0": "6.1", "R36.3.0": "6.0", "R36.2.0": "6.0 DP"}


def jetpack_release(l4t: str | None) -> str | None:
    """The JetPack release an L4T release belongs to (``R36.4.3`` -> ``6.2``), None when unknown."""
    if not l4t:
        return None
    return JETPACK_BY_L4T.get(l4t) or JETPACK_BY_L4T.get(l4t + ".0")


def cuda_version(root: Path = Path("/")) -> str | None:
    """The CUDA toolkit version from /usr/local/cuda/version.json (CUDA 11.1+) or version.txt, else None."""
    base = root / "usr/local/cuda"
    try:
        return str(json.loads((base / "version.json").read_text())["cuda"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        m = re.search(r"CUDA Version\s+([\d.]+)", (base / "version.txt").read_text())
        return m.group(1) if m else None
    except OSError:
        return None


def tensorrt_dla_cores() -> int | None:
    """DLA cores as TensorRT sees them (``Builder.num_DLA_cores``), None without TensorRT or a GPU."""
    if not has_tensorrt():
        return None
    try:
        import tensorrt as trt

        return int(trt.Builder(trt.Logger(trt.Logger.ERROR)).num_DLA_cores)
    except Exception:  # no CUDA device, a broken install: the doctor reports, it does not fail
        return None


def cuda_devices(root: Path = Path("/")) -> list[str]:
    """CUDA-capable GPUs: from the driver's /proc entries, nvidia-smi, or the Tegra iGPU node."""
    gpus = root / "proc/driver/nvidia/gpus"
    names = []
    if gpus.is_dir():
        for info in sorted(gpus.glob("*/information")):
            m = re.search(r"Model:\s*(.+)", info.read_text())
            names.append(m.group(1).strip() if m else info.parent.name)
    if not names and root == Path("/") and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
            names = [line.split(":", 1)[1].split("(")[0].strip() for line in out.splitlines() if ":" in line]
        except (OSError, subprocess.SubprocessError):
            pass
    if not names and (root / "dev/nvhost-gpu").exists():
        names.append("Tegra integrated GPU (nvgpu)")
    return names


def jtop_service(root: Path = Path("/")) -> dict:
    """State of jetson-stats' jtop.service: its socket, and systemd's view when systemctl exists."""
    sock = root / "run/jtop.sock"
    state = {"socket": sock.exists(), "systemd": None}
    if root == Path("/") and shutil.which("systemctl"):
        try:
            state["systemd"] = subprocess.run(["systemctl", "is-active", "jtop.service"], capture_output=True,
                                              text=True, timeout=5).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    if not state["socket"]:
        state["hint"] = ("start it with: sudo systemctl enable --now jtop.service (pip install jetson-stats)"
                         if l4t_release(root) is not None else "not expected here: jtop runs on a Jetson")
    return state


def doctor_report(root: Path = Path("/")) -> dict:
    """Everything ``k2edge doctor`` prints."""
    board = detect_board(root)
    ort_version = module_version("onnxruntime")
    providers = []
    if ort_version:
        import onnxruntime

        providers = onnxruntime.get_available_providers()
    return {
        "backends": {
            "onnxruntime": {"version": ort_version, "providers": providers},
            "tensorrt": {"version": module_version("tensorrt") if has_tensorrt() else None,
                         "dla_cores": tensorrt_dla_cores()},
        },
        "pycuda": module_version("pycuda") if importlib.util.find_spec("pycuda") else None,
        "cuda_devices": cuda_devices(root),
        "cuda": cuda_version(root),
        "l4t": l4t_release(root),
        "jetpack": jetpack_release(l4t_release(root)),
        "board": board.name if board else None,
        "dla_cores": board.dla_cores if board else 0,
        "jtop": jtop_service(root),
    }
