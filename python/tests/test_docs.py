"""docs/python.md's first example runs as written (on the soft NIC, with nothing but the
package), and ``import gpuverbs`` exports only its own names."""

import pathlib
import re
import types

import gpuverbs as gv

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"


def test_the_first_example_of_the_docs_runs():
    block = re.search(r"```python\n(.*?)\n```", DOC.read_text(), re.S)
    assert block, f"no python block in {DOC}"
    code = block.group(1)
    assert "numpy" not in code and "torch" not in code, "the first example needs the package alone"
    exec(compile(code, str(DOC), "exec"), {})


def test_the_package_exports_its_own_names_only():
    for name in ("hashlib", "os", "tempfile"):
        assert not hasattr(gv, name), name
    assert "include_dir" in gv.__all__ and "Context" in gv.__all__ and "RemoteMemory" in gv.__all__
    assert not [n for n in gv.__all__ if n.startswith("_")]
    for name in gv.__all__:
        assert not isinstance(getattr(gv, name), types.ModuleType), name
    star = {}
    exec("from gpuverbs import *", star)
    assert set(star) - {"__builtins__"} == set(gv.__all__)
