from __future__ import annotations

import pytest

from tests.accounting.snapfile.files import publish_one


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(envelope, buffer rows, the snapshot published) of a real published file."""
    return publish_one(tmp_path_factory.mktemp("snap"))
