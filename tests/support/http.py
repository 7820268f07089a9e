"""HTTP helpers of the Serve integration tests: every error body they receive goes through :func:`clean`
(an OpenAI error object carrying no traceback, Ray task error, file path, pid or ANSI escape)."""

from __future__ import annotations

import json
import re

import httpx

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

INTERNALS = re.compile(
    r"Traceback|RayTaskError|RayActorError|ActorDiedError|/site-packages/|\x1b\[|\bpid[=:]|"
    r"File \"|actor_id|namespace|\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b"
)
ERROR_BODIES: list[str] = []  # every error body seen through these helpers (checked as it arrives)


def clean(body: str) -> str:
    """An error body must be an OpenAI error object carrying no internals."""
    ERROR_BODIES.append(body)
    found = INTERNALS.search(body)
    assert found is None, f"internal detail {found.group(0)!r} in an error body: {body[:2000]}"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    return body


def post(url, path, body, headers=AUTH, timeout=60):
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    r = httpx.post(url + path, content=raw, headers={**headers, "Content-Type": "application/json"}, timeout=timeout)
    if r.status_code >= 400:
        clean(r.text)
    return r


def get(url, path, headers=AUTH, timeout=30):
    r = httpx.get(url + path, headers=headers, timeout=timeout)
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json") and "error" in r.json():
        clean(r.text)
    return r


def sse_events(url, path, body, headers=AUTH, timeout=120, on_first=None) -> tuple[int, list]:
    """(status, parsed events) of a streamed request; error events are checked by :func:`clean`.
    ``on_first()`` is called when the first bytes of the answer arrive."""
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
        parts = []
        for part in r.iter_bytes():
            if not parts and on_first is not None:
                on_first()
            parts.append(part)
        raw = b"".join(parts).decode()
    if r.status_code != 200:
        clean(raw)
        return r.status_code, [json.loads(raw)]
    events = [e[6:] for e in raw.split("\n\n") if e]
    out = []
    for e in events:
        if e != "[DONE]" and '"error"' in e and json.loads(e).get("error"):
            clean(e)
        out.append(e if e == "[DONE]" else json.loads(e))
    return r.status_code, out
