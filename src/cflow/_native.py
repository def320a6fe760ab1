"""Access to the compiled core with a clear error when it is missing."""

from cflow.errors import CflowError

try:
    from cflow import _core as core  # noqa: F401
except ImportError as e:  # pragma: no cover - only on a broken install
    raise CflowError(
        "cflow's native core (cflow._core) is not built: install with `pip install .`, "
        "or run scripts/dev-build and set PYTHONPATH=src"
    ) from e
