"""One of csrc/cuda/tests' Python tools (device-side helpers such as attention_kernel_times.py), loaded as a module
so that its CPU-side parts can be tested here."""

import importlib.util
import os

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cuda", "tests")


def load_tool(file_name: str):
    spec = importlib.util.spec_from_file_location(os.path.splitext(file_name)[0], os.path.join(TOOLS, file_name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
