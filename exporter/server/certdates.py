"""A certificate's validity dates (notBefore, notAfter), read from its DER.

Python's ssl has no public way to read the dates of the certificate a server loads; this
reads them from the PEM text of a cert_file, the first certificate in it (the one OpenSSL
serves), walking just enough DER (RFC 5280) to reach them. `exporter.server.webconfig`
refuses a certificate out of its dates at start.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import datetime, timezone

_PEM_CERT = re.compile(
    rb"-----BEGIN ((?:X509 |TRUSTED )?CERTIFICATE)-----(.*?)-----END \1-----", re.DOTALL
)


def _der(data: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start of the content, end of the content) of the DER element at `at`."""
    if at + 2 > len(data):
        raise ValueError("truncated")
    tag, length = data[at], data[at + 1]
    at += 2
    if length & 0x80:
        n = length & 0x7F
        if not 1 <= n <= 4 or at + n > len(data):
            raise ValueError("bad length")
        length = int.from_bytes(data[at : at + n], "big")
        at += n
    if at + length > len(data):
        raise ValueError("truncated")
    return tag, at, at + length


def _time(tag: int, raw: bytes) -> datetime:
    text = raw.decode("ascii")
    if tag == 0x17 and len(text) == 13 and text.endswith("Z"):  # UTCTime YYMMDDHHMMSSZ
        yy = int(text[:2])
        text = f"{1900 + yy if yy >= 50 else 2000 + yy}{text[2:]}"  # RFC 5280 4.1.2.5.1
    elif not (tag == 0x18 and len(text) == 15 and text.endswith("Z")):  # GeneralizedTime
        raise ValueError("not an RFC 5280 time")
    return datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=timezone.utc)


def validity(pem: bytes) -> tuple[datetime, datetime]:
    """(notBefore, notAfter) of the first certificate in `pem` (the one OpenSSL serves from a
    cert_file), read from its DER (RFC 5280: Certificate, TBSCertificate, [0] version,
    serialNumber, signature, issuer, validity); ValueError if there is none to read."""
    found = _PEM_CERT.search(pem)
    if found is None:
        raise ValueError("no PEM certificate")
    try:
        der = base64.b64decode(b"".join(found.group(2).split()), validate=True)
    except binascii.Error:
        raise ValueError("bad base64") from None
    tag, start, _ = _der(der, 0)  # Certificate
    if tag != 0x30:
        raise ValueError("not a certificate")
    tag, at, _ = _der(der, start)  # TBSCertificate
    if tag != 0x30:
        raise ValueError("not a certificate")
    if _der(der, at)[0] == 0xA0:  # [0] version
        at = _der(der, at)[2]
    for _ in ("serialNumber", "signature", "issuer"):
        at = _der(der, at)[2]
    tag, at, _ = _der(der, at)  # Validity
    if tag != 0x30:
        raise ValueError("no validity")
    before_tag, start, end = _der(der, at)
    after_tag, start2, end2 = _der(der, end)
    return _time(before_tag, der[start:end]), _time(after_tag, der[start2:end2])
