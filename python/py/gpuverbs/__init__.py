"""gpuverbs: GPU-initiated RDMA on mlx5 work queues, with a software mlx5 NIC.

The host API from Python: ``Context`` (a device), ``Pd.register`` (any C-contiguous object
with the buffer protocol, without copying), ``Context.create_cq``, ``Pd.create_qp``,
endpoints and memory descriptors as ``bytes``, ``Qp.connect``, ``Qp.recover`` and the CPU
initiator (``Qp.initiator()``). Every error is an exception under ``GpuverbsError``; error
completions under ``CompletionError``, one class per syndrome. ``include_dir()`` is the
folder of the CUDA device API's headers (``#include <gpuverbs/gpuverbs.cuh>``).
"""

import hashlib
import os
import tempfile

from ._gpuverbs import *  # noqa: F401,F403
from ._gpuverbs import __version__, _headers


def include_dir() -> str:
    """The folder to pass to ``nvcc -I`` (or ``torch.utils.cpp_extension.load_inline``'s
    ``extra_include_paths``) for the device API: the headers this build of the package was
    made with, written once into a cache folder named by their hash."""
    headers = _headers()
    digest = hashlib.sha256()
    for path, text in headers:
        digest.update(path.encode() + b"\0" + text.encode() + b"\0")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.path.join(base, "gpuverbs", f"{__version__}-{digest.hexdigest()[:16]}", "include")
    if not os.path.isfile(os.path.join(root, "gpuverbs", "gpuverbs.cuh")):
        os.makedirs(os.path.dirname(root), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(root))
        for path, text in headers:
            full = os.path.join(tmp, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        try:
            os.rename(tmp, root)
        except OSError:
            # another process wrote the same headers first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return root
