"""bcd code shared by every service: wire schemas, subjects, signing, the bus runtime."""

from . import lazynats as _lazynats

_lazynats.install()  # nats without aiohttp until a ws:// URL needs it (shared/lazynats.py)
