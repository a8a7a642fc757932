"""Just enough of NATS decentralized auth (JWT v2) to run nats-server in operator mode.

Operator, account and user JWTs are built here from `nkeys` keys, laid out as
github.com/nats-io/jwt/v2 lays them out:

* header `{"typ":"JWT","alg":"ed25519-nkey"}`;
* claims `jti`, `iat`, `iss` (the issuer's public key), `name`, `sub` (the
  subject's public key) and `nats` (`type` operator/account/user, `version` 2,
  plus the type's own fields);
* `jti` is the base32 (no padding) of SHA-512/256 over the JSON of the
  standard claims with `jti` empty, as `ClaimsData.hash()` does; nats-server
  does not check it, it is only the token's id;
* the signature is Ed25519 by the issuer's seed over
  `base64url(header) + "." + base64url(claims)`, base64url without padding.

An operator signs accounts, an account signs its users; nats-server trusts the
operator JWT from its config and the account JWTs from `resolver_preload`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

import nkeys

from shared.subjects import Permissions

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
VERSION = 2
NO_LIMIT = -1

#: nats-server's `allow_responses: true`: one reply within two minutes (ttl in ns).
_ALLOW_RESPONSES = {"max": 1, "ttl": 120 * 1_000_000_000}


def new_seed(prefix: int) -> bytes:
    """A fresh nkey seed: `nkeys.PREFIX_BYTE_OPERATOR`, `_ACCOUNT` or `_USER`."""
    return nkeys.encode_seed(os.urandom(32), prefix)


def public_key(seed: bytes) -> str:
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _jti(claims: dict[str, object]) -> str:
    # ClaimsData in field order, omitempty, ID blank: aud exp jti iat iss name nbf sub
    base = {k: claims[k] for k in ("aud", "exp", "iat", "iss", "name", "nbf", "sub") if claims.get(k)}
    try:
        h = hashlib.new("sha512_256")
    except ValueError:  # an OpenSSL without SHA-512/256: any stable id will do
        h = hashlib.sha256()
    h.update(_json(base))
    return base64.b32encode(h.digest()).rstrip(b"=").decode()


def encode(issuer_seed: bytes, subject: str, name: str, nats: dict[str, object]) -> str:
    """Sign one JWT: `nats` is the type-specific section, `type` and `version` included."""
    claims: dict[str, object] = {
        "iat": int(time.time()),
        "iss": public_key(issuer_seed),
        "name": name,
        "sub": subject,
    }
    claims = {"jti": _jti(claims), **claims, "nats": nats}
    signing_input = f"{_b64(_json(HEADER))}.{_b64(_json(claims))}"
    kp = nkeys.from_seed(bytearray(issuer_seed))
    try:
        sig = kp.sign(signing_input.encode())
    finally:
        kp.wipe()
    return f"{signing_input}.{_b64(sig)}"


def decode_claims(token: str) -> dict[str, object]:
    """The claims of a JWT, unverified (for tests' own assertions)."""
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def operator_jwt(operator_seed: bytes, name: str, *, system_account: str = "") -> str:
    """Self-signed operator JWT."""
    nats: dict[str, object] = {"type": "operator", "version": VERSION}
    if system_account:
        nats["system_account"] = system_account
    return encode(operator_seed, public_key(operator_seed), name, nats)


def account_jwt(operator_seed: bytes, account: str, name: str, *, jetstream: bool = True) -> str:
    """Account JWT signed by the operator: no limits on it, JetStream unlimited when enabled.

    JetStream is on for an account exactly when its `mem_storage` or
    `disk_storage` limit is non-zero.
    """
    limits: dict[str, object] = {
        # NatsLimits
        "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT,
        # AccountLimits (`wildcards` is a bool in jwt/v2, not a count)
        "imports": NO_LIMIT, "exports": NO_LIMIT, "wildcards": True, "conn": NO_LIMIT, "leaf": NO_LIMIT,
    }
    if jetstream:
        limits.update({"mem_storage": NO_LIMIT, "disk_storage": NO_LIMIT, "streams": NO_LIMIT, "consumer": NO_LIMIT})
    nats: dict[str, object] = {"limits": limits, "default_permissions": {"pub": {}, "sub": {}}, "type": "account", "version": VERSION}
    return encode(operator_seed, account, name, nats)


def user_permissions(p: Permissions) -> dict[str, object]:
    """`shared.subjects.Permissions` as a user JWT's pub/sub/resp."""
    # an empty allow list would mean "everything", as in the server config
    out: dict[str, object] = {
        "pub": {"allow": list(p.publish) or ["_bcd_nothing_"]},
        "sub": {"allow": list(p.subscribe) or ["_bcd_nothing_"]},
    }
    if p.allow_responses:
        out["resp"] = dict(_ALLOW_RESPONSES)
    return out


def user_jwt(account_seed: bytes, user: str, name: str, permissions: Permissions | None) -> str:
    """User JWT signed by its account; `permissions` None: unrestricted."""
    nats: dict[str, object] = {
        **(user_permissions(permissions) if permissions is not None else {"pub": {}, "sub": {}}),
        "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT,
        "type": "user", "version": VERSION,
    }
    return encode(account_seed, user, name, nats)


def format_user_creds(jwt: str, seed: bytes) -> str:
    """A `.creds` file as `nsc generate creds` writes it."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n"
        "\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n"
        "\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed.decode()}\n"
        "------END USER NKEY SEED------\n"
        "\n"
        "*************************************************************\n"
    )


def write_user_creds(path: Path, jwt: str, seed: bytes) -> Path:
    """Write a `.creds` file with mode 0600 (atomically, like the project's secrets)."""
    from bcd.nodebus import write_private

    write_private(path, format_user_creds(jwt, seed))
    return path


def operator_server_config(
    *, store_dir: Path, operator: str, system_account: str, accounts: dict[str, str], host: str = "127.0.0.1", port: int = -1
) -> dict[str, object]:
    """nats-server config (JSON) for operator mode with the memory resolver.

    `operator` is the operator JWT inline (nats-server takes a JWT or a file
    path there); `accounts` maps account public key -> account JWT and must
    include the system account.
    """
    return {
        "host": host,
        "port": port,
        "jetstream": {"store_dir": str(store_dir), "sync_interval": "always"},
        "operator": operator,
        "system_account": system_account,
        "resolver": "MEMORY",
        "resolver_preload": dict(accounts),
    }
