"""dxpool.fabric."""
