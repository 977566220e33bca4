"""Where TensorRT actually put each layer, read from the engine inspector and compared with the plan.

Pure Python over the JSON that ``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)``
returns for an engine built with ``ProfilingVerbosity.DETAILED``: ``{"Layers": [...], "Bindings": [...]}``,
each layer a dict with ``Name``, ``LayerType`` and, in TensorRT 10, ``Metadata`` naming the ONNX
nodes it came from (``[ONNX Layer: a]\\x1f[ONNX Layer: b]``). With ``LAYER_NAMES_ONLY`` a layer is a
bare name. A DLA loadable shows up as one ``{ForeignNode[first...last]}`` layer (NVIDIA/TensorRT#3143);
Myelin also names its GPU subgraphs ``ForeignNode`` but with ``LayerType: Myelin``. Reformats that move
tensors in and out of DLA memory are named ``... to nvm`` / ``... from nvm`` and are not ONNX nodes.

How the device of a layer is read (best effort, the inspector has no device field): a layer is on
the DLA when its ``LayerType`` says DLA, or when it is a non-Myelin ``ForeignNode`` of an engine whose
default device is the DLA. Nodes the inspector does not name (fused or folded away) are counted as
unobserved, never as disagreements.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]]+)\]")
_FOREIGN = re.compile(r"^\{ForeignNode\[(.*)\]\}$")


def metadata_nodes(metadata: str) -> list[str]:
    """ONNX node names in a TensorRT layer's ``Metadata`` (entries separated by \\x1f or \\x1e)."""
    return _ONNX_LAYER.findall(metadata or "")


def node_of_layer(layer_name: str, metadata: str, nodes: set[str]) -> str | None:
    """The ONNX node a network layer was parsed from: its metadata, its name, or a name prefix.

    The ONNX parser names a node's main layer after the node and extra layers after the node plus a
    suffix; TensorRT 10 also records the node in ``ILayer.metadata``.
    """
    for name in metadata_nodes(metadata):
        if name in nodes:
            return name
    if layer_name in nodes:
        return layer_name
    best = None
    for name in nodes:
        if layer_name.startswith(name) and len(layer_name) > len(name) and not layer_name[len(name)].isalnum():
            if best is None or len(name) > len(best):
                best = name
    return best


def observed_placement(engine_info: str, order: list[str], dla_engine: bool) -> dict[str, str]:
    """Node -> ``dla`` | ``gpu`` for every node the inspector names.

    Args:
        engine_info: the inspector's JSON.
        order: the segment's nodes in topological order (to expand ``ForeignNode[a...b]`` ranges).
        dla_engine: whether the engine's default device is the DLA.
    """
    layers = _inspector_layers(engine_info)
    known = set(order)
    out: dict[str, str] = {}
    for layer in layers:
        if isinstance(layer, str):
            layer = {"Name": layer}
        name = str(layer.get("Name", ""))
        kind = str(layer.get("LayerType", ""))
        if name.endswith(" to nvm") or name.endswith(" from nvm") or " finish" in name:
            continue  # DLA memory reformats and copy markers, not ONNX nodes
        foreign = _FOREIGN.match(name)
        on_dla = "dla" in kind.lower() or bool(foreign and dla_engine and kind.lower() != "myelin")
        covered = [n for n in metadata_nodes(str(layer.get("Metadata", ""))) if n in known]
        if not covered and foreign:
            covered = _range(foreign.group(1), order)
        if not covered:
            covered = [n for n in (node_of_layer(part.strip(), "", known) for part in name.split(" + ")) if n]
        for node in covered:
            # a node split over several layers counts as on the DLA only if every part is
            out[node] = "dla" if on_dla and out.get(node, "dla") == "dla" else "gpu"
    return out


def _format_precision(fmt: str) -> str | None:
    """``int8`` / ``fp16`` / ``fp32`` of an inspector ``Format/Datatype`` string (``Int8 NC/32HW32``, ``Half``,
    ``Channel major FP16 format ...``, ``Row major linear FP32``), None when it names none."""
    f = fmt.lower()
    if "int8" in f:
        return "int8"
    if "fp16" in f or "half" in f:
        return "fp16"
    if "fp32" in f or "float" in f:
        return "fp32"
    return None


