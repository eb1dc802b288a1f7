"""The core of shared mechanics every family uses (private; no re-exports).

Modules are imported by their full path (``from dadjax._core.vma import ...``).
Nothing here imports a method family, ``dadjax.parallel`` or the training loop.
"""
