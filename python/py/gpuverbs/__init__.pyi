from ._gpuverbs import *
from ._gpuverbs import __version__ as __version__

def include_dir() -> str: ...
