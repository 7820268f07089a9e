"""Public entry points of the verification kernels.

`kernels/` is a namespace subpackage (no `__init__.py`, see docs/architecture.md), so the public
import is::

    from eagleray.kernels.verify import verify_chain, verify_chain_reduced, verify_tree

Each has a PyTorch reference with identical semantics and random draws (`*_reference`); `verify_chain_greedy`
is the temperature-0 case in PyTorch (one argmax per row), what the CPU engine runs when every row is greedy;
`verify_tree_greedy_host` the tree's, a walk over the argmaxes on the host.
"""

from eagleray.kernels.errors import VerifyInputError
from eagleray.kernels.verify_chain import verify_chain, verify_chain_greedy, verify_chain_reference
from eagleray.kernels.verify_common import LaunchConfig
from eagleray.kernels.verify_reduced import t2d_index, verify_chain_reduced, verify_chain_reduced_reference
from eagleray.kernels.verify_tree import verify_tree, verify_tree_greedy_host, verify_tree_reference

__all__ = [
    "LaunchConfig",
    "VerifyInputError",
    "t2d_index",
    "verify_chain",
    "verify_chain_greedy",
    "verify_chain_reduced",
    "verify_chain_reduced_reference",
    "verify_chain_reference",
    "verify_tree",
    "verify_tree_greedy_host",
    "verify_tree_reference",
]
