"""etcd access: the client front (failover, retries) and a private etcd server."""

from elastictrain.etcd.client import (
    Endpoint,
    EtcdClient,
    EtcdSettings,
    connect,
    import_etcd3,
    parse_endpoints,
)
from elastictrain.etcd.server import EtcdServer, EtcdServerOptions, find_etcd_binary, free_port

__all__ = [
    "Endpoint",
    "EtcdClient",
    "EtcdServer",
    "EtcdServerOptions",
    "EtcdSettings",
    "connect",
    "find_etcd_binary",
    "free_port",
    "import_etcd3",
    "parse_endpoints",
]
