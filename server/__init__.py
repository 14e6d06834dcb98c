"""croupier's coordinator: the state machine behind a journal, its stores, and the gRPC service."""

from croupier.server._auth import Authorizer
from croupier.server._coordinator import Coordinator
from croupier.server._events import BatchesCommitted, BatchesDealt, GenerationOpened, GenerationStarted, RankJoined
from croupier.server._journal import JournalRead, read_journal
from croupier.server._logs import JsonFormatter, TextFormatter, configure_logging
from croupier.server._options import ServerOptions
from croupier.server._service import Server, serve
from croupier.server._standing import GenerationDeals, JobView, RankView, generation_deals, job_view
from croupier.server._state import State
from croupier.server._store import Store, StoreCorrupt, StoreError, StoreUnavailable, redact_url
from croupier.server._stores import open_store

__all__ = [
    "Authorizer", "BatchesCommitted", "BatchesDealt", "configure_logging", "Coordinator", "GenerationDeals",
    "generation_deals", "GenerationOpened", "GenerationStarted", "job_view", "JobView", "JournalRead", "JsonFormatter",
    "open_store", "RankJoined", "RankView", "read_journal", "redact_url", "serve", "Server", "ServerOptions", "State",
    "Store", "StoreCorrupt", "StoreError", "StoreUnavailable", "TextFormatter",
]
