"""Profile schema: the seed example loads unchanged; bad values name their field path."""

import json
from pathlib import Path

import pytest

from k2edge import ProfileError, load_profile

ROOT = Path(__file__).resolve().parents[1]
SEED = """{ "edge_runtime": { "tensorrt_partition": "layer-wise", "dma_prefetch": true,
                    "offload_ratio": 0.35, "precision_fallback": ["fp16", "int8"] } }"""


def test_seed_example_loads_unchanged(tmp_path):
    """The design's seed document loads as written, every other key defaulted."""
    f = tmp_path / "seed.json"
    f.write_text(SEED)
    p = load_profile(f)
    er = p.edge_runtime
    assert (er.tensorrt_partition, er.dma_prefetch, er.offload_ratio, er.precision_fallback) == (
        "layer-wise", True, 0.35, ("fp16", "int8"))
    assert p.name == "seed"
    assert er.batch_size == 1 and er.dla_cores is None and er.gpu_fallback


def test_c1_is_the_seed_verbatim():
    """profiles/c1.json is the seed example, character for character."""
    assert json.loads((ROOT / "profiles" / "c1.json").read_text()) == json.loads(SEED)


@pytest.mark.parametrize("name", ["c1", "c2", "c3", "c4", "c5", "c6", "cpu-dev"])
def test_shipped_profiles_validate(name):
    """Every shipped profile loads by bare name."""
    assert load_profile(name).name == name


@pytest.mark.parametrize("edge_runtime, message", [
    ({"offload_ratio": 1.7}, "edge_runtime.offload_ratio: must be within [0, 1], got 1.7"),
    ({"offload_ratio": -0.1}, "edge_runtime.offload_ratio: must be within [0, 1], got -0.1"),
    ({"offload_ratio": "0.5"}, "edge_runtime.offload_ratio: must be a number"),
    ({"turbo": True}, "edge_runtime.turbo: unknown key"),
    ({"tensorrt_partition": "pixel-wise"}, "edge_runtime.tensorrt_partition: must be one of"),
    ({"precision_fallback": []}, "edge_runtime.precision_fallback: must be a non-empty list"),
    ({"precision_fallback": ["fp16", "fp16"]}, "edge_runtime.precision_fallback: lists a precision twice"),
    ({"precision_fallback": ["fp8"]}, "edge_runtime.precision_fallback.0: must be one of"),
    ({"dla_cores": 3}, "edge_runtime.dla_cores: must be 0, 1, 2 or null"),
    ({"batch_size": 0}, "edge_runtime.batch_size: must be within [1, 4096]"),
    ({"dla_memory_pools": {"managed_sram": 3000}}, "edge_runtime.dla_memory_pools.managed_sram: must be a power of two"),
    ({"dla_memory_pools": {"sram": 4096}}, "edge_runtime.dla_memory_pools.sram: unknown key"),
    ({"dma_prefetch": "yes"}, "edge_runtime.dma_prefetch:"),
])
def test_invalid_values_name_the_field(edge_runtime, message):
    """Each invalid value is rejected with its dotted field path."""
    with pytest.raises(ProfileError) as err:
        load_profile({"edge_runtime": edge_runtime})
    assert message in str(err.value)


def test_unknown_top_level_key_and_missing_section():
    """Unknown top-level keys and a missing edge_runtime are named."""
    with pytest.raises(ProfileError, match=r"edgeruntime: unknown key"):
        load_profile({"edgeruntime": {}})
    with pytest.raises(ProfileError, match=r"edge_runtime: required"):
        load_profile({"name": "x"})


def test_name_and_description_are_printable_text():
    """plan, build and the sweep print a profile's name: an escape sequence in it would be run by the terminal."""
    with pytest.raises(ProfileError, match=r"name: holds a control character or a line break \(character 2 of 9: '\\x1b'\)"):
        load_profile({"name": "x\x1b[31mred", "edge_runtime": {}})
    with pytest.raises(ProfileError, match="description: holds a control character or a line break"):
        load_profile({"description": "two\nlines", "edge_runtime": {}})
    with pytest.raises(ProfileError, match="description: holds a control character"):
        load_profile({"description": "right-to-left \u202e override", "edge_runtime": {}})
    assert load_profile({"name": "jetson-nx 16\u00a0GB, day shift", "edge_runtime": {}}).name == "jetson-nx 16\u00a0GB, day shift"


def test_file_errors(tmp_path):
    """Missing files, unknown names and broken JSON give one clear message."""
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nope.json")
    with pytest.raises(ProfileError, match="'no-such-profile' not found"):
        load_profile("no-such-profile")
    bad = tmp_path / "bad.json"
    bad.write_text('{"edge_runtime": {"offload_ratio": 0.5,}}')
    with pytest.raises(ProfileError, match=r"not valid JSON \(line 1"):
        load_profile(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="must be a JSON object"):
        load_profile(arr)
