"""Joining an existing Ray cluster: with its token, or one line saying why not, in seconds.

A head started with plain `ray start` (Ray 2.5x and later) turns token authentication on and
writes the token to `~/.ray/auth_token`. A driver that does not send it is refused, and Ray's
`ray.init` then retries for about 20 s, printing a line a second, before a `ConnectionError`
that no longer names the cause. So before `ray.init` we do what Ray's own CLI does when it
joins a cluster (`ray start --address`): with `RAY_AUTH_MODE` unset and a token to be found
(`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token`), token mode is turned on; then
the cluster's GCS is asked once, with that token, for its cluster id (the first call every
driver makes). Silence or a refusal becomes one line naming the address and what to set.
"""

from __future__ import annotations

import os
from typing import Any

from relaytrain.errors import UserError

CONNECT_S = 5.0  # a cluster's GCS that does not answer within this is not there

_TOKEN_HELP = ("set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN (or "
               "RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token as `ray start` wrote it on the head; "
               "`ray get-auth-token` there prints it)")


def check_join(address: str, name: str, error: type[UserError]) -> None:
    """Make this process able to join the Ray cluster at `address` (HOST:PORT of its head, or
    `auto`), or raise `error` with one line starting with `name` (the setting that gave the
    address). Call before `ray.init(address=...)`; `auto` and `ray://` are resolved by Ray."""
    if address == "auto" or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise error(f"{name}: not an address of a Ray cluster's head; expected HOST:PORT "
                    "(the address `ray start --head` printed) or auto")
    headers = _token_headers()
    code, detail = _ask_cluster_id(address, headers)
    if code is None:
        return
    if code == "UNAUTHENTICATED":
        sent = "the token this process found was refused" if headers else (
            "the cluster requires token authentication and this process has no token")
        raise error(f"{name}: {sent}: {_TOKEN_HELP}")
    raise error(f"{name}: no Ray cluster answers there ({code}: {detail}); expected HOST:PORT "
                "of a running cluster's head, or auto")


def _token_headers() -> dict[str, str]:
    """The authorization header Ray will send, after turning token mode on as Ray's CLI does
    (quietly: Ray's own function also logs a warning); empty where token mode is off or this
    Ray has no token authentication (before 2.5x)."""
    try:
        from ray._private.authentication import authentication_token_setup as setup
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:
        return {}
    loader = AuthenticationTokenLoader.instance()
    if setup.AUTH_MODE_ENV_VAR not in os.environ and loader.has_token(ignore_auth_mode=True):
        setup._enable_token_auth()
    if os.environ.get(setup.AUTH_MODE_ENV_VAR, "").lower() != "token" or not loader.has_token():
        return {}
    return dict(loader.get_token_for_http_header())


def _ask_cluster_id(address: str, headers: dict[str, str]) -> tuple[str | None, str]:
    """(None, "") if the GCS at `address` answers, else its gRPC status code's name and detail."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel: Any = grpc.insecure_channel(address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=CONNECT_S,
                          metadata=list(headers.items()) or None)
        return None, ""
    except grpc.RpcError as e:
        return e.code().name, e.details()
    finally:
        channel.close()
