"""DLA capability rules, board facts and the partition planner (pure: onnx + numpy)."""

from .boards import BOARDS, DLA_POOL_DEFAULTS, Board, detect_board, get_board
from .planner import PartitionPlan, Segment, plan_partition
from .rules import RULES, Support, dla_support, support_table

__all__ = [
    "BOARDS",
    "DLA_POOL_DEFAULTS",
    "Board",
    "PartitionPlan",
    "RULES",
    "Segment",
    "Support",
    "detect_board",
    "dla_support",
    "get_board",
    "plan_partition",
    "support_table",
]
