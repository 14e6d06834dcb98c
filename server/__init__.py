"""croupier's coordinator: the state machine behind a journal, its stores, and the gRPC service."""

from croupier.server._auth import Authorizer
from croupier.server._coordinator import Coordinator
from croupier.server._logs import JsonFormatter, TextFormatter, configure_logging
from croupier.server._options import ServerOptions
from croupier.server._service import Server, serve
from croupier.server._store import Store, StoreCorrupt, StoreError, StoreUnavailable, open_store

__all__ = [
    "Authorizer", "Coordinator", "JsonFormatter", "Server", "ServerOptions", "Store", "StoreCorrupt", "StoreError",
    "StoreUnavailable", "TextFormatter", "configure_logging", "open_store", "serve",
]
