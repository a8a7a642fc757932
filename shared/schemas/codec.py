"""Encoders and decoders, built once per type (msgspec's asyncio-kv pattern).

`decode` is the boundary: it refuses an oversized message before parsing, and
turns every msgspec error into `BadMessage`, whose text names the field
(`$.devices[0].allocation_id`) so a sender can see what to fix.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

T = TypeVar("T")

#: default ceiling for one message; NATS' own default max_payload is 1 MiB.
DEFAULT_MAX_BYTES = 1024 * 1024

_encoder = msgspec.json.Encoder()


class BadMessage(ValueError):
    """A message that does not decode into its type; the text names the field."""


class Codec(Generic[T]):
    def __init__(self, type_: type[T], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.type = type_
        self.max_bytes = max_bytes
        self._decoder = msgspec.json.Decoder(type_)

    def decode(self, data: bytes | bytearray | memoryview | str) -> T:
        if isinstance(data, str):
            data = data.encode()
        if len(data) > self.max_bytes:
            raise BadMessage(
                f"message: {len(data)} bytes is larger than the {self.max_bytes}-byte limit "
                f"for {getattr(self.type, '__name__', self.type)}"
            )
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise BadMessage(str(exc)) from None
        except msgspec.DecodeError as exc:
            raise BadMessage(f"message: not valid JSON ({exc})") from None

    @staticmethod
    def encode(value: object) -> bytes:
        return _encoder.encode(value)


def encode(value: object) -> bytes:
    return _encoder.encode(value)


__all__ = ["BadMessage", "Codec", "DEFAULT_MAX_BYTES", "encode"]
