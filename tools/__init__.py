"""croupier's product commands: the ``croupier`` command line, status, audit, provenance, amendments, data."""
