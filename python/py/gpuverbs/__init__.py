"""gpuverbs: GPU-initiated RDMA on mlx5 work queues, with a software mlx5 NIC.

The host API from Python: ``Context`` (a device), ``Pd.register`` (any C-contiguous object
with the buffer protocol, without copying), ``Context.create_cq``, ``Pd.create_qp``,
endpoints and memory descriptors as ``bytes``, ``Qp.connect``, ``Qp.recover`` and the CPU
initiator (``Qp.initiator()``). Every error is an exception under ``GpuverbsError``; error
completions under ``CompletionError``, one class per syndrome. ``include_dir()`` is the
folder of the CUDA device API's headers (``#include <gpuverbs/gpuverbs.cuh>``).
"""

import hashlib as _hashlib
import os as _os
import tempfile as _tempfile

from . import _gpuverbs
from ._gpuverbs import *  # noqa: F401,F403
from ._gpuverbs import __version__, _headers

# What ``from gpuverbs import *`` gives, and the public names: the extension's (PyO3 lists them
# in its ``__all__``) and ``include_dir``; the standard modules above stay private.
__all__ = sorted(
    {n for n in getattr(_gpuverbs, "__all__", dir(_gpuverbs)) if not n.startswith("_")}
    | {"include_dir"}
)


def include_dir() -> str:
    """The folder to pass to ``nvcc -I`` (or ``torch.utils.cpp_extension.load_inline``'s
    ``extra_include_paths``) for the device API: the headers this build of the package was
    made with, written once into a cache folder named by their hash."""
    headers = _headers()
    digest = _hashlib.sha256()
    for path, text in headers:
        digest.update(path.encode() + b"\0" + text.encode() + b"\0")
    base = _os.environ.get("XDG_CACHE_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache")
    root = _os.path.join(base, "gpuverbs", f"{__version__}-{digest.hexdigest()[:16]}", "include")
    if not _os.path.isfile(_os.path.join(root, "gpuverbs", "gpuverbs.cuh")):
        _os.makedirs(_os.path.dirname(root), exist_ok=True)
        tmp = _tempfile.mkdtemp(dir=_os.path.dirname(root))
        for path, text in headers:
            full = _os.path.join(tmp, path)
            _os.makedirs(_os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        try:
            _os.rename(tmp, root)
        except OSError:
            # another process wrote the same headers first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return root
