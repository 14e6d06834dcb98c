"""croupier's demos: stories told on real processes (``croupier demo``, ``croupier infer-demo``) and the pieces they run."""
