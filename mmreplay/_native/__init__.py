"""The package's compiled code: numba kernels, LLVM intrinsics and the C symbols linked into them.

Invariant: every kernel that writes through a raw address or into a caller's buffer lives here, and is
reached from the rest of the package only through a Python entry point that checked, before the call,
that the destination holds what the kernel will write (see each module's docstring). Nothing here
imports the package's other layers, only ``settings`` and ``errors`` (``pyproject.toml``'s layers).
Keeping the unsafe code in one place makes it one place to audit, and one place whose on-disk numba
cache ``kernel_cache`` keeps true to its sources.
"""
