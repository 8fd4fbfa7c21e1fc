"""TEMPORARY shim (snapfile refactor in progress): the old path, until every import is moved."""

from accounting.snapfile.format import REASONS as REASONS
from accounting.snapfile.format import Refused as Refused
from accounting.snapfile.format import fail as fail
