"""statestamp.py: a state dir says which bcd wrote it; an older bcd refuses a newer state in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.statestamp import STAMP_NAME, STATE_FORMAT, Stamp, StateTooNew, check_and_stamp, check_tree, read_stamp, too_new

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("stamp", "ours", "refused"),
    [
        (None, 2, False),  # nothing to do: a new dir, or one from before the stamp
        (Stamp(format=2, written_by="bcd 0.1.0"), 2, False),
        (Stamp(format=1, written_by="bcd 0.0.9"), 2, False),  # an upgrade
        (Stamp(format=3, written_by="bcd 0.2.0"), 2, True),  # a downgrade
    ],
)
def test_too_new(stamp, ours, refused, tmp_path):
    why = too_new(stamp, tmp_path, version="0.1.0", ours=ours)
    assert bool(why) == refused
    if refused:
        assert "\n" not in why and "bcd 0.2.0" in why and "format 3" in why and "reads format 2 at most" in why


def test_a_bcd_stamps_its_state_and_an_older_one_refuses_it(tmp_path):
    d = tmp_path / "converger"
    check_and_stamp(d, version="0.1.0")
    first = read_stamp(d)
    assert first is not None and first.format == STATE_FORMAT and first.written_by == "bcd 0.1.0" and first.since
    assert (d / STAMP_NAME).stat().st_mode & 0o777 == 0o644
    # a newer one upgrades the stamp ...
    check_and_stamp(d, version="0.2.0", ours=STATE_FORMAT + 1)
    assert read_stamp(d) == Stamp(format=STATE_FORMAT + 1, written_by="bcd 0.2.0", since=read_stamp(d).since)
    # ... and this one no longer runs there, and writes nothing
    before = (d / STAMP_NAME).read_bytes()
    with pytest.raises(StateTooNew, match="written by bcd 0.2.0"):
        check_and_stamp(d, version="0.1.0")
    assert (d / STAMP_NAME).read_bytes() == before
    assert "written by bcd 0.2.0" in check_tree(tmp_path, version="0.1.0")
    assert check_tree(tmp_path, version="0.2.0", ours=STATE_FORMAT + 1) == ""


@pytest.mark.parametrize("kind", ["garbage", "huge", "fifo", "symlink", "dir", "zero"])
def test_a_stamp_that_is_not_one_is_refused_in_one_line_and_never_read_through(tmp_path, kind):
    d = tmp_path / "inventory"
    d.mkdir()
    p = d / STAMP_NAME
    if kind == "garbage":
        p.write_bytes(os.urandom(64))
    elif kind == "huge":
        p.write_text(json.dumps({"format": 2, "written_by": "x" * 10000}))
    elif kind == "fifo":
        os.mkfifo(p)  # never opened for a blocking read
    elif kind == "symlink":
        (tmp_path / "elsewhere.json").write_text('{"format": 2}')
        p.symlink_to(tmp_path / "elsewhere.json")
    elif kind == "dir":
        p.mkdir()
    else:
        p.write_text('{"format": 0}')
    with pytest.raises(StateTooNew) as exc:
        check_and_stamp(d, version="0.1.0")
    assert "\n" not in str(exc.value) and STAMP_NAME in str(exc.value)


def test_a_service_on_a_newer_state_exits_2_with_one_line(tmp_path):
    """The real service entry point (the signer: the first to start), on a stamp one format ahead."""
    d = tmp_path / "data" / "signer"
    d.mkdir(parents=True)
    (d / STAMP_NAME).write_text(json.dumps({"format": STATE_FORMAT + 1, "written_by": "bcd 9.9.9"}))
    env = {**os.environ, "BCD_DATA_DIR": str(tmp_path / "data"), "BCD_NODE_ID": "node-1", "BCD_NATS_URL": "nats://127.0.0.1:1", "BCD_LOG_FORMAT": "json"}
    out = subprocess.run([sys.executable, "-m", "services.signer"], env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    refusals = [line for line in lines if line["msg"] == "cannot start"]
    assert len(refusals) == 1 and "written by bcd 9.9.9" in refusals[0]["reason"], out.stderr
    assert not (d / "node.key").exists()  # nothing was touched
