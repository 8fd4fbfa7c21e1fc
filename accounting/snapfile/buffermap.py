"""TEMPORARY shim (snapfile refactor in progress): the old path, until every import is moved."""

from accounting.snapfile.head import buffer_map as buffer_map
