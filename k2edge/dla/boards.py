"""Board facts for Jetson Orin modules: DLA cores and memory-pool defaults."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import PlanError

MIB = 1 << 20


@dataclass(frozen=True)
class Board:
    """One Jetson module as the planner sees it."""

    key: str
    name: str
    dla_cores: int
    gpu_compute_capability: str = "8.7"


# DLA cores per module [NVIDIA-AI-IOT/jetson_benchmarks device CSVs: 'Devices' column counts GPU + DLAs].
BOARDS: dict[str, Board] = {
    b.key: b
    for b in (
        Board("orin-agx", "Jetson AGX Orin", dla_cores=2),
        Board("orin-nx-16", "Jetson Orin NX 16GB", dla_cores=2),
        Board("orin-nx-8", "Jetson Orin NX 8GB", dla_cores=1),
        Board("orin-nano", "Jetson Orin Nano", dla_cores=0),
    )
}
DEFAULT_BOARD = "orin-agx"

# TensorRT defaults per DLA loadable ["Customizing DLA Memory Pools"]; Orin has 1 MiB SRAM per core.
DLA_POOL_DEFAULTS = {"managed_sram": 1 * MIB, "local_dram": 1024 * MIB, "global_dram": 512 * MIB}


def get_board(key: str | None) -> Board:
    """Look a board up by key (``orin-agx``, ``orin-nx-16``, ``orin-nx-8``, ``orin-nano``)."""
    key = key or DEFAULT_BOARD
    try:
        return BOARDS[key]
    except KeyError:
        raise PlanError(f"unknown board {key!r}; choose one of {', '.join(BOARDS)}") from None


def detect_board(root: Path = Path("/")) -> Board | None:
    """The board this process runs on, from the device tree and memory size; None off a Jetson.

    Args:
        root: filesystem root (tests pass a fake tree).
    """
    model_file = root / "proc/device-tree/model"
    try:
        model = model_file.read_bytes().decode(errors="replace").strip("\x00 \n").lower()
    except OSError:
        return None
    if "orin" not in model:
        return None
    if "agx" in model:
        return BOARDS["orin-agx"]
    if "nano" in model:
        return BOARDS["orin-nano"]
    if "nx" in model:
        return BOARDS["orin-nx-16"] if _mem_total_gib(root) > 12 else BOARDS["orin-nx-8"]
    return None


def _mem_total_gib(root: Path) -> float:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0
