"""Which of the relay's secrets an answer is redacted of (`core.wire.redact.AnswerRedaction`),
with plain values: headers, bodies by status, bodies read whole, socket messages."""

from __future__ import annotations

from unbroken.core.wire.redact import REDACTED, AnswerRedaction, Redactor, redact

KEY = "sk-upstream-key-0001"
OTHER = "sk-other-route-key-02"
TOKEN = "relay-token-abcdef-123"
SECRETS = (OTHER, TOKEN, KEY)


def test_headers_are_redacted_of_every_secret_and_the_key() -> None:
    assert AnswerRedaction(SECRETS, KEY).headers == (*SECRETS, KEY)
    assert AnswerRedaction(SECRETS, None).headers == SECRETS
    assert AnswerRedaction((), KEY).headers == (KEY,)
    assert AnswerRedaction((), None).headers == ()


def test_an_errors_body_is_redacted_of_every_secret_any_other_of_the_key_only() -> None:
    keyed = AnswerRedaction(SECRETS, KEY)
    for status in (400, 401, 429, 500, 503):
        assert keyed.body(status) == SECRETS
    for status in (200, 201, 204, 302, 399):
        assert keyed.body(status) == (KEY,)  # the upstream knows no other
    plain = AnswerRedaction(SECRETS, None)
    assert plain.body(500) == SECRETS
    assert plain.body(200) == ()  # nothing to redact: a Content-Length is kept
    # A relay that holds no secret: an error's body still loses the key it was sent.
    assert AnswerRedaction((), KEY).body(500) == (KEY,)
    assert AnswerRedaction((), None).body(500) == ()


def test_a_body_read_whole_is_redacted_as_an_errors_whatever_its_status() -> None:
    # (a final answer re-sent in a stream whose headers are out may be a 200)
    assert AnswerRedaction(SECRETS, KEY).whole == SECRETS
    assert AnswerRedaction(SECRETS, None).whole == SECRETS
    assert AnswerRedaction((), None).whole == ()


def test_the_chosen_secrets_redact_a_streamed_body_across_chunks() -> None:
    body = f'{{"error": {{"message": "bad key {OTHER} for {KEY}"}}}}'.encode()
    redactor = Redactor(AnswerRedaction(SECRETS, KEY).body(401))
    out = b"".join(redactor.feed(body[i : i + 5]) for i in range(0, len(body), 5))
    out += redactor.flush()
    assert out == redact(body, SECRETS)
    assert OTHER.encode() not in out and KEY.encode() not in out and REDACTED.encode() in out


def test_a_socket_message_is_redacted_as_an_error_when_it_names_one() -> None:
    keyed = AnswerRedaction(SECRETS, KEY)
    error = f'{{"type":"error","error":{{"message":"{TOKEN} and {KEY}"}}}}'.encode()
    assert keyed.message(error) == redact(error, SECRETS)
    assert TOKEN.encode() not in keyed.message(error)
    delta = f'{{"type":"response.output_text.delta","delta":"{KEY} {TOKEN}"}}'.encode()
    out = keyed.message(delta)
    assert KEY.encode() not in out
    assert TOKEN.encode() in out  # not an error: only the key the socket was opened with
    clean = b'{"type":"response.output_text.delta","delta":"hello"}'
    assert keyed.message(clean) is clean
    unkeyed = AnswerRedaction(SECRETS, None)
    assert unkeyed.message(delta) is delta
    assert KEY.encode() not in unkeyed.message(error)
    short = AnswerRedaction((), "sk-1")  # too short to look for (`MIN_SECRET`)
    assert short.message(b'{"delta":"sk-1"}') == b'{"delta":"sk-1"}'
