"""The OpenAPI document is true: schemathesis (the real tool, as a user would run it) fuzzes every
operation it declares against a real `shoal serve` on the demo checkpoint, with a key, and
finds no 5xx, no undocumented status or content type, no response that breaks its schema, no
ignored auth and no wrong answer to an unsupported method.

Bounded and reproducible: a fixed seed and a fixed number of examples per operation
(SHOAL_FUZZ_SEED / SHOAL_FUZZ_EXAMPLES explore further)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_process import ShoalServer

pytestmark = pytest.mark.slow
CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
        "ignored_auth",
        "unsupported_method",
    )
)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ShoalServer:
    # Four frames per text batch: the fuzzer's syntheses stay short on a CPU.
    with ShoalServer.start(tmp_path_factory.mktemp("shoal-fuzz"), "--max-new-frames", "4") as running:
        yield running


def test_the_document_declares_what_the_server_does(server: ShoalServer) -> None:
    document = httpx.get(f"{server.url}/openapi.json").json()
    operations = {(path, method): op for path, ops in document["paths"].items() for method, op in ops.items()}
    ids = [op["operationId"] for op in operations.values()]
    assert len(ids) == len(set(ids))
    assert document["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"
    for (path, method), op in operations.items():
        for status, response in op["responses"].items():
            if status.startswith(("4", "5")):
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (path, method, status)
        public = path in ("/v1/health", "/metrics")
        assert ("security" in op) != public, (path, method)
    for path in ("/v1/tts", "/v1/audio/speech", "/v1/jobs"):
        assert "application/json" in operations[(path, "post")]["requestBody"]["content"]
    assert set(operations[("/v1/tts", "post")]["requestBody"]["content"]) == {
        "application/json",
        "application/msgpack",
    }
    assert "audio/mpeg" in operations[("/v1/tts", "post")]["responses"]["200"]["content"]
    assert "text/plain" in operations[("/metrics", "get")]["responses"]["200"]["content"]
    assert "application/msgpack" in operations[("/v1/references/list", "get")]["responses"]["200"]["content"]
    assert "Retry-After" in operations[("/v1/tts", "post")]["responses"]["503"]["headers"]
    assert "HTTPValidationError" not in json.dumps(document)


def test_schemathesis_finds_nothing(server: ShoalServer, tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    assert st, "schemathesis is a test dependency"
    command = [
        st, "run", f"{server.url}/openapi.json",
        "--header", f"Authorization: Bearer {server.key_a}",
        "--checks", CHECKS,
        "--max-examples", os.environ.get("SHOAL_FUZZ_EXAMPLES", "20"),
        "--seed", os.environ.get("SHOAL_FUZZ_SEED", "20261203"),
        "--workers", "2",
        "--request-timeout", "60",
    ]  # fmt: skip
    tests = Path(__file__).resolve().parent
    env = os.environ | {
        "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=480, cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    assert " passed" in output, output[-3000:]  # it ran test cases
