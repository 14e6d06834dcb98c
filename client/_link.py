"""A sampler's connection to its job's coordinator (`Link`): agreed with the other ranks, opened at the join."""

from __future__ import annotations

import copy
import dataclasses
import warnings

from croupier.client._resolve import agree
from croupier.client._rpc import CoordinatorClient, Security


def given_incarnation(incarnation: str | None, token: str | None) -> str | None:
    """The incarnation a sampler was given: `incarnation`, else the deprecated `token` (with a warning).

    Raises:
        TypeError: both are given.
    """
    if token is None:
        return incarnation
    if incarnation is not None:
        raise TypeError(f"incarnation={incarnation!r} and token={token!r}: token= is the old name of incarnation=; "
                        "give incarnation= alone")
    warnings.warn("token= is deprecated: give incarnation= (the same value)", DeprecationWarning, stacklevel=3)
    return token


class Link:
    """Which coordinator a sampler talks to, as whom, and its open connection.

    The incarnation, the address and the embedded coordinator's secret are agreed with the
    other ranks of the world before the join (the same on every rank); a copy of the sampler
    (pickle, deepcopy) carries them, not the connection, and opens it again when it is needed.

    Args:
        address: The coordinator's address given (None: the environment's, else an embedded one).
        incarnation: The incarnation given (None: the launcher's).
        security: The TLS and credential settings given (None: from the environment).

    Attributes:
        client: The open connection, once the sampler joined (None before, and in a copy until reopened).
        incarnation: The incarnation the sampler joined as ("" before the join).
    """

    def __init__(self, address: str | None, incarnation: str | None, security: Security | None) -> None:
        self._address, self._incarnation, self._security = address, incarnation, security
        self._agreed: tuple[str, str, str | None] | None = None  # (incarnation, address, secret) agreed before the join
        self._security_used: Security | None = None
        self._address_used = ""  # the coordinator joined, to reconnect after a copy
        self.client: CoordinatorClient | None = None
        self.incarnation = ""

    def for_records(self, job: str, num_replicas: int) -> CoordinatorClient:
        """A connection, before the join, to read the job's checkpoint records (the join then uses the same agreement)."""
        self._agreed = agree(self._incarnation, self._address, job, num_replicas)
        return CoordinatorClient(self._agreed[1], security=self._with_secret(self._agreed[2]))

    def open(self, job: str, num_replicas: int) -> tuple[CoordinatorClient, str]:
        """Opens the connection the join goes through: the client and the incarnation it joins as."""
        incarnation, address, secret = self._agreed or agree(self._incarnation, self._address, job, num_replicas)
        self._security_used = self._with_secret(secret)
        self.client = CoordinatorClient(address, security=self._security_used)
        self._address_used, self.incarnation = address, incarnation
        return self.client, incarnation

    def reopen(self) -> CoordinatorClient:
        """Opens the connection again to the coordinator joined (in a copy of a joined sampler)."""
        self.client = CoordinatorClient(self._address_used, security=self._security_used)
        return self.client

    def connected(self) -> CoordinatorClient | None:
        """The open connection; None before the join, or once closed."""
        return None if self.client is None or self.client.closed else self.client

    def for_copy(self) -> Link:
        """This link for a copy of the sampler: what was agreed, without the connection."""
        c = copy.copy(self)
        c.client = None
        return c

    def close(self) -> None:
        """Closes the connection, if open."""
        if self.client is not None:
            self.client.close()

    def _with_secret(self, secret: str | None) -> Security:
        """The TLS and credential settings; the embedded coordinator's secret as the credential."""
        base = self._security if self._security is not None else Security.from_env()
        return dataclasses.replace(base, credential=secret) if secret else base
