"""A module a test file needs, without a skip and without failing its import.

`module, _needs_x = needed("x", "pip install x")` at a test file's top: the
module, or `None` and a module-scoped autouse fixture that fails each test
there naming what to install. A skip would pass unseen in CI, and a failure
at import stops the whole pytest run at collection.
"""

import importlib
from typing import Any, Callable, Optional, Tuple

import pytest


def needed(name: str, install: str) -> Tuple[Optional[Any], Callable[[], None]]:
    try:
        module = importlib.import_module(name)
    except ImportError:
        module = None

    @pytest.fixture(autouse=True, scope="module")
    def _needs():
        if module is None:
            pytest.fail(f"{name} is not installed: {install}", pytrace=False)

    return module, _needs
