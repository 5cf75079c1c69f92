"""Logging for every `epd` process: plain text lines, or JSON lines
(`--log-format json`, `EPD_LOG_FORMAT`) that a log collector parses. A record
may carry `extra={"fields": {...}}`: JSON lines hold them as keys."""

from __future__ import annotations

import json
import logging
from typing import Any

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str, form: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if form == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
