"""croupier's tools: the ``croupier`` command line, the audit, the demo and the chaos run."""
