"""TEMPORARY shim (snapfile refactor in progress): the old path, until every import is moved."""

from accounting.snapfile.writer import proc_stat as proc_stat
from accounting.snapfile.writer import process_start_ticks as process_start_ticks
