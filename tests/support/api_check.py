"""Compare the test double's API with the real TensorRT 10.3 bindings and pycuda's sources.

Pure helpers for tests/test_trt_bindings.py: fetching (cached) and checking. The real TensorRT Python
bindings (``tensorrt-cu12-bindings==10.3.0``) import when three shared objects with the ten C entry
points they link against are present; stubs built here with the system C compiler provide them, so
every class, pybind signature and enum is inspectable, though nothing can be built or run. pycuda's
names come from its source distribution (``src/wrapper/wrap_cudadrv.cpp``, ``pycuda/driver.py``).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import enum
import fcntl
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

TRT_BINDINGS = "tensorrt-cu12-bindings==10.3.0"
PYCUDA_SDIST = "pycuda==2024.1.2"
STUBS = {  # library -> C entry points the bindings link against
    "libnvinfer.so.10": ("void* createInferBuilder_INTERNAL(void* l, int v){return 0;}\n"
                         "void* createInferRuntime_INTERNAL(void* l, int v){return 0;}\n"
                         "void* createInferRefitter_INTERNAL(void* e, void* l, int v){return 0;}\n"
                         "int getInferLibVersion(void){return 100300;}\n"
                         "void* getPluginRegistry(void){return 0;}\n"
                         "void* getBuilderPluginRegistry(int c){return 0;}\n"),
    "libnvinfer_plugin.so.10": "int initLibNvInferPlugins(void* l, const char* ns){return 0;}\n",
    "libnvonnxparser.so.10": ("void* createNvOnnxParser_INTERNAL(void* n, void* l, int v){return 0;}\n"
                              "void* createNvOnnxParserRefitter_INTERNAL(void* r, void* l, int v){return 0;}\n"
                              "int getNvOnnxParserVersion(void){return 100300;}\n"),
}


class Unavailable(Exception):
    """What is missing to run the comparison (no compiler, no package index); the test skips with it."""


def cache_dir() -> Path:
    """Where downloads are kept between runs (``$K2EDGE_TEST_CACHE`` or ``~/.cache/k2edge-tests``)."""
    return Path(os.environ.get("K2EDGE_TEST_CACHE") or Path.home() / ".cache" / "k2edge-tests")


@contextlib.contextmanager
def _exclusive(root: Path):
    """One process at a time prepares ``root`` (pytest-xdist's workers share the download cache)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip_download(spec: str, dest: Path, *extra: str) -> Path:
    found = sorted(dest.glob(spec.split("==")[0].replace("-", "_") + "-*")) + sorted(dest.glob(spec.split("==")[0] + "-*"))
    version = spec.split("==")[1]
    found = [f for f in found if f"-{version}" in f.name and f.suffix in (".whl", ".gz")]
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *extra, spec],
                          capture_output=True, text=True, timeout=600)
    files = [f for f in dest.iterdir() if f"-{version}" in f.name and f.suffix in (".whl", ".gz")]
    if proc.returncode != 0 or not files:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unavailable(f"pip could not download {spec} (no package index?): {last}")
    return files[0]


