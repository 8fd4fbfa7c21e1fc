"""A certificate's validity dates read from its DER, against OpenSSL's reading of them."""

from __future__ import annotations

import ssl
from datetime import datetime, timezone

import pytest

from exporter.server.certdates import validity
from tests import tls

pytestmark = pytest.mark.skipif(not tls.available(), reason="needs the openssl command")


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    return tls.self_signed(tmp_path_factory.mktemp("pem"))


def test_validity_dates_read_as_openssl_reads_them(tmp_path, pem):
    decode = getattr(ssl._ssl, "_test_decode_cert", None)  # type: ignore[attr-defined]
    if decode is None:  # pragma: no cover - a Python without it
        pytest.skip("no ssl._ssl._test_decode_cert")
    certs = [
        pem[0],  # UTCTime
        tls.dated(tmp_path, "20200101000000Z", "20200102000000Z", "utc")[0],
        # From 2050 on, RFC 5280 dates are GeneralizedTime.
        tls.dated(tmp_path, "20500101000000Z", "20600101000000Z", "generalized")[0],
    ]
    chain = tmp_path / "chain.crt"  # a key before, another certificate after: the first is read
    chain.write_bytes(pem[1].read_bytes() + certs[1].read_bytes() + certs[0].read_bytes())
    for path, expected in [*((c, c) for c in certs), (chain, certs[1])]:
        ours = validity(path.read_bytes())
        theirs = decode(str(expected))
        as_seconds = [ssl.cert_time_to_seconds(theirs[k]) for k in ("notBefore", "notAfter")]
        assert [int(t.timestamp()) for t in ours] == as_seconds, path
        assert all(t.tzinfo is timezone.utc for t in ours)
    with pytest.raises(ValueError):
        validity(b"no certificate")
    assert validity(pem[0].read_bytes())[1] > datetime.now(timezone.utc)


@pytest.mark.parametrize(
    "pem_text",
    [
        b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        b"-----BEGIN CERTIFICATE-----\nAgEB\n-----END CERTIFICATE-----\n",  # an INTEGER
        b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",  # truncated
    ],
    ids=["bad-base64", "not-a-sequence", "truncated"],
)
def test_what_is_no_certificate_is_a_value_error(pem_text):
    with pytest.raises(ValueError):
        validity(pem_text)
