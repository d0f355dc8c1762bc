"""scipy.optimize registered as a deferred module before hivemind is imported.

`import hivemind` (any hivemind submodule runs hivemind/__init__.py) imports its averager,
whose load balancer imports scipy.optimize at the top: ~1.0 s of a node's ~5.7 s of imports
on an idle 2-core machine, more under load (scipy.linalg, scipy.sparse, numpy.f2py and
charset_normalizer come with it). Nothing this project runs calls the averager's load balancer
(the only user of scipy.optimize), so the module is only made, with its metadata (`__file__`,
`__spec__`, `__path__`): its code runs at the first access to any other attribute, if ever
(`scipy.optimize.linprog` then loads it as a plain import would, under a lock).

Not importlib.util.LazyLoader: its module loads on any attribute access, `__file__` included,
and inspect.getmodule reads `__file__` of every module in sys.modules (pydantic does that for
each settings dataclass), which loaded scipy.optimize during the node's own imports.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
import types

PARENT = "scipy"
DEFERRED = "scipy.optimize"
_LOCK = threading.RLock()
_loading: set[str] = set()


class DeferredModule(types.ModuleType):
    """A module whose code has not run yet; attribute lookups that miss run it once."""

    def __getattr__(self, name: str) -> object:  # only called for attributes not set yet
        with _LOCK:
            if type(self) is DeferredModule and self.__name__ not in _loading:
                _load(self)
        return types.ModuleType.__getattribute__(self, name)


def _load(module: types.ModuleType) -> None:
    """Run the module's code in place (it stays the object others hold); on failure it
    leaves sys.modules, as a failed import does."""
    _loading.add(module.__name__)
    try:
        spec = module.__spec__
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(module)
        module.__class__ = types.ModuleType
    except BaseException:
        sys.modules.pop(module.__name__, None)
        raise
    finally:
        _loading.discard(module.__name__)


def defer_scipy_optimize() -> bool:
    """Make `import scipy.optimize` cheap until the module is used; True if it was deferred
    now (False: already imported or deferred, or scipy is not installed). Imports nothing:
    the scipy package itself is imported by the first `import scipy.optimize` (~15 ms)."""
    if DEFERRED in sys.modules:
        return False
    parent = importlib.util.find_spec(PARENT)  # a top-level name: found, not imported
    if parent is None or parent.submodule_search_locations is None:
        return False
    spec = importlib.machinery.PathFinder.find_spec(DEFERRED, parent.submodule_search_locations)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)  # metadata only: its code has not run
    module.__class__ = DeferredModule
    sys.modules[DEFERRED] = module
    return True
