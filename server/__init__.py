"""croupier's coordinator: the state machine behind a journal, its stores, and the gRPC service."""

from croupier.server._auth import Authorizer
from croupier.server._coordinator import Coordinator
from croupier.server._logs import JsonFormatter, TextFormatter, configure_logging
from croupier.server._options import ServerOptions
from croupier.server._service import Server, serve
from croupier.server._state import (
    BatchesCommitted,
    BatchesDealt,
    GenerationOpened,
    GenerationStarted,
    RankJoined,
    State,
    decode_event,
)
from croupier.server._store import Store, StoreCorrupt, StoreError, StoreUnavailable, redact_url
from croupier.server._stores import open_store

__all__ = [
    "Authorizer", "BatchesCommitted", "BatchesDealt", "configure_logging", "Coordinator", "decode_event",
    "GenerationOpened", "GenerationStarted", "JsonFormatter", "open_store", "RankJoined", "redact_url", "serve",
    "Server", "ServerOptions", "State", "Store", "StoreCorrupt", "StoreError", "StoreUnavailable", "TextFormatter",
]
