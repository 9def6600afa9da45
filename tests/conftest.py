import os
import sys

# The sharding tests need 8 devices; on CPU, XLA fakes them. It must be set before jax creates its backends, i.e.
# before any test module collected into this process first uses jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# The helpers module sits beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
