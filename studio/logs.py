"""structlog set-up: readable console lines by default, JSON lines on request, and the studio's own log file.

A studio that runs (``serve``, ``run``) also writes its log to ``<home>/studio.log`` as JSON lines,
size-bounded (``LOG_FILE_BYTES``, then rotated, ``LOG_FILE_BACKUPS`` old files kept), so a GUI user can
attach it to a bug report; ``ggstudio doctor`` says where it is. Both go through one stdlib logger
(``ggstudio``) that does not propagate: other libraries' loggers are left as they are.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

import structlog

#: The studio's log file in its home.
LOG_FILE_NAME = "studio.log"
#: Bytes of one log file before it is rotated, and how many rotated files are kept (studio.log.1, ...).
LOG_FILE_BYTES = 5 * 1024 * 1024
LOG_FILE_BACKUPS = 3

_LOGGER = "ggstudio"


def _drop_none(logger: object, method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """Leave out the fields that hold ``None``: a state change without a cause reads ``old=loading new=ready``,
    not ``cause=None error=None`` (every caller would otherwise have to leave its empty fields out itself)."""
    return {k: v for k, v in event.items() if v is not None}


def log_file(home: Path) -> Path:
    """Return where the studio running in ``home`` writes its log."""
    return home / LOG_FILE_NAME


def configure_logging(
    *, json_lines: bool = False, level: int = logging.INFO, file: Path | None = None, file_level: int = logging.INFO
) -> bool:
    """Route structlog to stderr as console or JSON lines at ``level``, and to ``file`` (rotated) at ``file_level``.

    Returns whether the file is in use (False when it cannot be opened: a read-only home logs to
    the console only, and the command that needs the home says why).
    """
    shared: list[structlog.typing.Processor] = [
        _drop_none,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    console_renderer = (
        structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    console.setFormatter(structlog.stdlib.ProcessorFormatter(processor=console_renderer, foreign_pre_chain=shared))
    handlers: list[logging.Handler] = [console]
    in_use = False
    if file is not None:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            to_file = logging.handlers.RotatingFileHandler(
                file, maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS, encoding="utf-8"
            )
        except OSError:
            pass
        else:
            to_file.setLevel(file_level)
            as_json = structlog.processors.JSONRenderer()
            to_file.setFormatter(structlog.stdlib.ProcessorFormatter(processor=as_json, foreign_pre_chain=shared))
            handlers.append(to_file)
            in_use = True
    logger = logging.getLogger(_LOGGER)
    for old in logger.handlers:
        logger.removeHandler(old)
        old.close()
    for handler in handlers:
        logger.addHandler(handler)
    logger.setLevel(min(h.level for h in handlers))
    logger.propagate = False
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(logger.level),
        logger_factory=lambda *args: logger,
        cache_logger_on_first_use=True,
    )
    return in_use
