"""Rank-aware logging for training scripts: who said it, and only once unless it matters.

- :class:`RankLoggerAdapter` prefixes every message with
  ``[run=<id> node=<node rank> rank=<rank>/<world size> restart=<count>]``. It
  passes debug and info records on rank 0 only (``all_ranks=True`` for all),
  warnings and errors from every rank.
- :func:`setup_logging` installs a handler for a worker process (text or JSON
  lines). Records that did not come through an adapter (e.g. elastictrain's
  own module loggers) get the same prefix and rank policy from its filter.

(The launcher's own handler setup is ``elastictrain.launch._logging``; this module is
for the worker side.)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import weakref
from collections.abc import MutableMapping
from typing import Any, TextIO

from elastictrain.train.worker import WorkerContext

__all__ = ["JSON_ENV", "PREFIXED_LINES_ENV", "RankLoggerAdapter", "follow_context", "format_prefix", "get_logger",
           "setup_logging", "terminal_is_prefixed"]

JSON_ENV = "ELASTICTRAIN_LOG_JSON"
"""Set to ``1`` to make :func:`setup_logging` (and the session's automatic set-up) write JSON lines."""

PREFIXED_LINES_ENV = "ELASTICTRAIN_PREFIXED_LINES"
"""``1`` in a worker whose stderr the launcher prefixes with ``[node rank]`` (set by the worker's
boot): a log line there needs no ``[run= node= rank=]`` of its own."""

_VERBOSE_ENV = "ELASTICTRAIN_VERBOSE"  # run -v: the long prefix everywhere
_LEVEL_ENV = "ELASTICTRAIN_LOG_LEVEL"
_EVENTS = "elastictrain.events"
_ATTR = "elastictrain"  # record attribute: the context fields, and whether the message is prefixed


def format_prefix(context: WorkerContext) -> str:
    """``[run=<id> node=<n> rank=<r>/<w> restart=<k>]`` for ``context``."""
    return (f"[run={context.run_id} node={context.node_rank} rank={context.rank}/{context.world_size} "
            f"restart={context.restart_count}]")


def _fields(context: WorkerContext) -> dict[str, Any]:
    return {"run_id": context.run_id, "node": context.node_rank, "rank": context.rank,
            "world_size": context.world_size, "restart": context.restart_count}


def _rank_passes(context: WorkerContext, level: int, all_ranks: bool) -> bool:
    return all_ranks or context.rank == 0 or level >= logging.WARNING


class RankLoggerAdapter(logging.LoggerAdapter):
    """A logger that says which worker is talking, and keeps info to rank 0.

    Args:
        logger: The logger to write to.
        context: This worker; default :meth:`WorkerContext.from_env`.
        all_ranks: Pass debug/info records on every rank, not only rank 0.
    """

    def __init__(self, logger: logging.Logger, context: WorkerContext | None = None, *,
                 all_ranks: bool = False) -> None:
        self.context = WorkerContext.from_env() if context is None else context
        self.all_ranks = all_ranks
        self.prefix = format_prefix(self.context)
        super().__init__(logger, _fields(self.context))

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging's name
        """See base class; also False for info and below on ranks other than 0."""
        return _rank_passes(self.context, level, self.all_ranks) and self.logger.isEnabledFor(level)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        """See base class. Adds the context as ``record.elastictrain`` (merged into ``extra``)."""
        extra = dict(kwargs.get("extra") or {})
        extra[_ATTR] = {**_fields(self.context), "prefixed": True, "prefix": self.prefix}
        kwargs["extra"] = extra
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """See base class. Prefixes the message."""
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        # The prefix joins the format string: escape its '%' when there are args to format.
        prefix = self.prefix.replace("%", "%%") if args else self.prefix
        # One more frame (this method) between the caller and logging.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        self.logger.log(level, f"{prefix} {msg}", *args, **kwargs)


def get_logger(name: str, context: WorkerContext | None = None, *, all_ranks: bool = False) -> RankLoggerAdapter:
    """A :class:`RankLoggerAdapter` over ``logging.getLogger(name)``.

    Example::

        log = elastictrain.get_logger(__name__)
        log.info("epoch %d", epoch)          # rank 0 only
        log.warning("slow batch on this rank")  # every rank
    """
    return RankLoggerAdapter(logging.getLogger(name), context, all_ranks=all_ranks)


class _RankFilter(logging.Filter):
    """Gives records that bypassed the adapter the same context and rank policy.

    In text mode it drops ``elastictrain.events`` records: they repeat, for
    machines, what a module logger already said in words.
    """

    def __init__(self, context: WorkerContext, all_ranks: bool, json_lines: bool) -> None:
        super().__init__()
        self._all_ranks, self._json = all_ranks, json_lines
        self.follow(context)

    def follow(self, context: WorkerContext) -> None:
        """Tag records with ``context`` from now on."""
        self._context, self._prefix = context, format_prefix(context)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._json and record.name == _EVENTS:
            return False
        if hasattr(record, _ATTR):
            return True
        if not _rank_passes(self._context, record.levelno, self._all_ranks):
            return False
        setattr(record, _ATTR, {**_fields(self._context), "prefixed": False, "prefix": self._prefix})
        return True


_installed: weakref.WeakSet[_RankFilter] = weakref.WeakSet()
"""The filters :func:`setup_logging` installed in this process (see :func:`follow_context`)."""


def follow_context(context: WorkerContext) -> None:
    """Make the handlers :func:`setup_logging` installed tag records with ``context``: the
    worker's rank and world size once an in-process recovery re-formed its group."""
    for rank_filter in list(_installed):
        rank_filter.follow(context)


def terminal_is_prefixed() -> bool:
    """Whether this worker's stderr lines already start with ``[node rank]`` and ``-v`` did
    not ask for everything: the session's own log lines are then brief (see ``setup_logging``)."""
    def on(name: str) -> bool:
        return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")

    return on(PREFIXED_LINES_ENV) and not on(_VERBOSE_ENV)


class _Formatter(logging.Formatter):
    """Text (``time level name: [prefix] message``), brief text (``time message``; level and
    logger from WARNING up) or one JSON object per line."""

    def __init__(self, json_lines: bool, brief: bool = False) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        self._json = json_lines
        self._brief = brief and not json_lines

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        """See base class. Prefixes records that did not come through an adapter."""
        info = getattr(record, _ATTR, None)
        if self._brief:
            message = record.message
            if info is not None and info["prefixed"] and message.startswith(info["prefix"]):
                message = message[len(info["prefix"]):].lstrip()
            if record.levelno < logging.WARNING:
                return f"{record.asctime} {message}"
            return f"{record.asctime} {record.levelname} {record.name}: {message}"
        if info is None or info["prefixed"]:
            return super().formatMessage(record)
        values = {**record.__dict__, "message": f"{info['prefix']} {record.message}"}
        return self._fmt % values  # type: ignore[operator]  # our own %-style format

    def format(self, record: logging.LogRecord) -> str:
        """See base class."""
        if not self._json:
            return super().format(record)
        info = getattr(record, _ATTR, None)
        message = record.getMessage()
        if info is not None and info["prefixed"] and message.startswith(info["prefix"]):
            message = message[len(info["prefix"]):].lstrip()
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        if info is not None:
            out.update({k: v for k, v in info.items() if k not in ("prefixed", "prefix")})
        event = getattr(record, "elastictrain_event", None)
        if isinstance(event, dict):
            out["event"] = event
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(
    context: WorkerContext | None = None,
    *,
    level: int | str | None = None,
    json_lines: bool | None = None,
    logger: str = "",
    stream: TextIO | None = None,
    all_ranks: bool = False,
    brief: bool | None = None,
) -> logging.Handler:
    """Install a rank-aware handler in this worker process.

    Replaces the handlers of ``logger`` (default the root logger, so the
    script's own loggers show too) with one writing to ``stream``.

    Args:
        context: This worker; default :meth:`WorkerContext.from_env`.
        level: Level of ``logger``; default ``ELASTICTRAIN_LOG_LEVEL``, else ``INFO``.
        json_lines: One JSON object per line (time, level, logger, message,
            run_id, node, rank, world_size, restart); default ``ELASTICTRAIN_LOG_JSON``.
        logger: Name of the logger to configure (``""``: root).
        stream: Where to write; default ``sys.stderr``.
        all_ranks: Pass info records from every rank, not only rank 0.
        brief: Text lines as ``time message`` (level and logger from WARNING up), no
            ``[run= node= rank=]``: for a stream whose lines the launcher already starts with
            ``[node rank]``. Default: :func:`terminal_is_prefixed` (brief under ``elastictrain
            run`` unless ``-v``; the full prefix under other launchers).

    Returns:
        The installed handler.
    """
    context = WorkerContext.from_env() if context is None else context
    if level is None:
        level = os.environ.get(_LEVEL_ENV, "INFO")
    if isinstance(level, str):
        level = logging.getLevelName(level.strip().upper())
        if not isinstance(level, int):
            level = logging.INFO
    if json_lines is None:
        json_lines = os.environ.get(JSON_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if brief is None:
        brief = terminal_is_prefixed()
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    rank_filter = _RankFilter(context, all_ranks, json_lines)
    _installed.add(rank_filter)
    handler.addFilter(rank_filter)
    handler.setFormatter(_Formatter(json_lines, brief))
    target = logging.getLogger(logger)
    target.handlers[:] = [handler]
    target.setLevel(level)
    return handler
