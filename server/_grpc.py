"""The gRPC settings of croupier's server: message sizes and keepalive (the client's are in croupier.client)."""

from __future__ import annotations

from croupier.core.api import MAX_MESSAGE_BYTES

# Keepalive. The server pings idle clients every 30 s (a dead client's connection is dropped) and
# accepts pings from clients as often as every 15 s: at least as often as a croupier client sends
# them (every 5 min, and only while a call is in flight; see croupier.client's CHANNEL_OPTIONS).
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),
]
