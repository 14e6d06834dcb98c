"""croupier's client side. The `DistributedSampler` drop-in is not built yet; this package is a placeholder."""

__all__: list[str] = []
