"""Feast's Redis clients get their socket timeouts before they first connect."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
from feast.infra.online_stores.redis import RedisOnlineStore, RedisOnlineStoreConfig

from features.errors import FeatureStoreError
from features.online_read import _redis_fails_fast, _with_socket_timeouts


@pytest.fixture
def silent_node():
    """A port that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.mark.timeout(60)
def test_a_silent_redis_cluster_node_fails_the_start_within_seconds(silent_node):
    # A cluster client asks its nodes for the slots as it is made: without a timeout
    # from the start, a node that never answers held the worker there for ever.
    config = RedisOnlineStoreConfig(redis_type="redis_cluster", connection_string=silent_node)
    provider = SimpleNamespace(online_store=RedisOnlineStore())
    started = time.monotonic()
    with pytest.raises(FeatureStoreError, match="could not reach the Redis online store"):
        _redis_fails_fast(provider, config)
    assert time.monotonic() - started < 15


def test_timeouts_the_user_set_in_the_connection_string_are_kept():
    config = RedisOnlineStoreConfig(connection_string="r:6379,socket_timeout=5")
    assert _with_socket_timeouts(config).connection_string == (
        "r:6379,socket_timeout=5,socket_connect_timeout=1.0"
    )
