"""The unit tests' factories (``tests/unit/_factories.py``) under the name that the report's tests, still kept in
this folder, give in a ``module:Class`` spec; it goes once they move to ``tests/unit/``."""

from tests.unit._factories import *  # noqa: F403
