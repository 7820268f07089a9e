"""eagleray: EAGLE-3 speculative decoding on Ray.

The repository root is the ``eagleray`` package; its top-level folders (``platform``,
``kernels``, ``serve``, ``datagen``, ``training``, ``jobs``) are namespace subpackages
(no ``__init__.py``) so that ``platform/`` never shadows the standard library's ``platform``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
