"""gpuverbs: GPU-initiated RDMA on mlx5 work queues, with a software mlx5 NIC.

The host API from Python: ``Context`` (a device), ``Pd.register`` (any C-contiguous object
with the buffer protocol, without copying), ``Context.create_cq``, ``Pd.create_qp``,
endpoints and memory descriptors as ``bytes``, ``Qp.connect``, ``Qp.recover`` and the CPU
initiator (``Qp.initiator()``). Every error is an exception under ``GpuverbsError``; error
completions under ``CompletionError``, one class per syndrome.
"""

from ._gpuverbs import *  # noqa: F401,F403
from ._gpuverbs import __version__  # noqa: F401
