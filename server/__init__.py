"""croupier's coordinator side: the order engine, and (in later parts) the state machine and gRPC service."""

from croupier.server._order import Cursor, Plan, fresh, order, plan
from croupier.server._spec import Spec

__all__ = ["Cursor", "Plan", "Spec", "fresh", "order", "plan"]
