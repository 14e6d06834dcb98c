"""The store factory: opens the store a URL names, importing only that backend.

Kept apart from ``_store`` (the interface every backend imports), so that the backends and the
factory that imports them make no import cycle.
"""

from __future__ import annotations

from croupier.server._store import Store, StoreUnavailable, parse_url, redact_url

__all__ = ["open_store"]


def open_store(url: str) -> Store:
    """Opens the store a URL names; see :func:`parse_url` for the URL forms.

    The backend's module is imported here, so importing this module loads no backend (no
    ``sqlite3``, no ``psycopg``).

    Args:
        url: ``memory://``, ``sqlite:///PATH`` or ``postgresql://...``.

    Returns:
        The open, verified store.

    Raises:
        ValueError: If the URL is not one of the supported forms.
        StoreCorrupt: If the store's contents could not be verified.
        StoreVersionError: If the store was written with a newer schema.
        StoreUnavailable: If the store cannot be created, opened, locked or reached, or its
            backend's driver is not installed.
    """
    scheme, path = parse_url(url)
    if scheme == "memory":
        from croupier.server._memory_store import MemoryStore

        return MemoryStore(url)
    if scheme == "postgresql":
        try:
            from croupier.server._pg_store import PostgresStore
        except ImportError as exc:
            raise StoreUnavailable(
                f"store {redact_url(url)}: the PostgreSQL store needs psycopg 3 and psycopg_pool "
                f"(pip install 'croupier[postgres]'): {exc}"
            ) from exc

        return PostgresStore(url)
    from croupier.server._sqlite_store import SqliteStore

    return SqliteStore(url, path)
