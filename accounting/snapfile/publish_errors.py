"""TEMPORARY shim (snapfile refactor in progress): the old path, until every import is moved."""

from accounting.snapfile.format import MAX_DETAIL as MAX_DETAIL
from accounting.snapfile.format import PUBLISH_ERROR_REASONS as REASONS  # noqa: F401
from accounting.snapfile.format import Counts as Counts
from accounting.snapfile.format import LastError as LastError
from accounting.snapfile.format import counts_of as counts_of
from accounting.snapfile.format import publish_errors_of as parse  # noqa: F401
from accounting.snapfile.writer import detail_of as detail_of
from accounting.snapfile.writer import reason_of as reason_of
