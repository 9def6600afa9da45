"""The nanobind extension (csrc/ffi/module.cc): the XLA FFI handlers jax_flash._registration registers."""

from typing import Any

def registrations() -> dict[str, dict[str, Any]]:
    """Maps platform name -> {custom-call target -> XLA FFI handler capsule}."""

def target_names() -> tuple[str, str]:
    """The (forward, backward) custom-call target names."""

built_with_cuda: bool
