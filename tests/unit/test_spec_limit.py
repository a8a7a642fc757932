"""One limit for a spec's size (issue 41.6): controlplane.specs.spec_limit/check_fits against the
envelope a put really signs and sends, byte for byte, for the dry run and the put alike."""

from __future__ import annotations

import json

import pytest

from controlplane.specs import SpecTooLarge, check_fits, check_spec, signed_bytes, signed_size, spec_limit
from shared.schemas import BadMessage, encode
from shared.schemas.codec import DEFAULT_MAX_BYTES
from shared.schemas.common import INT64_MAX
from shared.signing import Ed25519PrivateKey, sign_node_spec


def _checked(pad: int, **extra: object):
    doc = {"node_id": "node-1", "devices": [{"allocation_id": "a", "reservation_id": "rsv-a", "binding": "BINDING_HOLD", "env": [f"PAD=x{'y' * pad}"]}], **extra}
    return check_spec(json.dumps(doc), allow_unknown_fields=bool(extra))


@pytest.mark.parametrize("max_payload", [4096, 64 * 1024, 1024 * 1024])
@pytest.mark.parametrize("unknown", [False, True], ids=["known-fields", "unknown-fields-as-given"])
def test_check_fits_says_yes_exactly_when_the_real_envelope_fits(max_payload: int, unknown: bool) -> None:
    key = Ed25519PrivateKey.generate()
    extra = {"newer_field": 1} if unknown else {}
    base = len(signed_bytes(_checked(0, **extra), INT64_MAX))
    limit = spec_limit(max_payload)
    for size in (limit - 2, limit - 1, limit, limit + 1, limit + 2):
        pad = size - base
        if pad < 0 or pad > 4095:
            continue
        checked = _checked(pad, **extra)
        real = len(encode(sign_node_spec(key, signed_bytes(checked, INT64_MAX))))
        assert real == signed_size(size)
        if real <= max_payload:
            check_fits(checked, max_payload)
        else:
            with pytest.raises(SpecTooLarge, match=f"above the {limit} bytes a spec may be here"):
                check_fits(checked, max_payload)
    assert signed_size(limit) <= max_payload < signed_size(limit + 1)


def test_the_limit_is_never_above_what_the_node_decodes() -> None:
    assert spec_limit(64 * 1024 * 1024) == DEFAULT_MAX_BYTES
    assert spec_limit(10) == 0
    assert issubclass(SpecTooLarge, BadMessage)  # an input error: bcd apply exits 2


def test_the_answer_does_not_depend_on_the_generation_a_put_takes() -> None:
    """Measured at the widest generation: a spec that fits at generation 1 fits at any."""
    checked = _checked(100)
    assert len(signed_bytes(checked, 1)) < len(signed_bytes(checked, INT64_MAX))
    limit_payload = signed_size(len(signed_bytes(checked, 1)))  # fits at generation 1 only
    with pytest.raises(SpecTooLarge):
        check_fits(checked, limit_payload)
