"""bcd command line: the supervisor (`bcd up`), the embedded node bus and operator commands."""

from shared import lazynats as _lazynats

_lazynats.install()  # nats without aiohttp until a ws:// URL needs it (shared/lazynats.py)
