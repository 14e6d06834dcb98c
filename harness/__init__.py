"""croupier's test harness: faults injected into a real job (``croupier chaos``), and checkers of what it left."""