def observed_precision(engine_info: str, order: list[str]) -> dict[str, str]:
    """Node -> the precision TensorRT runs it in, read from the inspector's JSON (``ProfilingVerbosity.DETAILED``):
    the data type of each layer's first input (an INT8 kernel reads INT8). A DLA loadable is one ``ForeignNode``
    whose layers' precisions the inspector does not report (its input's type is the loadable's, not each
    layer's): its nodes are left out, as are nodes the inspector does not name or names without formats."""
    layers = _inspector_layers(engine_info)
    known = set(order)
    out: dict[str, str] = {}
    for layer in layers:
        if not isinstance(layer, dict) or not layer.get("Inputs"):
            continue
        first = layer["Inputs"][0]
        precision = _format_precision(str(first.get("Format/Datatype", ""))) if isinstance(first, dict) else None
        if precision is None:
            continue
        name = str(layer.get("Name", ""))
        if _FOREIGN.match(name) and str(layer.get("LayerType", "")).lower() != "myelin":
            continue
        covered = [n for n in metadata_nodes(str(layer.get("Metadata", ""))) if n in known]
        if not covered:
            covered = [n for n in (node_of_layer(part.strip(), "", known) for part in name.split(" + ")) if n]
        for node in covered:
            out.setdefault(node, precision)
    return out


def _range(spec: str, order: list[str]) -> list[str]:
    first, sep, last = spec.partition("...")
    known = set(order)
    a = first if first in known else node_of_layer(first, "", known)
    b = (last if last in known else node_of_layer(last, "", known)) if sep else a
    if a is None or b is None:
        return []
    i, j = order.index(a), order.index(b)
    return order[min(i, j): max(i, j) + 1]


@dataclass
class PlacementReport:
    """How one engine's placement compares with the plan."""

    segment: int
    device: str
    planned: dict[str, str]
    observed: dict[str, str]
    cannot_run_on_dla: list[str] = field(default_factory=list)
    could_run_on_dla: list[str] = field(default_factory=list)

    @property
    def moved(self) -> dict[str, tuple[str, str]]:
        """Node -> (planned, observed) where TensorRT placed a node elsewhere than the plan."""
        return {n: (p, self.observed[n]) for n, p in self.planned.items() if n in self.observed and self.observed[n] != p}

    @property
    def unobserved(self) -> list[str]:
        return [n for n in self.planned if n not in self.observed]

    @property
    def agrees(self) -> bool:
        return not self.moved and not self.cannot_run_on_dla

    def summary(self) -> dict:
        return {"segment": self.segment, "device": self.device, "planned": len(self.planned),
                "as_planned": sum(1 for n, p in self.planned.items() if self.observed.get(n) == p),
                "moved": {n: f"{a}->{b}" for n, (a, b) in self.moved.items()}, "unobserved": len(self.unobserved),
                "cannot_run_on_dla": list(self.cannot_run_on_dla), "could_run_on_dla": list(self.could_run_on_dla)}

    def notes(self) -> list[str]:
        """One line per kind of disagreement (first) or observation, for build notes and logs."""
        out = self.disagreements()
        if self.could_run_on_dla:
            out.append(f"segment {self.segment} ({self.device}): the plan keeps {len(self.could_run_on_dla)} node(s) on the "
                       f"GPU that TensorRT could run on the DLA ({_few(self.could_run_on_dla)}); the planner's rules are "
                       f"conservative")
        return out

    def disagreements(self) -> list[str]:
        """Where TensorRT did not, or could not, place nodes as the plan says."""
        where = f"segment {self.segment} ({self.device})"
        out = []
        if self.cannot_run_on_dla:
            out.append(f"{where}: TensorRT cannot run {len(self.cannot_run_on_dla)} node(s) the plan puts on the DLA "
                       f"({_few(self.cannot_run_on_dla)}); GPU fallback moves them")
        moved_to_gpu = [n for n, (a, b) in self.moved.items() if (a, b) == ("dla", "gpu")]
        moved_to_dla = [n for n, (a, b) in self.moved.items() if (a, b) == ("gpu", "dla")]
        if moved_to_gpu:
            out.append(f"{where}: the engine runs {len(moved_to_gpu)} node(s) on the GPU that the plan put on the DLA "
                       f"({_few(moved_to_gpu)})")
        if moved_to_dla:
            out.append(f"{where}: the engine runs {len(moved_to_dla)} node(s) on the DLA that the plan kept on the GPU "
                       f"({_few(moved_to_dla)})")
        return out


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _inspector_layers(engine_info: str) -> list:
    """The ``Layers`` of the engine inspector's JSON; none when it is not the JSON the inspector writes."""
    try:
        return json.loads(engine_info).get("Layers", [])
    except (ValueError, AttributeError):
        return []
