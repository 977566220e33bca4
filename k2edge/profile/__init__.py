"""Profile (JSON) schema: how a model is split between the GPU and the DLA cores."""

from .schema import (
    DLAMemoryPools,
    EdgeRuntime,
    Partition,
    Precision,
    Profile,
    find_profile,
    load_profile,
    profile_search_path,
)

__all__ = [
    "DLAMemoryPools",
    "EdgeRuntime",
    "Partition",
    "Precision",
    "Profile",
    "find_profile",
    "load_profile",
    "profile_search_path",
]
