"""A driver that cannot join `engine.address` gets one line naming the fix; the token case is
faked with the exceptions Ray 2.60 raises (checked against a real token-auth head: a
ConnectionError after InvalidAuthToken warnings without RAY_AUTH_MODE, an AuthenticationError
with RAY_AUTH_MODE=token and no token)."""

from __future__ import annotations

from ray.exceptions import AuthenticationError

from rayfl.clusterconfig import join_error

REFUSED = ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379")


def test_explicit_address_without_auth_mode_names_the_token_fix():
    line = join_error("10.0.0.5:6379", REFUSED, {})
    assert "\n" not in line
    assert "engine.address='10.0.0.5:6379'" in line and "Failed to connect" in line
    assert "export RAY_AUTH_MODE=token" in line and "RAY_AUTH_TOKEN=" in line
    assert "ray get-auth-token" in line and "ray start --head" in line


def test_a_missing_token_with_token_mode_names_the_token():
    exc = AuthenticationError("Token authentication is enabled but no authentication token")
    line = join_error("10.0.0.5:6379", exc, {"RAY_AUTH_MODE": "token"})
    assert "token is missing here" in line and "RAY_AUTH_TOKEN=" in line
    assert "RAY_AUTH_MODE=token" not in line  # already set


def test_auto_and_token_mode_get_the_plain_unreachable_line():
    for address, env in (("auto", {}), ("10.0.0.5:6379", {"RAY_AUTH_MODE": "token"})):
        line = join_error(address, REFUSED, env)
        assert line.startswith("could not reach the Ray cluster") and "RAY_AUTH" not in line
