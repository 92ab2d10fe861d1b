"""Real storage servers for the store's tests, each started once per test process and stopped
when it exits: PostgreSQL (`pgserver`: PostgreSQL's own binaries from PyPI) and an S3-compatible
server (moto's server mode, a separate process on a free port); a fresh database or bucket per
test, and the standard AWS variables that point boto3 (here and in `shoal` subprocesses) at it."""

from __future__ import annotations

import atexit
import functools
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import pytest
from server_process import free_port

S3_START_TIMEOUT = 30.0


@functools.cache
def postgres_server() -> tuple[str, str]:
    """(admin connection string, URL template with `{database}`) of this process's server."""
    pgserver = pytest.importorskip("pgserver")
    server = pgserver.get_server(tempfile.mkdtemp(prefix="shoal-postgres-"), cleanup_mode="delete")
    uri = server.get_uri()  # postgresql://postgres:@/postgres?host=<socket directory>
    return uri, uri.replace("@/postgres?", "@/{database}?")


def fresh_database() -> str:
    """The URL of a new, empty database on the session's PostgreSQL server."""
    psycopg = pytest.importorskip("psycopg")
    admin, template = postgres_server()
    database = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {database}")
    return template.format(database=database)


@functools.cache
def s3_endpoint() -> str:
    """The URL of this process's moto server (`python -m moto.server`), started on first use."""
    pytest.importorskip("moto.server")
    port = free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(stop_process, process)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + S3_START_TIMEOUT
    while True:
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=1).raise_for_status()
            return endpoint
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's server did not start on port {port}") from None
            time.sleep(0.05)


def stop_process(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


def s3_environment(endpoint: str, endpoint_variable: str = "AWS_ENDPOINT_URL_S3") -> dict[str, str]:
    """The standard AWS variables for the test server: any credentials pass, and no profile,
    config file or instance metadata of this machine's user is consulted."""
    return {
        "AWS_ACCESS_KEY_ID": "shoal-test",
        "AWS_SECRET_ACCESS_KEY": "shoal-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        endpoint_variable: endpoint,
        "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def use_s3(monkeypatch: pytest.MonkeyPatch, endpoint_variable: str = "AWS_ENDPOINT_URL_S3") -> str:
    """Point this test (and the processes it starts) at the test server; a new bucket's name."""
    endpoint = s3_endpoint()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_environment(endpoint, endpoint_variable).items():
        monkeypatch.setenv(name, value)
    bucket = "shoal-" + uuid.uuid4().hex[:16]
    s3_client().create_bucket(Bucket=bucket)
    return bucket


def s3_client():
    """A plain boto3 client on the test server (the environment `use_s3` set): to look at or
    change a bucket behind the store's back."""
    import boto3

    return boto3.session.Session().client("s3")
