"""`shoal keys create|list|revoke`: manage API keys in the server's database.

The key itself is printed once, at creation; only its SHA-256 is stored.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

from shoal.server.auth import hash_api_key, new_api_key
from shoal.server.store import Store
from shoal.tuning import environment


def default_data_dir() -> Path:
    """Per-user data directory: the DATA_DIR environment setting, else $XDG_DATA_HOME/shoal, else
    ~/.local/share/shoal."""
    if environment("DATA_DIR"):
        return Path(environment("DATA_DIR")).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base).expanduser() / "shoal"


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """--data-dir and --database-url, shared with `shoal serve`."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        help="directory of the SQLite database and voice blobs (default %(default)s)",
    )
    parser.add_argument(
        "--database-url",
        default=environment("DATABASE_URL"),
        help="SQLAlchemy URL instead of the SQLite file, e.g. postgresql://...",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_storage_arguments(parser)
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a key and print it (shown only once)")
    create.add_argument("--tenant", default="default", help="account the key's voices belong to")
    create.add_argument("--name", default="", help="a label to recognise the key by")
    create.add_argument(
        "--priority",
        choices=("standard", "batch"),
        default="standard",
        help="scheduling class of its /v1/tts",
    )
    create.add_argument(
        "--max-streams", type=int, default=None, help="concurrent streams (default: server's)"
    )
    actions.add_parser("list", help="list keys (never the keys themselves)")
    revoke = actions.add_parser("revoke", help="revoke a key by its id (key_...)")
    revoke.add_argument("key_id")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """The action; what it prints goes to `out` (default: standard output)."""
    out = out or sys.stdout
    store = Store.in_directory(args.data_dir, args.database_url)
    try:
        if args.action == "create":
            key = new_api_key()
            row = store.add_key(
                hash_api_key(key),
                args.tenant,
                args.name,
                priority=args.priority,
                max_streams=args.max_streams,
            )
            print(f"id:     {row.id}\ntenant: {row.tenant}\nkey:    {key}", file=out)
            print("Store the key now: it cannot be shown again.", file=out)
            return 0
        if args.action == "list":
            print(
                f"{'id':22} {'tenant':16} {'priority':9} {'streams':7} {'created':20} {'status':8} name",
                file=out,
            )
            for row in store.list_keys():
                status = "revoked" if row.revoked_at else "active"
                streams = str(row.max_streams or "-")
                created = row.created_at.strftime("%Y-%m-%d %H:%M:%S")
                columns = (
                    f"{row.id:22}",
                    f"{row.tenant:16}",
                    f"{row.priority:9}",
                    f"{streams:7}",
                    f"{created:20}",
                )
                print(*columns, f"{status:8}", row.name, file=out)
            return 0
        if store.revoke_key(args.key_id):
            print(f"revoked {args.key_id}", file=out)
            return 0
        print(f"no active key with id {args.key_id}", file=out)
        return 1
    finally:
        store.close()
