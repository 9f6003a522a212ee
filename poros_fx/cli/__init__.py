"""The ``poros-fx`` command line: ``demo``, ``doctor``, ``check``, ``dump``, ``train``, ``eval``, ``export``,
``exactness`` and ``bench`` (``app.py``)."""

from .app import main

__all__ = ["main"]
