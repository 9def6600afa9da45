"""Registers the extension's XLA FFI handlers with JAX, once, on import."""

from __future__ import annotations

import jax

from jax_flash import _C

FORWARD_TARGET, BACKWARD_TARGET = _C.target_names()


def _register() -> tuple[str, ...]:
    platforms = []
    for platform, handlers in _C.registrations().items():
        for name, capsule in handlers.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
        platforms.append(platform)
    return tuple(platforms)


#: Platforms the installed extension has kernels for ("cpu", and "CUDA" when built with CUDA).
REGISTERED_PLATFORMS: tuple[str, ...] = _register()

#: Whether the extension was compiled with the CUDA kernels.
BUILT_WITH_CUDA: bool = bool(_C.built_with_cuda)
