# Loaded before any test module: on CPU it switches Triton's interpreter on before triton loads.
from tests import interpreter  # noqa: F401
