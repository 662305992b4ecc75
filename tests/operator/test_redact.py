"""Redaction of pod-written text (operator/gemma_operator/redact.py), alone and where it reaches the status."""

from __future__ import annotations

import json

import pytest

from gemma_operator import status
from gemma_operator.poller import keep_engine_fields
from gemma_operator.redact import MAX_BYTES, REDACTED, redact

HF_TOKEN = "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"
SECRETS = {
    "an env dump": (f"HF_TOKEN={HF_TOKEN}\nGEMMA_API_KEY=s3cr3t-value\nHOME=/home/app", "s3cr3t"),
    "a Hugging Face token": (f"401 Unauthorized for token {HF_TOKEN}", HF_TOKEN),
    "a bearer header": ("request failed: Authorization: Bearer abcdefgh12345678", "abcdefgh12345678"),
    "a JWT": ("token eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl expired", "eyJhbGciOiJSUzI1NiJ9"),
    "a password assignment": ('connect failed: password="hunter2!"', "hunter2!"),
    "URL credentials": ("GET https://user:pa55w0rd@example.com/x failed", "pa55w0rd"),
    "a private key": ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE KEY-----", "MIIEowIBAAKCAQEA"),
    "a random token": ("key f5KjRPYS3IYl2q9khNs0n-ajruC_RLWP rejected", "f5KjRPYS3IYl2q9khNs0n"),
    "a GitHub token": ("ghp_0123456789abcdefghijABCDEFGHIJ012345 leaked", "ghp_0123456789"),
    "an AWS key id": ("AKIAIOSFODNN7EXAMPLE in use", "AKIAIOSFODNN7EXAMPLE"),
}


@pytest.mark.parametrize("text,secret", SECRETS.values(), ids=SECRETS.keys())
def test_credentials_are_redacted(text, secret):
    out = redact(text)
    assert secret not in out and REDACTED in out, out


@pytest.mark.parametrize("text", [
    "smoke: tpu matmul mismatch (max abs err 3.1e-1)",
    "weights: cannot open /models/pvc/claim/xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text-emb4/model.safetensors",
    "weights: missing tensor model.language_model.layers.0.self_attn.q_proj.weight (expected [2048, 1536])",
    "build: cargo build failed: error[E0425]: cannot find value `attention_mask` in this scope",
    "import: torch_tpu 0.2.0 needs libtpu 0.0.51, found 0.0.49",
    "prompt has 9000 tokens, context is 8192 (max_tokens=64)",
])
def test_ordinary_failure_reasons_pass_unchanged(text):
    assert redact(text) == text


def test_text_is_capped_at_1_kib_keeping_its_end():
    text = "start " + "é" * 5000 + " the last line says why"
    out = redact(text)
    assert len(out.encode()) <= MAX_BYTES
    assert out.startswith("…") and out.endswith("the last line says why")


def test_a_credential_never_survives_half_cut():
    # The cut falls inside the token; redacting first means no piece of it is left.
    text = "x" * 2000 + f" HF_TOKEN={HF_TOKEN} " + "y" * (MAX_BYTES - 30)
    assert "hf_" not in redact(text) and "cthGFr" not in redact(text)


def test_a_huge_message_costs_bounded_work():
    out = redact("HOME=/root\n" * 1_000_000)
    assert len(out.encode()) <= MAX_BYTES and "/root" not in out


def test_termination_message_and_boot_failure_reach_the_status_redacted():
    term = {"exitCode": 1, "reason": "Error", "message": f"HF_TOKEN={HF_TOKEN}\nPATH=/usr/bin\n" + "z" * 5000}
    crashed = {"metadata": {"name": "g-1"}, "spec": {"nodeName": "n"},
               "status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}],
                          "containerStatuses": [{"name": "server", "restartCount": 2, "lastState": {"terminated": term},
                                                 "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    booting = {"metadata": {"name": "g-2"}, "spec": {"nodeName": "n"},
               "status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}],
                          "containerStatuses": [{"name": "server", "state": {"running": {"startedAt": "t"}}}]}}
    obs = status.Observed(generation=1, replicas=2, pods=[crashed, booting],
                          engine={"g-2": keep_engine_fields({"stage": "smoke", "failed": f"env: HF_TOKEN={HF_TOKEN}"})},
                          served_models={}, problems=[], optional={}, skipped=[])
    out = status.compute_status(obs, accelerator="cpu", endpoint="", selector="")
    assert HF_TOKEN not in json.dumps(out)
    assert len(out["lastFailure"]["message"].encode()) <= MAX_BYTES
    assert out["pods"][1]["message"] == f"stage smoke: env: HF_TOKEN={REDACTED}"
