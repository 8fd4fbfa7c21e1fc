"""TEMPORARY shim (snapfile refactor in progress): the old path, until every import is moved."""

from accounting.snapfile.format import *  # noqa: F403
from accounting.snapfile.format import _SHORT as _SHORT
