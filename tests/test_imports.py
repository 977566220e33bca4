"""The package, its CLI and every pure module import without TensorRT or pycuda."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import k2edge

ROOT = Path(__file__).resolve().parents[1]

BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('tensorrt', 'pycuda', 'jtop', 'torch', 'opentelemetry'):
            raise ImportError(f'{name} blocked by the test')
sys.meta_path.insert(0, Block())
"""


def _modules():
    return sorted(m.name for m in pkgutil.walk_packages(k2edge.__path__, "k2edge.") if not m.name.endswith("__main__"))


def test_every_module_imports_without_tensorrt_or_pycuda():
    """Every module imports with the heavy packages blocked, and every name its ``__all__`` exports is there."""
    code = BLOCK + f"""
import importlib
modules = [importlib.import_module(name) for name in {_modules()!r}]
heavy = [m for m in ('tensorrt', 'pycuda', 'onnxruntime') if m in sys.modules]
assert not heavy, heavy
missing = [f'{{m.__name__}}.{{a}}' for m in modules for a in getattr(m, '__all__', ()) if not hasattr(m, a)]
assert not missing, missing
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_cli_help_without_tensorrt_or_pycuda():
    code = BLOCK + "from k2edge.cli.main import main\nsys.exit(main(['--help']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "pareto" not in proc.stderr and "inspect" in proc.stdout, proc.stderr


def test_engine_runs_without_tensorrt_or_pycuda():
    code = BLOCK + f"""
import numpy as np
from k2edge import Engine
with Engine.build({str(ROOT / 'models/digits/model.onnx')!r}, 'cpu-dev') as e:
    print(e.infer({{'input': np.zeros((1, 1, 32, 32), np.float32)}})['logits'].shape)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "(1, 10)" in proc.stdout, proc.stderr
