"""The ``dxpool`` command for datacenter operators (kubectl-shaped, built on click and rich).

``dxpool.cli.main:main`` is the console script; :mod:`dxpool.cli.config` resolves the broker
endpoint for the CLI and for :class:`dxpool.client.Client` alike.
"""
