"""A self-signed certificate for 127.0.0.1 made with the openssl command (Debian's), one valid
between given dates, and the files of a `--web.config.file`, each written with the modes
`exporter.server.webconfig` requires."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


def available() -> bool:
    return Path(OPENSSL).exists()


def self_signed(folder: Path, name: str = "server") -> tuple[Path, Path]:
    """(certificate, private key) for CN and subjectAltName 127.0.0.1, valid one day; key 0600."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        [
            OPENSSL,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    os.chmod(key, 0o600)
    os.chmod(cert, 0o644)
    return cert, key


def dated(folder: Path, start: str, end: str, name: str = "dated") -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1 valid from `start` to `end` (YYYYMMDDHHMMSSZ), made
    with `openssl ca -selfsign` (`openssl req` of OpenSSL 3.0 cannot date a certificate in
    the past); key 0600."""
    work = folder / f"{name}-ca"
    work.mkdir()
    (work / "index.txt").write_text("")
    (work / "serial").write_text("01\n")
    (work / "ca.cnf").write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nnew_certs_dir = .\n"
        "serial = serial\ndefault_md = sha256\npolicy = p\nunique_subject = no\n"
        "[p]\ncommonName = supplied\n"
    )
    key, csr, cert = folder / f"{name}.key", work / "r.csr", folder / f"{name}.crt"
    run = {"check": True, "capture_output": True, "timeout": 60, "cwd": work}
    subprocess.run(
        [
            *(OPENSSL, "req", "-new", "-newkey", "ec"),
            *("-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=127.0.0.1"),
            *("-keyout", str(key), "-out", str(csr)),
        ],
        **run,  # type: ignore[call-overload]
    )
    subprocess.run(
        [
            *(OPENSSL, "ca", "-batch", "-notext", "-config", "ca.cnf", "-selfsign"),
            *("-keyfile", str(key), "-in", str(csr), "-out", str(cert)),
            *("-startdate", start, "-enddate", end),
        ],
        **run,  # type: ignore[call-overload]
    )
    os.chmod(key, 0o600)
    os.chmod(cert, 0o644)
    return cert, key


def write_private(path: Path, text: str, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def web_config(path: Path, doc: dict, mode: int = 0o600) -> Path:
    return write_private(path, yaml.safe_dump(doc), mode)
