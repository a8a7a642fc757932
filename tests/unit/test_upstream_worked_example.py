"""docs/upstream.md section 9 agrees with the code: its signatures verify, the spec decodes,
and the Bound's cgroup_parent is the slice name bcd gives `train-01` today."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from shared.signing import Ed25519PrivateKey

from shared.schemas import ATTESTED_REPORT_CODEC, NODE_SPEC_CODEC, SIGNED_NODE_SPEC_CODEC
from shared.signing import key_id, load_public_key, verify_node_spec, verify_report
from shared.slices import slice_name

DOC = Path(__file__).resolve().parents[2] / "docs" / "upstream.md"


def example_blocks() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## 9. Worked example"):]
    return re.findall(r"```(?:json)?\n(.*?)```", section, flags=re.S)


def test_the_worked_example_verifies_and_names_todays_slice() -> None:
    blocks = example_blocks()
    pem, raw = blocks[0].encode(), blocks[1].strip()
    cp = Ed25519PrivateKey(bytes(range(32)))
    node = Ed25519PrivateKey(bytes(range(0x20, 0x40)))
    assert key_id(load_public_key(pem)) == key_id(load_public_key(raw.encode())) == key_id(cp) == "56475aa75463474c"
    spec_bytes = blocks[2].strip().encode()
    spec = NODE_SPEC_CODEC.decode(spec_bytes)
    signed = SIGNED_NODE_SPEC_CODEC.decode(blocks[3].encode())
    assert signed.spec == spec_bytes
    assert verify_node_spec(signed, [load_public_key(pem)]) == spec
    hello = json.loads(blocks[4])
    assert hello["key_id"] == key_id(node)
    body = blocks[5].strip().encode()
    report = ATTESTED_REPORT_CODEC.decode(blocks[6].encode())
    assert report.body == body
    verified = verify_report(report, base64.b64decode(hello["public_key"]))
    assert verified.event.cgroup_parent == slice_name("train-01") == "bcd-alloc-train.01.slice"
    assert "\\" not in verified.event.cgroup_parent
