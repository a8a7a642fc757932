"""The converger's journal on disk: `<data_dir>/converger/state.json` and `spec.json`.

Intent is recorded here (fsynced, boot id stamped) before any side effect of
a bind or release, and completion after its event is in the outbox; so a
kill -9 at any instant leaves enough to finish the operation exactly once.
The last accepted NodeSpec is kept beside it, so a restart converges to it
without waiting for the control plane: as the SignedNodeSpec it came in, and
verified again when read back. A file is not believed more than the bus: a
spec whose key was taken out of the configuration since, one an earlier
release kept bare (unsigned), or one written while unsigned specs were
accepted is not taken at start; the holds on disk stay as they are (no pass
runs without a spec) until the bridge hands over the control plane's spec
again, which it does at its next read (--resync-interval).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from shared import logs
from shared.fsutil import RefusedFile, atomic_write, read_regular
from shared.schemas import NODE_SPEC_CODEC, BadMessage, NodeSpec, SignedNodeSpec, encode
from shared.schemas.codec import BoundedDecoder
from shared.schemas.strict import unknown_fields_of_json
from shared.signing import VerificationError
from shared.spectrust import SpecTrust

from .model import ConvergerState

log = logs.get_logger("bcd.converger.state")
_STATE_DECODER = BoundedDecoder(ConvergerState, max_bytes=64 * 1024 * 1024, what="converger state")
#: caps on reading the journal back (far above what bcd writes: a NodeSpec is at most 1 MiB).
STATE_MAX_BYTES = 64 * 1024 * 1024
SPEC_MAX_BYTES = 4 * 1024 * 1024


class StateStore:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / "state.json"
        self.spec_path = self.dir / "spec.json"

    def load(self) -> ConvergerState:
        try:
            data = read_regular(self.path, max_bytes=STATE_MAX_BYTES)
            return _STATE_DECODER.decode(data)
        except FileNotFoundError:
            return ConvergerState()
        # not a regular file, or larger than any state bcd writes: set aside like garbage
        except (RefusedFile, msgspec.ValidationError, msgspec.DecodeError) as exc:
            # Kept for an operator; holds on disk are re-reported with their
            # deterministic ids, which upstream dedupes.
            aside = self.path.with_name(f"state.json.unreadable-{int(time.time())}")
            os.replace(self.path, aside)
            log.error("converger state unreadable; starting afresh", file=str(self.path), kept_as=str(aside), error=str(exc))
            return ConvergerState()

    def save(self, state: ConvergerState) -> None:
        atomic_write(self.path, encode(state), 0o600)

    def load_spec(self, trust: SpecTrust, node_id: str) -> NodeSpec | None:
        return self.load_spec_with_unknown(trust, node_id)[0]

    def load_spec_with_unknown(self, trust: SpecTrust, node_id: str) -> tuple[NodeSpec | None, list[str]]:
        """The stored spec if it verifies now, and the fields of it NodeSpec does not declare (as signed).

        None (logged, the file left where it is for an operator) when it does not
        read or does not verify against `trust` today.
        """
        try:
            data = read_regular(self.spec_path, max_bytes=SPEC_MAX_BYTES)
        except FileNotFoundError:
            return None, []
        except OSError as exc:
            log.error("stored spec unreadable; waiting for the next one", file=str(self.spec_path), error=str(exc))
            return None, []
        legacy = _bare_spec(data)
        if legacy and trust.accept_unsigned:
            # an earlier release kept the bare NodeSpec: as good as any unsigned spec, here
            data = encode(SignedNodeSpec(spec=data))
        try:
            signed, spec = trust.open(data, node_id)
        except VerificationError as exc:
            why = "kept bare (unsigned) by an earlier release" if legacy else str(exc)
            log.error(
                "stored spec not taken: it does not verify now; the holds on disk stay as they are until "
                "the bridge hands over the control plane's spec",
                file=str(self.spec_path),
                error=why,
            )
            return None, []
        return spec, [str(f) for f in unknown_fields_of_json(NodeSpec, signed.spec, SPEC_MAX_BYTES)]

    def save_spec(self, envelope: bytes) -> None:
        """The SignedNodeSpec JSON as received (its inner bytes carry the unknown fields as signed)."""
        atomic_write(self.spec_path, envelope, 0o600)


def _bare_spec(data: bytes) -> bool:
    """Is `data` a bare NodeSpec (what spec.json held before the converger verified specs itself)?"""
    try:
        NODE_SPEC_CODEC.decode(data)
    except BadMessage:
        return False
    return True


__all__ = ["StateStore"]