def real_tensorrt():
    """The real ``tensorrt_bindings`` 10.3.0 module, importable through stub libraries.

    Raises:
        Unavailable: no C compiler, or the wheel cannot be downloaded.
    """
    if "tensorrt_bindings" in sys.modules:
        return sys.modules["tensorrt_bindings"]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise Unavailable("no C compiler (cc/gcc) to build the stub TensorRT libraries")
    root = cache_dir() / "tensorrt-10.3.0"
    site, libs = root / "site", root / "stubs"
    with _exclusive(root):
        wheel = _pip_download(TRT_BINDINGS, root / "download", "--only-binary", ":all:")
        if not (site / "tensorrt_bindings").is_dir():
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        libs.mkdir(parents=True, exist_ok=True)
        for name, source in STUBS.items():
            target = libs / name
            if not target.exists():
                c = libs / (name.split(".")[0] + ".c")
                c.write_text(source)
                proc = subprocess.run([cc, "-shared", "-fPIC", "-o", str(target), str(c), f"-Wl,-soname,{name}"],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    raise Unavailable(f"{cc} could not build {name}: {proc.stderr.strip()[:200]}")
    for name in STUBS:  # loaded under their sonames, they satisfy the extension's NEEDED entries
        ctypes.CDLL(str(libs / name), mode=ctypes.RTLD_GLOBAL)
    sys.path.insert(0, str(site))
    try:
        return importlib.import_module("tensorrt_bindings")
    finally:
        sys.path.remove(str(site))


def pycuda_sources() -> dict[str, str]:
    """``wrap_cudadrv.cpp`` and ``driver.py`` of pycuda's source distribution.

    Raises:
        Unavailable: the sdist cannot be downloaded.
    """
    root = cache_dir() / "pycuda-2024.1.2"
    # pip prepares an sdist's metadata even to download it: no build isolation, so no build dependencies to fetch
    with _exclusive(root):
        sdist = _pip_download(PYCUDA_SDIST, root / "download", "--no-binary", ":all:", "--no-build-isolation")
    out = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            for wanted in ("src/wrapper/wrap_cudadrv.cpp", "pycuda/driver.py"):
                if member.name.endswith(wanted):
                    out[wanted] = tar.extractfile(member).read().decode()
    if len(out) != 2:
        raise Unavailable(f"{sdist.name} lacks {sorted({'src/wrapper/wrap_cudadrv.cpp', 'pycuda/driver.py'} - set(out))}")
    return out


# ------------------------------------------------------------------------------------------------
# TensorRT: the double's module against the real one

_SKIP = {"__version__", "__spec__", "__name__", "__doc__", "__loader__", "__package__"}


def _public(obj) -> list[str]:
    return [n for n in vars(obj) if not n.startswith("_")]


def _overloads(doc: str, name: str) -> list[list[tuple[str, bool]]]:
    """(parameter, has default) lists of every pybind overload of ``name``, ``self`` dropped."""
    out = []
    for line in (doc or "").splitlines():
        m = re.match(rf"\s*(?:\d+\.\s*)?{re.escape(name)}\((.*)\)\s*->", line)
        if not m:
            continue
        params = []
        depth, current = 0, ""
        for ch in m.group(1) + ",":
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            if ch == "," and depth == 0:
                if current.strip():
                    params.append(current.strip())
                current = ""
            else:
                current += ch
        parsed = [(p.split(":")[0].strip(), "=" in p) for p in params if not p.startswith("*")]
        out.append([p for p in parsed if p[0] != "self"])
    return out


def _fits(fake, real_doc: str, name: str) -> bool:
    """The double's parameters fit one real overload: same number required, keywords the real one names."""
    try:
        sig = inspect.signature(fake)
    except (TypeError, ValueError):
        return True
    params = [p for p in sig.parameters.values() if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty]
    optional = [p.name for p in params if p.default is not p.empty]
    for overload in _overloads(real_doc, name):
        real_required = [n for n, has_default in overload if not has_default]
        names = [n for n, _ in overload]
        if len(required) == len(real_required) and len(params) <= len(overload) and all(o in names for o in optional):
            return True
    return not _overloads(real_doc, name)  # no pybind signature to compare (a plain attribute)


def check_tensorrt(fake, real) -> list[str]:
    """Everything the double offers that the real 10.3 module lacks or spells differently.

    Returns:
        one line per problem: a missing name, a method whose parameters fit no real overload, an enum member
        missing, or (for ``TensorFormat`` and ``DataType``, used as bits and indices) a different value.
    """
    problems = []
    for name in sorted(vars(fake)):
        if name in _SKIP or name.startswith("_"):
            continue
        ours = getattr(fake, name)
        if not hasattr(real, name):
            problems.append(f"trt.{name} does not exist")
            continue
        theirs = getattr(real, name)
        if isinstance(ours, type) and issubclass(ours, enum.Enum):
            problems += _check_enum(f"trt.{name}", ours, theirs, by_value=name in ("TensorFormat", "DataType"))
        elif isinstance(ours, type):
            problems += _check_class(f"trt.{name}", ours, theirs)
    return problems


def _check_enum(where, ours, theirs, by_value: bool) -> list[str]:
    out = []
    members = getattr(theirs, "__members__", {})
    for member in ours.__members__:
        if member not in members:
            out.append(f"{where}.{member} does not exist")
        elif by_value and int(members[member]) != int(ours[member]):
            out.append(f"{where}.{member} is {int(members[member])} in TensorRT, {int(ours[member])} in the double")
    return out


def _check_class(where, ours, theirs) -> list[str]:
    out = []
    for attr in _public(ours):
        value = vars(ours)[attr]
        if not hasattr(theirs, attr):
            out.append(f"{where}.{attr} does not exist")
            continue
        if isinstance(value, type) and issubclass(value, enum.Enum):
            out += _check_enum(f"{where}.{attr}", value, getattr(theirs, attr), by_value=False)
        elif inspect.isfunction(value) or isinstance(value, staticmethod):
            fn = value.__func__ if isinstance(value, staticmethod) else value
            if not _fits(fn, getattr(getattr(theirs, attr), "__doc__", "") or "", attr):
                out.append(f"{where}.{attr}{inspect.signature(fn)} fits no overload of TensorRT's")
    init = vars(ours).get("__init__")
    if init is not None and not _fits(init, theirs.__init__.__doc__ or "", "__init__"):
        out.append(f"{where}({', '.join(list(inspect.signature(init).parameters)[1:])}) fits no constructor of TensorRT's")
    return out


def backend_trt_names(sources: list[Path]) -> set[str]:
    """Every ``trt.A.B...`` chain the backend's modules spell out, plus names they look up with getattr."""
    names = set()
    for path in sources:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, cur = [], node
                while isinstance(cur, ast.Attribute):
                    chain.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id == "trt":
                    names.add(".".join(reversed(chain)))
    return names


def resolve(module, dotted: str) -> bool:
    obj = module
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


# ------------------------------------------------------------------------------------------------
# pycuda: the double's driver module against the sources

def pycuda_names(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module-level names and, per class, its methods and properties, from pycuda's sources."""
    cpp, py = sources["src/wrapper/wrap_cudadrv.cpp"], sources["pycuda/driver.py"]
    names: dict[str, set[str]] = {"": set()}
    names[""] |= set(re.findall(r'py::def\("(\w+)"', cpp))
    names[""] |= set(re.findall(r"DEF_SIMPLE_FUNCTION(?:_WITH_ARGS)?\((\w+)", cpp))
    names[""] |= {n.removeprefix("py_") for n in names[""]}
    names[""] |= set(re.findall(r"DECLARE_EXC\((\w+)", cpp)) | {"Error"}  # the extension's exceptions
    names[""] |= set(re.findall(r"^def (\w+)\(", py, re.M)) | set(re.findall(r"^class (\w+)", py, re.M))
    names[""] |= set(re.findall(r"^(\w+) = ", py, re.M))
    for m in re.finditer(r'py::class_<[^;]*?\(\s*"(\w+)"(.*?);', cpp, re.S):
        cls, body = m.group(1), m.group(2)
        members = set(re.findall(r'\.def\("(\w+)"', body)) | set(re.findall(r"\.DEF_SIMPLE_METHOD(?:_WITH_ARGS)?\((\w+)", body))
        members |= set(re.findall(r'\.add_property\("(\w+)"', body))
        names[""].add(cls)
        names.setdefault(cls, set()).update(members)
    for m in re.finditer(r'py::class_<\w+> cls\("(\w+)".*?\n\s*}', cpp, re.S):  # flag holders: cls.attr("X") = ...
        names[""].add(m.group(1))
        names.setdefault(m.group(1), set()).update(re.findall(r'cls\.attr\("(\w+)"\)', m.group(0)))
    for m in re.finditer(r'py::enum_<\w+>\("(\w+)"\)(.*?);', cpp, re.S):
        names[""].add(m.group(1))
        names.setdefault(m.group(1), set()).update(re.findall(r'\.value\("(\w+)"', m.group(2)))
    # driver.py adds methods to the extension's classes in _add_functionality
    for cls, attr in re.findall(r"^\s+(\w+)\.(\w+) = ", py, re.M):
        names.setdefault(cls, set()).add(attr)
    return names


def check_pycuda(fake_driver, names: dict[str, set[str]]) -> list[str]:
    """Names the double's ``pycuda.driver`` offers that pycuda 2024.1.2 lacks."""
    problems = []
    for name in sorted(vars(fake_driver)):
        if name.startswith("_") or name in _SKIP:
            continue
        value = getattr(fake_driver, name)
        if name not in names[""]:
            problems.append(f"pycuda.driver.{name} does not exist")
            continue
        if isinstance(value, type) and name in names:
            members = value.__members__ if issubclass(value, enum.Enum) else {a: None for a in _public(value)}
            for attr in members:
                if attr not in names[name] and attr not in _instance_only(name):
                    problems.append(f"pycuda.driver.{name}.{attr} does not exist")
    return problems


def _instance_only(cls: str) -> set[str]:
    """Attributes the double keeps on its objects for its own bookkeeping, not part of pycuda's API."""
    return {"Stream": {"queue"}, "Event": {"pending_gen", "done_gen", "flags", "id"},
            "Context": {"valid", "thread"}}.get(cls, set())
