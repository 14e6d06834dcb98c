"""croupier's pure core, shared by coordinator and client: spec, cursors, orders, plans, checkpoint state, errors, wire.

Nothing here opens a socket or a file: ``import croupier.core`` loads neither grpc nor sqlite3
(torch only when the ``torch`` permutation is used).
"""

from croupier.core.checkpoint import from_state, to_state
from croupier.core.cursor import Cursor, fresh
from croupier.core.order import FixedPlan, fixed_plan, order
from croupier.core.plan import EpochPlan, Grant
from croupier.core.registry import KINDS, PlanKind, kind_of, plan_epoch
from croupier.core.spec import ORDER_VERSION, Spec

__all__ = ["KINDS", "ORDER_VERSION", "Cursor", "EpochPlan", "FixedPlan", "Grant", "PlanKind", "Spec", "fixed_plan", "fresh",
           "from_state", "kind_of", "order", "plan_epoch", "to_state"]
