"""Whose a learner is: the credential every learner call is made under.

Three modes. *Shared* (the default, for trusted clusters): one `auth_token`, or none, for every
learner, so a caller is whoever it says it is and every learner's credential is "". *Tokens*: a
file the operator manages (`learner_tokens_file`, lines of `NAME TOKEN`), one token per
credential name; a learner call must carry one of them, and the call's credential is its name.
*Client certificates* (`client_cert_credentials`, under mTLS): the credential is the identity
the client's certificate names (its common name, else its first subject alternative name).

A learner id is bound at Join to the credential it joined under: a re-join, push or pull of that
id under another credential is PERMISSION_DENIED, and the limits that assume one learner is one
party (live learners, streams) are counted per credential. gRPC-free: the server hands in what
the call presented (its bearer token, its certificate's identities).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Sequence
from pathlib import Path

from synchronizer.errors import Code, Rejected

SHARED = ""  # every learner's credential in shared mode
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")
MIN_TOKEN_CHARS = 16


def load_tokens(path: Path) -> dict[str, str]:
    """Token -> credential name from a tokens file: one `NAME TOKEN` per line, blank lines and
    lines starting with # ignored. ValueError, naming the file and line, for a malformed line,
    a name or token used twice, a token shorter than MIN_TOKEN_CHARS, or no token at all."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"learner_tokens_file {path}: cannot be read ({e.strerror})") from None
    tokens: dict[str, str] = {}
    names: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"learner_tokens_file {path}, line {n}"
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{where}: expected 'NAME TOKEN', got {len(parts)} fields")
        name, token = parts
        if not NAME_RE.fullmatch(name):
            raise ValueError(
                f"{where}: name {name[:80]!r} must be 1-64 characters of letters, digits and ._@:-"
            )
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"{where}: the token of {name!r} has {len(token)} characters; at least {MIN_TOKEN_CHARS}"
            )
        if name in names:
            raise ValueError(f"{where}: name {name!r} appears twice (one token per name)")
        if token in tokens:
            raise ValueError(f"{where}: {name!r} has the same token as {tokens[token]!r}")
        tokens[token] = name
        names.add(name)
    if not tokens:
        raise ValueError(f"learner_tokens_file {path}: holds no 'NAME TOKEN' line")
    return tokens


class Credentials:
    def __init__(self, tokens: dict[str, str] | None = None, client_certs: bool = False) -> None:
        self.tokens = tokens or {}
        self.client_certs = client_certs

    @property
    def per_learner(self) -> bool:
        return bool(self.tokens) or self.client_certs

    def describe(self) -> str:
        if self.tokens:
            return f"per-learner tokens ({len(self.tokens)} credentials)"
        if self.client_certs:
            return "client certificates (the identity each certificate names)"
        return "shared (every learner trusted to be who it says: for trusted clusters only)"

    def name_of_token(self, token: str) -> str | None:
        """The credential a token names, compared in constant time; None if it names none."""
        found = None
        for known, name in self.tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = name
        return found

    def of_call(self, token: str | None, cert_identities: Sequence[str]) -> str:
        """The credential of a call that presented `token` (a bearer token, or None) and a
        client certificate naming `cert_identities`: SHARED in shared mode. Rejected
        (UNAUTHENTICATED) when a per-learner mode finds no credential; the server's token check
        has refused unknown tokens before any handler runs."""
        if self.tokens:
            name = self.name_of_token(token or "")
            if name is not None:
                return name
            raise Rejected(
                Code.UNAUTHENTICATED,
                "no_credential",
                "this Synchronizer gives each learner its own token: send yours as 'authorization: Bearer TOKEN'",
            )
        if self.client_certs:
            if cert_identities:
                return cert_identities[0]
            raise Rejected(
                Code.UNAUTHENTICATED,
                "no_credential",
                "this Synchronizer names learners by their client certificates: connect with one (mTLS)",
            )
        return SHARED
