"""Schemathesis hooks for the runs against the server's OpenAPI document (tests/server/test_openapi.py,
bench/fuzz.py), loaded with `SCHEMATHESIS_HOOKS=tests.server.openapi_checks`.

Every built-in check runs, two of them in a narrower reading. `created_resources_are_available` is
`ensure_resource_availability` but for a response created with `store: false`, which is not kept.
`schema_valid_requests_are_served` narrows `positive_data_acceptance`:
schemathesis's `positive_data_acceptance` wants a 2xx for every request the document allows, but some
refusals depend on what no JSON Schema can state: the chat template's own rules, a prompt's length in
tokens, references between fields, strings that must hold JSON, and what llguidance compiles
(`REFUSALS_BEYOND_THE_SCHEMA` names each, with why). schemathesis.toml lets the built-in check accept a 400,
and this check fails every schema-valid 400 but those, each told by the server's own message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import schemathesis
from prometheus_client.parser import text_string_to_metric_families

# (param, message prefix) of the 400s a schema-valid request may get, each group with why the document cannot
# say it; the messages are the server's own (chat_template.render_chat, GenerationRequest.engine_params and
# check_size, the requests' checks). A param ending in "[" or "." stands for every field under it
# (messages[3].tool_calls[0]...). /v1/responses and /v1/messages name their own fields (input, system, ...)
# for the same chat checks. Everything else a request's checks refuse, the document states (minItems, the
# per-role rules of a message, the rules tying two fields together), so a schema-valid request never gets it.
REFUSALS_BEYOND_THE_SCHEMA = (
    # The chat template's own rules (Gemma's templates want user and assistant turns to alternate; Gemma 4's
    # want a tool result to answer a call of the turn before it) and a prompt's length in tokens.
    *((field, prefix) for field in ("messages", "input", "system")
      for prefix in ("The chat template rejected the messages:", "Input length (", "The prompt is longer than")),
    ("messages[", "messages["),  # a tool_call_id that answers no call (Gemma 4's template folds results)
    # /v1/messages: a conversation must end with a user turn (the reply is a new turn, no prefill), and each
    # tool_result is a chat message of its own, so a body within its caps can make more than chat's 1,024.
    ("messages[", "A final assistant message (prefill)"),
    ("messages", "messages must hold at most"),
    ("input[", "input["),
    ("prompt", "Input length ("),
    ("prompt", "The prompt is longer than"),
    # References between fields and items: a named tool that tools lacks, a name given twice (uniqueItems
    # compares whole items, not one property of them).
    ("tool_choice", "tool_choice names"),
    ("tools[", "Two tools are named"),
    # A string that must hold JSON: a call's arguments (a JSON object's text), a JSON Schema given as text
    # (guided_json, structured_outputs.json: vLLM takes both an object and its text), since
    # contentMediaType/contentSchema are annotations a validator does not check.
    ("messages[", "Tool call arguments must be"),
    ("input[", "Tool call arguments must be"),
    *((field, f"{field} {rule}") for field in ("guided_json", "structured_outputs.json")
      for rule in ("is not a JSON Schema", "must be a JSON Schema")),
    # Two of structured_outputs' kinds, or one of them and guided_json: one constraint per request.
    ("structured_outputs", "Only one structured output"),
    ("guided_json", "Only one structured output"),
    # What a grammar can enforce and what llguidance compiles are llguidance's to say (a string that is not a
    # JSON Schema it takes, a schema past its limits).
    *((field, prefix) for field in ("response_format", "text.format", "tools[", "tool_choice", "structured_outputs",
                                    "guided_json")
      for prefix in ("The constraint cannot be compiled", "The schema cannot be enforced")),
    # max_tokens 0 only with echo and logprobs: JSON Schema can say it, but beside best_of's rule (sixteen
    # branches) the generator's canonical form (jsonschema_rs) gives up on the whole request schema.
    ("max_tokens", "max_tokens must be at least 1 (0 only with echo)"),
    ("max_tokens", "max_tokens 0 needs logprobs"),
    # A control token's text in a tool's name or parameters: the tokenizer's special tokens are the loaded
    # model's, not the document's.
    ("tools[", "tools["),
)


def refused_beyond_the_schema(body: object) -> bool:
    """Whether an error body is one of the refusals the document cannot state."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return False
    got = str(error.get("param"))
    return any((got == param or (param[-1] in "[." and got.startswith(param)) or got.startswith(param + "."))
               and str(error.get("message", "")).startswith(prefix) for param, prefix in REFUSALS_BEYOND_THE_SCHEMA)


