"""Structured logging: one JSON object per line on stderr.

Every service logs through `get_logger(name).info("what happened", key=value)`,
so journald, `docker logs` and a log shipper all see the same fields.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any

_SERVICE = "bcd"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": _SERVICE,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        base = f"{record.levelname:<5} {_SERVICE} {record.getMessage()}"
        text = f"{base} {extra}" if extra else base
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class StructLogger:
    """A thin wrapper that turns keyword arguments into structured fields."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def _log(self, level: int, msg: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, msg, exc_info=exc_info, extra={"fields": fields}, stacklevel=3)

    def debug(self, msg: str, **fields: Any) -> None:
        self._log(logging.DEBUG, msg, False, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._log(logging.INFO, msg, False, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._log(logging.WARNING, msg, False, fields)

    def error(self, msg: str, **fields: Any) -> None:
        self._log(logging.ERROR, msg, False, fields)

    def exception(self, msg: str, **fields: Any) -> None:
        self._log(logging.ERROR, msg, True, fields)


def configure(service: str, level: str = "INFO", fmt: str = "json") -> None:
    global _SERVICE
    _SERVICE = service
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # nats-py logs reconnect chatter at INFO/ERROR through its own logger.
    logging.getLogger("nats").setLevel(logging.WARNING)


def get_logger(name: str) -> StructLogger:
    return StructLogger(logging.getLogger(name))


__all__ = ["JsonFormatter", "TextFormatter", "StructLogger", "configure", "get_logger"]
