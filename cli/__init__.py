"""dxpool.cli."""
