"""The control plane of a refit: the authenticated control channel, the key-value store over it,
the version/ack scheme, and the groups of ranks a refit runs over (:class:`~.peers.Peers`,
:class:`~.refit_group.RefitGroup` across two jobs)."""
