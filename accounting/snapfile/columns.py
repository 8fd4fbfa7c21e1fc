"""TEMPORARY shim (snapfile refactor in progress): the old path, until every import is moved."""

from accounting.snapfile.format import Columns as Columns
from accounting.snapfile.format import columns_of as columns_of
from accounting.snapfile.format import rows_of as rows_of
from accounting.snapfile.format import table_of as table_of
