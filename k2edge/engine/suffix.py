"""Run only what a variant of a model changed: the fallback's probes, each one layer apart from a common base.

The fallback's sensitivity runs one model per learned layer, each the all-INT8 model with that layer back in float
(and the cost ranking one per layer the other way round). Everything upstream of the layer computes what the base
computes, so each probe ran the same prefix again: on PP-OCRv4's DBNet, 360 models of about 180 layers each, six
samples a model, most of a build's time. Here the base runs once with the tensors the variants start from as extra
outputs, and each variant runs as a suffix model fed with those values.

What is "the same" is decided from the graphs, not from how a variant was made: a tensor's signature is its
producer's op, domain, attributes and its inputs' signatures (an initializer's: its type, shape and bytes; a graph
input's: its name), so two tensors with one signature hold one value on one feed. A variant's suffix is its nodes
whose outputs the base has no signature for; its inputs are the tensors those nodes read that the base has. The
values equal a whole unfused run's, or an ulp apart; a whole run with ONNX Runtime's fusions (a float layer fused
with what precedes it, which a cut prevents) differs by what those change, carried through the Q/DQ roundings
downstream: up to 9e-4 on PP-OCR's classifier's probabilities, as two whole runs fused differently would.

A model with a subgraph attribute (If, Loop, Scan) reads outer tensors its node does not list: such a base or variant
is run whole.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import onnx

__all__ = ["SharedPrefix", "Suffix", "signatures"]

_SUBGRAPH = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _has_subgraphs(model: onnx.ModelProto) -> bool:
    return any(a.type in _SUBGRAPH for n in model.graph.node for a in n.attribute)


def _initializer_signature(t: onnx.TensorProto) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"init {t.data_type} {list(t.dims)} {t.data_location} ".encode())
    if t.raw_data:
        h.update(t.raw_data)
    else:  # values stored in the typed fields, or external data: the array itself
        h.update(onnx.numpy_helper.to_array(t).tobytes())
    return h.digest()


def signatures(model: onnx.ModelProto) -> dict[str, bytes]:
    """Every tensor's signature (see the module docstring): graph inputs, initializers and node outputs, by name.
    Each initializer's bytes are hashed (PP-OCRv4's DBNet: a few MB a variant, milliseconds)."""
    sig: dict[str, bytes] = {"": b""}  # an optional input left out
    for i in model.graph.input:
        sig[i.name] = hashlib.blake2b(f"input {i.name} {i.type.SerializeToString().hex()}".encode(),
                                      digest_size=16).digest()
    for t in model.graph.initializer:
        sig[t.name] = _initializer_signature(t)
    for node in model.graph.node:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{node.domain}:{node.op_type}".encode())
        for a in sorted(node.attribute, key=lambda a: a.name):
            h.update(a.SerializeToString())
        for name in node.input:
            h.update(b"|" + sig[name])
        node_sig = h.digest()
        for k, out in enumerate(node.output):
            if out:
                sig[out] = hashlib.blake2b(node_sig + k.to_bytes(4, "little"), digest_size=16).digest()
    return sig


@dataclass
class Suffix:
    """What one variant needs run: its ``nodes`` and ``initializers`` the base does not compute, fed ``feeds`` (an
    input's name -> the base's tensor of that value); each variant output is (``"suffix"``, its name) or (``"base"``,
    the base's tensor of that value)."""

    variant: onnx.ModelProto
    nodes: list
    initializers: list
    feeds: dict[str, str]
    outputs: list[tuple[str, str]]

    def needs(self) -> set[str]:
        """The base's tensors this suffix reads or passes on as an output."""
        return set(self.feeds.values()) | {o for kind, o in self.outputs if kind == "base"}

    def model(self, types: dict[str, int]) -> onnx.ModelProto | None:
        """The suffix as a model, its inputs typed by ``types`` (a fed tensor's ONNX element type, from the base's
        run); None when the base computes every output."""
        produced = {o for kind, o in self.outputs if kind == "suffix"}
        if not produced:
            return None
        v = self.variant
        inputs = [onnx.helper.make_tensor_value_info(name, types[name], None) for name in self.feeds]
        graph = onnx.helper.make_graph(self.nodes, "suffix", inputs,
                                       [o for o in v.graph.output if o.name in produced], self.initializers)
        model = onnx.helper.make_model(graph, opset_imports=v.opset_import, ir_version=v.ir_version)
        model.functions.extend(v.functions)
        return model


class SharedPrefix:
    """A base model's signatures, to cut its variants into the suffix each needs (:meth:`suffix`)."""

    def __init__(self, base: onnx.ModelProto) -> None:
        self.usable = not _has_subgraphs(base)
        sigs = signatures(base) if self.usable else {}
        self.by_signature = {s: name for name, s in sigs.items() if name}

    def suffix(self, variant: onnx.ModelProto) -> Suffix | None:
        """The part of ``variant`` the base does not compute, or None when it must run whole (a subgraph, nothing
        in common)."""
        if not self.usable or _has_subgraphs(variant):
            return None
        sig = signatures(variant)
        known = {name for name, s in sig.items() if name and s in self.by_signature}
        inits = {t.name for t in variant.graph.initializer}
        nodes = [n for n in variant.graph.node if any(o and o not in known for o in n.output)]
        if len(nodes) == len(variant.graph.node):
            return None  # nothing shared: the whole model
        produced = {o for n in nodes for o in n.output if o}
        feeds: dict[str, str] = {}
        carried: set[str] = set()
        for n in nodes:
            for name in n.input:
                if not name or name in produced:
                    continue  # left out, or computed in the suffix (a node kept for an output the base lacks)
                if name in inits:
                    carried.add(name)  # a weight: carried into the suffix, not fed
                elif name in known:
                    feeds[name] = self.by_signature[sig[name]]
                else:
                    return None  # a graph input the base does not have (another type): run whole
        outputs = []
        for o in variant.graph.output:
            if o.name in known:
                outputs.append(("base", self.by_signature[sig[o.name]]))
            elif o.name in produced or o.name in inits:
                carried |= {o.name} & inits  # a changed initializer that is an output: the suffix returns it
                outputs.append(("suffix", o.name))
            else:
                return None
        return Suffix(variant, nodes, [t for t in variant.graph.initializer if t.name in carried], feeds, outputs)
