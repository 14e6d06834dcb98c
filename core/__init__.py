"""croupier's pure core, shared by coordinator and client: spec, orders, plans, checkpoint state, errors, wire.

Nothing here opens a socket or a file: ``import croupier.core`` loads neither grpc nor sqlite3
(torch only when the ``torch`` permutation is used).
"""

from croupier.core.checkpoint import from_state, to_state
from croupier.core.order import Cursor, Plan, fresh, order, plan
from croupier.core.spec import ORDER_VERSION, Spec

__all__ = ["ORDER_VERSION", "Cursor", "Plan", "Spec", "fresh", "from_state", "order", "plan", "to_state"]
