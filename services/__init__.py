"""bcd's services: one package and one OS process each, talking over the node bus."""

from shared import lazynats as _lazynats

_lazynats.install()  # nats without aiohttp until a ws:// URL needs it (shared/lazynats.py)
