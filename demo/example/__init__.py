"""The bundled example: a small byte-level GPT and data from the Python standard library's sources.

It needs nothing beyond torch and a Python installation, so the demo, the tests and the
benchmarks all train the same model on the same text on any machine.
"""

from demo.example.data import ByteData, DataError
from demo.example.model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "ByteData", "DataError"]
