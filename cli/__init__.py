"""The ``dxpool`` command for datacenter operators (kubectl-shaped, built on click and rich).

``dxpool.cli.main:main`` is the console script. The broker endpoint is resolved by
:mod:`dxpool.config`, which the CLI and :class:`dxpool.client.Client` share.
"""