@schemathesis.check
def created_resources_are_available(ctx, response, case) -> bool | None:
    """schemathesis's `ensure_resource_availability` (a resource a POST created is there for the GET and
    DELETE its links lead to), which `run_schemathesis` excludes in its own name, except after a POST
    /v1/responses with `store: false`: OpenAI's Responses API keeps no such response, so GET and DELETE by its
    id are 404 (the document's link says so in its description)."""
    from schemathesis.specs.openapi.checks import ensure_resource_availability

    parent = ctx.internals.find_parent(case_id=case.id)
    if parent is not None and isinstance(parent.body, dict) and parent.body.get("store") is False:
        return None
    return ensure_resource_availability(ctx, response, case)


@schemathesis.check
def schema_valid_requests_are_served(ctx, response, case) -> None:
    """A request the document allows gets no 400 but for a refusal beyond the schema."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    try:
        body = response.json()
    except ValueError:
        body = None
    if not refused_beyond_the_schema(body):
        raise AssertionError(f"A schema-valid request got 400: {response.text[:300]}")
    return None


# ---- running schemathesis against a served document -----------------------------------------------

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def run_schemathesis(base: str, api_key: str, report: Path, *, seed: int, max_examples: int,
                     timeout: float, workers: int = 1, extra: tuple[str, ...] = ()) -> dict:
    """`st run` against `base`/openapi.json with every check, this module's hooks and schemathesis.toml.

    Args:
        base: the server's URL.
        api_key: its --api-key (sent as a bearer token; the `ignored_auth` check also sends none).
        report: where the JSON run report goes.
        seed: schemathesis's seed (fixed: the same cases every run).
        max_examples: cases per operation in the fuzzing phase (the coverage phase adds its own).
        timeout: seconds for the whole run.
        workers: operations tested at once (more than 1 lets the engine batch the two generation routes).
        extra: more `st run` options.
    Returns:
        the JSON run report: `test_cases.generated`, `failures`, `errors`, `exit_code`, ...
    """
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(HERE / "schemathesis.toml"), "run",
           f"{base}/openapi.json", "--header", f"Authorization: Bearer {api_key}", "--checks", "all",
           # `created_resources_are_available` runs it, narrowed (above); `--checks all` would run it as well.
           "--exclude-checks", "ensure_resource_availability",
           "--seed", str(seed), "--max-examples", str(max_examples), "--workers", str(workers), "--continue-on-failure",
           "--request-timeout", "120", "--max-response-time", "120", "--no-color",
           "--report", "json", "--report-json-path", str(report), *extra]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.openapi_checks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=report.parent)
    if not report.is_file():
        raise RuntimeError(f"schemathesis wrote no report (exit {out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    result = json.loads(report.read_text())
    result["output"] = out.stdout
    return result


def finished_requests(base: str) -> dict[str, float]:
    """The server's `gemma_request_success_total` by finished_reason (stop, length, abort, error)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    return {sample.labels["finished_reason"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "gemma_request_success_total"}


def engine_replies(base: str) -> float:
    """Requests the server's engine answered to their end (finished "stop" or "length"), from /metrics."""
    finished = finished_requests(base)
    return finished.get("stop", 0) + finished.get("length", 0)
