"""dxpool.hostagent."""
