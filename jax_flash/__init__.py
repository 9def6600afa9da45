"""jax_flash: FlashAttention for JAX as XLA FFI custom calls (C++ CPU kernels, CUDA kernels on NVIDIA GPUs)."""

from jax_flash._registration import BUILT_WITH_CUDA, REGISTERED_PLATFORMS
from jax_flash.attention import attention
from jax_flash.jax_nn_compat import dot_product_attention
from jax_flash.ring_attention import ring_attention
from jax_flash.sequence_layout import from_zigzag, to_zigzag

__version__ = "0.1.0"

__all__ = ["attention", "dot_product_attention", "ring_attention", "to_zigzag", "from_zigzag", "BUILT_WITH_CUDA",
           "REGISTERED_PLATFORMS", "__version__"]
