"""exporter.models: the debug endpoint's row models are accounting's dataclasses, field for field."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pydantic
import pytest

from accounting.buffers import Owner
from accounting.tp_status import TpStatus
from exporter import debug_schema
from exporter.models import model_of
from tests.ledgers import small_ledger


@pytest.fixture(scope="module")
def snapshot():
    with small_ledger() as sl:
        sl.allocate(300)
        sl.c4.occupy(5)
        yield sl.ledger.snapshot(reconcile=False)


def test_each_row_model_has_exactly_the_fields_to_dict_writes(snapshot):
    buf, acc = snapshot.buffers[0], snapshot.accounts[0]
    assert set(debug_schema.BufferModel.model_fields) == set(buf.to_dict())
    assert set(debug_schema.AccountModel.model_fields) == set(acc.to_dict())
    tp = TpStatus(
        rank=0,
        size=2,
        exchanges_total=1,
        page_ops_total=2,
        divergences_total=0,
        peer_failures_total=0,
    )
    assert set(debug_schema.TpModel.model_fields) == set(tp.to_dict())
    # and each validates what to_dict writes, every value kept
    assert debug_schema.BufferModel(**buf.to_dict()).model_dump() == buf.to_dict()
    assert debug_schema.AccountModel(**acc.to_dict()).model_dump() == acc.to_dict()
    assert debug_schema.TpModel(**tp.to_dict()).model_dump() == tp.to_dict()


def test_a_key_the_dataclass_does_not_declare_is_refused(snapshot):
    row = {**snapshot.buffers[0].to_dict(), "surprise": 1}
    with pytest.raises(pydantic.ValidationError, match="surprise"):
        debug_schema.BufferModel(**row)


def test_enum_fields_are_the_literal_of_their_values(snapshot):
    owner = debug_schema.BufferModel.model_fields["owner"].annotation
    assert owner == Literal["vmm", "runtime"]
    with pytest.raises(pydantic.ValidationError):
        debug_schema.BufferModel(**{**snapshot.buffers[0].to_dict(), "owner": "borrowed"})
    assert {o.value for o in Owner} == {"vmm", "runtime"}


def test_a_field_added_to_the_dataclass_reaches_the_model():
    @dataclasses.dataclass(frozen=True)
    class Row:
        a: int
        b: tuple[int, ...]
        c: Owner | None = None

    model = model_of(Row, name="RowModel", descriptions={"a": "the a"})
    assert set(model.model_fields) == {"a", "b", "c"}
    assert model.model_fields["a"].description == "the a"
    assert model(a=1, b=[2, 3]).model_dump() == {"a": 1, "b": [2, 3], "c": None}
    with pytest.raises(KeyError, match="'z'"):
        model_of(Row, name="RowModel", descriptions={"z": "no such field"})


def test_openapi_shows_the_generated_rows():
    from fastapi.testclient import TestClient

    from exporter.app import create_app
    from exporter.sources import Sources

    comps = TestClient(create_app(Sources())).get("/openapi.json").json()["components"]["schemas"]
    buf = comps["BufferModel"]
    assert buf["properties"]["owner"]["enum"] == ["vmm", "runtime"]
    assert "page by page" in buf["properties"]["owner"]["description"]
    assert buf["additionalProperties"] is False
    assert set(buf["required"]) >= {"name", "family", "physical_bytes", "occupied_bytes"}
    assert comps["AccountModel"]["properties"]["map_bucket_counts"]["type"] == "array"
    assert "TpModel" in comps and "ViolationModel" in comps
