"""Request framing: when a request head frames its body ambiguously (RFC 9112 sections 3.2, 5.2,
6.1, 6.3), the request-smuggling patterns both HTTP stacks must refuse alike.

``framing_problem`` judges a whole raw head (the connection checks it before the parser sees it:
server/http/connections.py); ``scope_framing_problem`` judges an ASGI request's parsed headers
(FrontDoor, for heads pipelined behind a request in work and for in-process callers).
"""
from __future__ import annotations


def framing_problem(head: bytes, *, need_host: bool = True) -> str | None:
    """Why a whole request head (up to its blank line) frames its request ambiguously, or None.

    Refused: a line ended by a bare LF; an empty line before the request line; an obs-folded
    line; Content-Length with Transfer-Encoding;
    a Transfer-Encoding other than a single ``chunked`` (every Transfer-Encoding line counts);
    a Content-Length repeated or not a decimal number; an HTTP/1.1 request without exactly one
    Host (``need_host``). Anything else malformed is left to the parser (it answers 400 on both
    stacks).
    """
    lines = head.split(b"\n")[:-1]  # the head ends with LF: the last piece is empty
    if any(not line.endswith(b"\r") for line in lines):
        return "a request-head line ends with a bare LF: end every line with CRLF"
    lines = [line[:-1] for line in lines]
    if lines and not lines[0]:
        # NOTE: RFC 9112 section 2.2 lets a server skip them; h11 refuses them, so both do
        return "an empty line before the request line: start with the request line"
    if not lines:
        return None
    request_line, fields = lines[0], lines[1:-1]
    lengths: list[bytes] = []
    codings: list[bytes] = []
    hosts = 0
    for line in fields:
        if line[:1] in (b" ", b"\t"):
            return "an obs-folded header line (starting with whitespace): send each header on one line"
        name, colon, value = line.partition(b":")
        if not colon:
            return None  # not a header line: the parser's 400
        name = name.lower()
        if name == b"content-length":
            lengths += value.split(b",")
        elif name == b"transfer-encoding":
            codings += [c.strip().lower() for c in value.split(b",")]
        elif name == b"host":
            hosts += 1
    if codings and lengths:
        return "both Content-Length and Transfer-Encoding: send one of them"
    if codings and codings != [b"chunked"]:
        return "unsupported Transfer-Encoding: send the body with Content-Length or Transfer-Encoding: chunked alone"
    if len(lengths) > 1:
        return "more than one Content-Length: send one"
    if lengths and not lengths[0].strip(b" \t").isdigit():
        return "invalid Content-Length: send the body's size in bytes as a decimal number"
    if need_host and request_line.rstrip().endswith(b" HTTP/1.1") and hosts != 1:
        return "an HTTP/1.1 request needs exactly one Host header"
    return None


FRAMING_NAMES = frozenset({b"content-length", b"transfer-encoding"})


def scope_framing_problem(scope) -> str | None:
    """``framing_problem`` of an ASGI request's parsed head (its version and header lines), Host
    aside: in-process callers (server/batch/inprocess.py) send HTTP/1.1 scopes without one.

    The common head settles in one pass: no Transfer-Encoding, at most one Content-Length of
    digits alone, and no name or value a rebuilt head would read differently (a line break, a
    folded line, a colon in a name); any other head is rebuilt and judged whole (the same
    answer: ``tests/test_http_framing.py``).
    """
    lengths = 0
    for k, v in scope.get("headers", ()):
        if k[:1] in (b" ", b"\t") or b"\n" in k or b":" in k or b"\n" in v:
            return _rebuilt_problem(scope)
        name = k.lower()
        if name in FRAMING_NAMES:
            lengths += 1
            if lengths > 1 or name != b"content-length" or not bytes(v).strip(b" \t").isdigit():
                return _rebuilt_problem(scope)
    return None


def _rebuilt_problem(scope) -> str | None:
    version = str(scope.get("http_version", "1.1")).encode("ascii", "replace")
    lines = [b"X / HTTP/" + version] + [bytes(k) + b": " + bytes(v) for k, v in scope.get("headers", ())]
    return framing_problem(b"\r\n".join([*lines, b"", b""]), need_host=False)
