"""dxpool.broker."""
