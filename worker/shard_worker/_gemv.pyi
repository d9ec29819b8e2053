# The C decode kernels (csrc/, built with the package): typed where kernels.py, shm.py and fused.py
# call them, so this stub only says the module exists.
from typing import Any

def __getattr__(name: str) -> Any: ...
