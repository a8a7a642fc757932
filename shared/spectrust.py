"""Which NodeSpecs a node believes: the control-plane keys it checks them against, or the lab-only opt-out.

Two hops on a node take a spec - the gateway_bridge, where it arrives from
upstream, and the converger, which turns it into holds - and both decide the
same way from the same two options (DESIGN 3, "Command signing"):

- `--cp-key FILE[,FILE...]` (env `BCD_CP_KEY`): the control-plane public keys
  (PEM SubjectPublicKeyInfo, or the raw 32 bytes in base64); a spec must be a
  SignedNodeSpec signed by one of them, naming this node;
- `--accept-unsigned-specs` (env `BCD_ACCEPT_UNSIGNED_SPECS=1`): lab only, and
  only without keys: specs are taken unchecked, and the service says so where
  an operator looks - a WARNING at start, metric `bcd_unsigned_specs_accepted`
  1, `unsigned_specs: accepted` in its `$SRV.PING` metadata (`bcd doctor` warns).

With neither the service refuses to start (StartupError, one line): a node
that cannot tell the control plane's specs from anyone else's must not run.
With both it refuses too: a node with keys refuses unsigned specs, so the pair
says two contradicting things and neither is guessed. `SpecTrust.open` is the
one check both hops run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from shared.runtime import Option, StartupError
from shared.schemas import SIGNED_NODE_SPEC_CODEC, BadMessage, NodeSpec, SignedNodeSpec
from shared.signing import Ed25519PublicKey, VerificationError, key_id, load_public_key_file, verify_node_spec

CP_KEY_FLAG = "--cp-key"
ACCEPT_UNSIGNED_FLAG = "--accept-unsigned-specs"
ACCEPT_UNSIGNED_ENV = "BCD_ACCEPT_UNSIGNED_SPECS"

NO_KEY = (
    "no control-plane key: node specs cannot be verified. Give the control plane's public key "
    f"({CP_KEY_FLAG} FILE, env BCD_CP_KEY), or, in a lab only, accept unsigned specs knowingly "
    f"({ACCEPT_UNSIGNED_FLAG}, env {ACCEPT_UNSIGNED_ENV}=1)"
)
BOTH = (
    f"{CP_KEY_FLAG} and {ACCEPT_UNSIGNED_FLAG} (env {ACCEPT_UNSIGNED_ENV}) together: with a control-plane key "
    "unsigned specs are refused; drop one of the two"
)


def trust_options() -> list[Option]:
    """The two options, the same in every service that takes a spec."""
    return [
        Option(CP_KEY_FLAG, "control-plane public key files (PEM or base64 raw), comma-separated: every node spec must be signed by one", default=""),
        Option(
            ACCEPT_UNSIGNED_FLAG,
            "LAB ONLY, and only without --cp-key: take node specs unsigned (said at start, by `bcd doctor` and metric bcd_unsigned_specs_accepted)",
            switch=True,
        ),
    ]


@dataclass(frozen=True)
class SpecTrust:
    """The keys a spec must be signed with; `accept_unsigned` only ever without keys (load_trust)."""

    keys: tuple[Ed25519PublicKey, ...] = ()
    accept_unsigned: bool = False

    def open(self, data: bytes, node_id: str) -> tuple[SignedNodeSpec, NodeSpec]:
        """The SignedNodeSpec JSON `data` decoded, verified and naming `node_id`: the envelope and its spec.

        VerificationError says what is wrong (a body that does not decode, an
        unknown key, a bad signature, another node); nothing is believed before.
        """
        try:
            signed = SIGNED_NODE_SPEC_CODEC.decode(data)
        except BadMessage as exc:
            raise VerificationError(str(exc)) from None
        return signed, self.verify(signed, node_id)

    def verify(self, signed: SignedNodeSpec, node_id: str) -> NodeSpec:
        """The spec inside a decoded envelope, if signed by a configured key and naming `node_id`."""
        spec = verify_node_spec(signed, list(self.keys), accept_unsigned=self.accept_unsigned)
        if spec.node_id != node_id:
            raise VerificationError(f"the spec names node {spec.node_id}, this is {node_id}")
        return spec


def load_trust(cp_key: str, accept_unsigned: bool) -> SpecTrust:
    """The keys of `--cp-key` read, and the pair checked; StartupError (one line) when it cannot be run with."""
    keys: list[Ed25519PublicKey] = []
    for name in [p.strip() for p in str(cp_key).split(",") if p.strip()]:
        try:
            keys.append(load_public_key_file(Path(name)))
        except (OSError, ValueError) as exc:
            # a key file that does not read is never "no key": that would be unsigned by typo
            raise StartupError(f"{CP_KEY_FLAG} {name}: {exc}") from None
    if keys and accept_unsigned:
        raise StartupError(BOTH)
    if not keys and not accept_unsigned:
        raise StartupError(NO_KEY)
    return SpecTrust(tuple(keys), accept_unsigned)


def announce(trust: SpecTrust, *, metadata: dict[str, str], log: Any, registry: CollectorRegistry | None) -> None:
    """Say at start how specs are checked: the log, the PING metadata `bcd doctor` reads, the gauge.

    The gauge is made here, once for both services (one name, one meaning; each
    service's scrape adds its `service` label).
    """
    metadata["cp_keys"] = str(len(trust.keys))
    unsigned = Gauge("bcd_unsigned_specs_accepted", "1 when it takes unsigned node specs (--accept-unsigned-specs, lab only)", registry=registry)
    unsigned.set(1 if trust.accept_unsigned else 0)
    if trust.accept_unsigned:
        metadata["unsigned_specs"] = "accepted"
        log.warning(
            f"ACCEPTING UNSIGNED NODE SPECS ({ACCEPT_UNSIGNED_FLAG}, lab only): whoever can put this node's spec owns its holds",
            option=ACCEPT_UNSIGNED_FLAG,
        )
        return
    log.info("verifying node specs", keys=len(trust.keys), key_ids=[key_id(k) for k in trust.keys])


__all__ = [
    "ACCEPT_UNSIGNED_ENV",
    "ACCEPT_UNSIGNED_FLAG",
    "BOTH",
    "CP_KEY_FLAG",
    "NO_KEY",
    "SpecTrust",
    "announce",
    "load_trust",
    "trust_options",
]
