"""The project's error type: a user mistake or a bad input, reported as one line (``Interrupted``: a cut)."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@?#\"'`<>]*@")
_SECRET_PARAMS = re.compile(
    r"(?i)([?&;](?:x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential|"
    r"sig|signature|token|access_token|id_token|refresh_token|access_key|accesskey|access_key_id|secret|"
    r"secret_key|client_secret|password|passwd|pwd|key|api_key|apikey|code|auth|authorization|awsaccesskeyid)=)"
    r"[^&;#\s\"'`<>)]*"
)
_AUTH_FIELDS = re.compile(
    r"(?i)((?:^|[\s,])(?:credential|signature|x-amz-security-token|password|secret)=)[^,\s\"'`<>)]*"
)
"""An ``Authorization: AWS4-HMAC-SHA256 Credential=..., Signature=...`` header quoted in a client's error."""
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with the credentials a URL can carry replaced by ``***``: a user:password before the host
    (``http://KEY:SECRET@host``), credential-like query parameters (``X-Amz-Signature``, ``token``, ``sig``,
    ``access_key``...) and an Authorization header's ``Credential=``/``Signature=``. Every message that may quote
    an endpoint, a URL or another library's error goes through it."""
    if "://" not in text and "=" not in text:
        return text
    text = _SECRET_PARAMS.sub(rf"\1{REDACTED}", _USERINFO.sub(rf"\1{REDACTED}@", text))
    return _AUTH_FIELDS.sub(rf"\1{REDACTED}", text)


class PmakitError(Exception):
    """A problem the user can fix (bad input, bad option, missing file). The CLI prints it as one line; its message
    is ``redact``-ed (no credential of an endpoint URL is ever printed)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class Interrupted(PmakitError):
    """Stopped by something outside the inputs and options, which the same command may not meet again: a store
    that stopped answering after every retry, another rank lost. A merge keeps what it finished for the same command
    to continue (as after Ctrl-C or SIGTERM); a failure of the inputs themselves removes it."""


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: another library's exception named in one line of a warning or error."""
    text = str(exc).strip().splitlines()
    return redact(f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__)
