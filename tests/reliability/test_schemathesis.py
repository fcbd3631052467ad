"""Schemathesis against the OpenAPI document the server publishes (`/openapi.json`).

Where `test_fuzz_http.py` mutates valid bodies with hand-written hypothesis strategies, here
schemathesis derives every case from the published document itself, for every operation: its
coverage phase (boundary values, each field missing or of another type, other media types and
methods), hypothesis fuzzing in positive and negative modes, and stateful sequences. Every answer
must pass these checks:

- `not_a_server_error`: never a 5xx, and no request left unanswered (a timeout is an error);
- `status_code_conformance`, `content_type_conformance`, `response_headers_conformance`: a
  status and media type that the document lists for the operation;
- `response_schema_conformance`: the body matches the document — a JSON body as a whole, and a
  stream (`stream: true`) event by event against its media type's `itemSchema` (OpenAPI 3.2):
  each `data` is JSON of the chunk schema, an error object, or the final `[DONE]`. Streams are
  checked, not left out;
- `negative_data_rejection`: a request the document calls invalid is refused with a 4xx;
- `positive_data_acceptance_here` (schemathesis_hooks.py): a request the document calls valid
  is served, except for the three refusals that depend on the model and the server's settings;
- `unsupported_method`, `allow_header_conformance`: other methods get 405 with `Allow`;
- `missing_required_header`, `use_after_free`, `ensure_resource_availability`, `ignored_auth`:
  part of `--checks all`; they pass without anything to find (no auth; the document has no
  links from `POST /v1/responses` to the stored-response routes, cancel included, so
  schemathesis asks those for ids it made up and gets their documented 404:
  tests/http/test_responses_state_http.py and test_responses_background_http.py cover them,
  the SDK's calls included).

`GET /v1/responses` is the WebSocket upgrade: an HTTP client without the handshake gets its
documented 405, so `positive_data_acceptance_here` is not applied to it (the WebSocket mode has
its own tests).

It runs the `st` command line (`python -m schemathesis.cli`, as a person would) against a
`trio-mlx serve` process on the tiny random model on 127.0.0.1, with small token limits.
Bounded: in CI a fixed seed, 8 fuzzed cases per operation (plus the coverage phase's own), well
under a minute; `pytest --long` runs 300 per operation with a random seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from servers import keep_reading_log, serve_process

MAX_TOKENS = 16
SERVER_ARGS = [
    "--default-max-tokens",
    "4",
    "--max-tokens",
    str(MAX_TOKENS),
    "--admission",
    "wait",
    "--max-waiting",
    "8",
]
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "positive_data_acceptance_here",
    "unsupported_method",
    "allow_header_conformance",
    "missing_required_header",
    "use_after_free",
    "ensure_resource_availability",
    "ignored_auth",
]
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")


def run_schemathesis(
    url: str, workdir: Path, *, long_run: bool
) -> subprocess.CompletedProcess[str]:
    """`st run` in `workdir` (its cache directory and the JSON report land there)."""
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{url}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--max-examples",
        "300" if long_run else "8",
        "--request-timeout",
        "20",  # a generation here takes milliseconds; a hang is an error, not a wait
        # One worker: with two threads, hypothesis's ast.parse (describing a lambda) can raise
        # "SystemError: AST constructor recursion depth mismatch" on CPython 3.11 (python/cpython
        # gh-106905), a "Runtime Error" of the run that has nothing to do with the server.
        "--workers",
        "1",
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(workdir / "schemathesis.json"),
    ]
    # CI: one fixed set of cases. Long: a new seed each run, nothing stored between runs.
    if long_run:
        command += ["--generation-database", "none"]
    else:
        command += ["--seed", "20261203", "--generation-deterministic"]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": str(HOOKS),
        "TRIO_MLX_ST_MAX_TOKENS": str(MAX_TOKENS),
    }
    return subprocess.run(
        command,
        cwd=workdir,
        capture_output=True,
        text=True,
        env=env,
        timeout=3000 if long_run else 240,
        check=False,
    )


def test_schemathesis_against_the_published_schema(
    tiny_model_dir: Path, long_run: bool, tmp_path: Path
) -> None:
    with serve_process(tiny_model_dir, *SERVER_ARGS) as (process, url):
        assert url.startswith("http://127.0.0.1:")
        log = keep_reading_log(process)
        result = run_schemathesis(url, tmp_path, long_run=long_run)
        assert process.poll() is None, "the server exited during the run:\n" + "".join(log)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-20_000:] + "\nserver log:\n" + "".join(log)
    summary: dict[str, Any] = json.loads((tmp_path / "schemathesis.json").read_text())
    cases = summary["test_cases"]
    print(
        f"\nschemathesis {summary['schemathesis_version']}: {cases['generated']} cases, "
        f"{summary['running_time']:.1f} s, seed {summary['seed']}, "
        f"failures {cases['with_failures']}, errors {cases['errored']}"
    )
    for operation, rates in sorted(summary["valid_rates"].items()):
        counts = {name: (phase["accepted"], phase["rejected"]) for name, phase in rates.items()}
        print(f"  {operation}: (accepted, rejected) {counts}")
    assert summary["operations"]["tested"] == summary["operations"]["total"] == 26
    assert cases["with_failures"] == 0 and cases["errored"] == 0 and not summary["errors"]
    # The run reached the model (requests that were served), not only refusals.
    for route in (
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/responses",
        "POST /v1/responses/input_tokens",
        "POST /v1/messages",
        "POST /v1/messages/count_tokens",
    ):
        rates = summary["valid_rates"][route]
        assert sum(phase["accepted"] for phase in rates.values()) > 0, (route, rates)
