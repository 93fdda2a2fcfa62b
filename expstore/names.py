"""Names that clients and operators choose and that become parts of paths, object keys,
dataset URIs and stats keys: one rule for each kind, checked here and nowhere else.

- a table name is the RocksDB meta key ``table/<name>``, the remote datasets
  ``tables/<name>.lance`` and ``tables/<name>.archive.lance``, and a query's table name;
- a checkpoint name is the directory ``<data>/checkpoints/<name>.*`` and the remote
  prefix ``checkpoints/<name>/``;
- a consumer group name is the stats key ``group.<name>.<counter>`` and a metrics label.

Every name is matched whole (``re.fullmatch``: a ``$`` would also accept a trailing
newline), starts with a letter, digit or underscore (so never ``.``, ``..``, a hidden
file or something that reads as a command-line flag) and has at most 128 characters of
``[A-Za-z0-9_.-]`` (no path separator). A table name may not end in a suffix the server
gives to a dataset of its own (``.archive``: the archive of table ``x`` is the dataset
``x.archive``).
"""

from __future__ import annotations

import re

from .archive import ARCHIVE_SUFFIX
from .errors import InvalidArgument

_CHARS = r"[A-Za-z0-9_.-]{0,127}"
TABLE = re.compile(r"[A-Za-z_]" + _CHARS)        # no leading digit: tables are SQL names too
CHECKPOINT = re.compile(r"[A-Za-z0-9_]" + _CHARS)
CONSUMER_GROUP = CHECKPOINT
RESERVED_TABLE_SUFFIXES = (ARCHIVE_SUFFIX,)


def _check(kind: str, name: object, pattern: re.Pattern, first: str) -> str:
    if not isinstance(name, str) or pattern.fullmatch(name) is None:
        raise InvalidArgument(f"{kind} name {name!r} is not allowed: it must be 1-128 characters "
                              f"of A-Z a-z 0-9 _ . - starting with {first}")
    return name


def check_table(name: object) -> str:
    _check("table", name, TABLE, "a letter or _")
    for suffix in RESERVED_TABLE_SUFFIXES:
        if name.endswith(suffix):
            raise InvalidArgument(f"table name {name!r} is not allowed: the suffix {suffix!r} is reserved "
                                  f"(table {name[:-len(suffix)]!r} keeps its archive under that name)")
    return name


def check_checkpoint(name: object) -> str:
    return _check("checkpoint", name, CHECKPOINT, "a letter, digit or _")


def check_consumer_group(name: object) -> str:
    return _check("consumer group", name, CONSUMER_GROUP, "a letter, digit or _")
