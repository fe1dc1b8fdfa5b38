"""etcd access shared by the broker and the host agent: key schema, client, embedded server."""
